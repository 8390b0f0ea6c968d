"""Behaviour fingerprint of a checkout: a fixed set of short runs, every non-timing metric.

    python bench/behaviour.py record OUT.json [--only NAME ...]   # run the cases, write values
    python bench/behaviour.py compare A.json B.json                # exit 1 on any difference

A restructuring that claims "behaviour identical" records before and after and compares:
every metric of every step must be equal (floats to a relative 1e-6, which admits only a
different summation order of the same float32 numbers; timings and throughput are dropped).
Each case is `rlctl train` in a fresh process with OMP_NUM_THREADS=1.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

COMMON = ["logger=jsonl", "trainer.checkpoint_every=0", "run.save_model=false"]
CASES = {
    "default": ["trainer.steps=12", "trainer.eval_every=6"],
    "ppo_lora_adaptive_kl": ["algo=ppo", "model.lora.enabled=true", "algo.kl.coef=0.05",
                             "algo.kl.target=0.01", "trainer.steps=8", "trainer.eval_every=4"],
    "episodic_calculator": ["--recipe", "recipes/calculator-tool.yaml", "trainer.steps=4",
                            "trainer.eval_every=4"],
    "server_engine": ["rollout.engine=server", "trainer.steps=6", "trainer.eval_every=3"],
    "deepspeed_2rank": ["hardware=deepspeed", "hardware.num_processes=2", "hardware.zero_stage=2",
                        "trainer.steps=4", "trainer.eval_every=4"],
    "async_staleness0": ["trainer.async_rollout.enabled=true",
                         "trainer.async_rollout.max_staleness=0", "trainer.steps=12",
                         "trainer.eval_every=6"],
}
TIMING_PREFIXES = ("time/", "perf/")


def _timing(key: str) -> bool:
    return key.startswith(TIMING_PREFIXES) or key.endswith("_s") or "per_s" in key


def run_case(name: str, root: Path) -> list:
    """One case's metrics.jsonl rows without timing keys."""
    run_dir = root / name
    argv = [sys.executable, "-m", "rlctl.cli", "train", *CASES[name], *COMMON, f"run.dir={run_dir}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", WANDB_MODE="offline",
               TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"case {name} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in row.items() if not _timing(k)} for row in rows]


def record(out: Path, only: list) -> None:
    names = only or list(CASES)
    with tempfile.TemporaryDirectory(prefix="rlctl-behaviour-") as tmp:
        result = {}
        for name in names:
            result[name] = run_case(name, Path(tmp))
            print(f"{name}: {len(result[name])} rows", flush=True)
    out.write_text(json.dumps(result, indent=1, sort_keys=True))


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-9)
    return a == b


def compare(a_path: Path, b_path: Path) -> int:
    a, b = json.loads(a_path.read_text()), json.loads(b_path.read_text())
    bad = 0
    for name in sorted(set(a) & set(b)):
        if len(a[name]) != len(b[name]):
            print(f"{name}: {len(a[name])} rows vs {len(b[name])}")
            bad += 1
            continue
        for ra, rb in zip(a[name], b[name]):
            for key in sorted(set(ra) | set(rb)):
                if key not in ra or key not in rb or not _same(ra[key], rb[key]):
                    print(f"{name} step {ra.get('step')}: {key}: {ra.get(key)} vs {rb.get(key)}")
                    bad += 1
    missing = sorted(set(a) ^ set(b))
    if missing:
        print("cases in one file only:", ", ".join(missing))
    print("identical" if not bad else f"{bad} differences")
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "record":
        only = sys.argv[sys.argv.index("--only") + 1:] if "--only" in sys.argv else []
        record(Path(sys.argv[2]), only)
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        raise SystemExit(compare(Path(sys.argv[2]), Path(sys.argv[3])))
    else:
        raise SystemExit(__doc__)
