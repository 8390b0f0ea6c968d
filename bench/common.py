"""Shared helpers for the benchmark scripts: run `rlctl train` in a subprocess, read its run."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple


def run_rlctl(overrides: List[str], out_dir: Path, name: str) -> Tuple[Dict, List[Dict]]:
    """(summary.json, metrics rows) of one `rlctl train` run, or raise with its last error line."""
    rlctl = str(Path(sys.executable).parent / "rlctl")
    cmd = [rlctl, "train", "logger=jsonl", "logger.console=false", "run.save_model=false",
           f"run.output_dir={out_dir}", f"run.name={name}", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if proc.returncode != 0:
        raise RuntimeError((proc.stderr.strip().splitlines() or ["failed"])[-1])
    run = sorted(p for p in out_dir.iterdir() if p.name.endswith(name))[-1]
    rows = [r for r in (json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x)
            if "step" in r]                      # (the last line holds the run summary)
    return json.loads((run / "summary.json").read_text()), rows


def median_step_s(rows: List[Dict], skip: int = 3) -> float:
    steps = [r["time/rollout_s"] + r["time/update_s"] for r in rows if r["step"] > skip and "time/update_s" in r]
    return statistics.median(steps)


def markdown(header: List[str], rows: List[List[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)
