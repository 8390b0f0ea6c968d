"""`rlctl train -m key=a,b seed=0,1,2`: run a grid of overrides, one run directory each.

The grid is expanded with Hydra's own override parser and basic sweeper (comma lists,
`range(...)`, `choice(...)`). Jobs run one after the other in this process, each in
`<output_dir>/sweep-<time>/`; then a table of final metrics per cell (the overrides
other than `seed`), with the mean and the spread (sample std) over seeds, goes to the
terminal, to `sweep.json` / `sweep.md`, and a plot of the held-out exact-match curves
(mean per cell) to `sweep.png`.
"""
from __future__ import annotations

import json
import re
import math
import statistics
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from rlctl.compose import ConfigError

METRICS = ("eval/exact_match", "eval/reward", "eval/length_mean")


def expand(overrides: Sequence[str]) -> List[List[str]]:
    """The jobs of a sweep: each a plain override list (ConfigError on bad syntax)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except Exception as exc:  # noqa: BLE001
        raise ConfigError(f"cannot parse sweep overrides: {' '.join(str(exc).split())[:200]}") from None
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def _varying(jobs: List[List[str]]) -> List[str]:
    """The override keys whose values differ between jobs (the swept ones)."""
    values: Dict[str, set] = {}
    for job in jobs:
        for o in job:
            k, _, v = o.partition("=")
            values.setdefault(k, set()).add(v)
    return [k for k, vs in values.items() if len(vs) > 1]


def _pick(job: Sequence[str], keys: Sequence[str], skip_seed: bool) -> List[str]:
    return [o for o in job if o.partition("=")[0] in keys
            and not (skip_seed and o.partition("=")[0].lstrip("+") == "seed")]


def _curve(run_dir: Path) -> List[tuple]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x] \
        if (run_dir / "metrics.jsonl").exists() else []
    return [(r["step"], r["eval/exact_match"]) for r in rows if "step" in r and "eval/exact_match" in r]


def run_sweep(overrides: Sequence[str], recipe: Optional[str], output_dir: Optional[str] = None) -> Dict:
    from rlctl.compose import compose
    from rlctl.engine.run import run_training

    jobs = expand(overrides)
    for job in jobs:                     # validate every cell before the first one runs
        compose(job, recipe)
    root = Path(output_dir or compose(jobs[0], recipe).cfg.run.output_dir)
    sweep_dir = root / f"sweep-{time.strftime('%Y%m%d-%H%M%S')}"
    sweep_dir.mkdir(parents=True, exist_ok=True)
    results = []
    swept = _varying(jobs)
    for i, job in enumerate(jobs, 1):
        label = _pick(job, swept, skip_seed=False)
        print(f"[sweep {i}/{len(jobs)}] {' '.join(label) or '(one job)'}", flush=True)
        name = re.sub(r"[^A-Za-z0-9_.-]", "", "_".join(
            o.partition("=")[0].split(".")[-1] + o.partition("=")[2] for o in label))[:80] or "job"
        summary = run_training(list(job) + [f"run.output_dir={sweep_dir}", f"run.name={name}"], recipe)
        cell = " ".join(_pick(job, swept, skip_seed=True)) or "(all)"
        results.append({"overrides": list(job), "cell": cell, "run_dir": summary["run_dir"],
                        "eval_end": summary.get("eval_end", {}), "train_seconds": summary["train_seconds"]})
    table = summarize(results)
    (sweep_dir / "sweep.json").write_text(json.dumps({"jobs": results, "cells": table}, indent=2))
    (sweep_dir / "sweep.md").write_text(markdown(table) + "\n")
    plot(results, sweep_dir / "sweep.png")
    print_table(table, sweep_dir)
    return {"sweep_dir": str(sweep_dir), "cells": table, "jobs": results}


def summarize(results: List[Dict]) -> List[Dict]:
    cells: Dict[str, List[Dict]] = {}
    for r in results:
        cells.setdefault(r["cell"], []).append(r)
    out = []
    for cell, runs in cells.items():
        row = {"cell": cell, "runs": len(runs)}
        for key in METRICS + ("train_seconds",):
            vals = [r["train_seconds"] if key == "train_seconds" else r["eval_end"].get(key) for r in runs]
            vals = [v for v in vals if v is not None]
            row[key] = {"mean": statistics.fmean(vals) if vals else math.nan,
                        "std": statistics.stdev(vals) if len(vals) > 1 else 0.0}
        out.append(row)
    return out


def markdown(table: List[Dict]) -> str:
    keys = METRICS + ("train_seconds",)
    lines = ["| cell | runs | " + " | ".join(keys) + " |", "|" + "---|" * (len(keys) + 2)]
    for row in table:
        vals = " | ".join(f"{row[k]['mean']:.3f} ± {row[k]['std']:.3f}" for k in keys)
        lines.append(f"| {row['cell']} | {row['runs']} | {vals} |")
    return "\n".join(lines)


def print_table(table: List[Dict], sweep_dir: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="sweep: final held-out metrics (mean ± std over seeds)")
    t.add_column("cell")
    t.add_column("runs", justify="right")
    for k in METRICS + ("train_seconds",):
        t.add_column(k, justify="right")
    for row in table:
        t.add_row(row["cell"], str(row["runs"]),
                  *[f"{row[k]['mean']:.3f} ± {row[k]['std']:.3f}" for k in METRICS + ("train_seconds",)])
    console = Console()
    console.print(t)
    console.print(f"sweep dir: {sweep_dir} (sweep.json, sweep.md, sweep.png)")


def plot(results: List[Dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    cells: Dict[str, List[List[tuple]]] = {}
    for r in results:
        cells.setdefault(r["cell"], []).append(_curve(Path(r["run_dir"])))
    for cell, curves in cells.items():
        steps = sorted({s for c in curves for s, _ in c})
        mean = [statistics.fmean([v for c in curves for s2, v in c if s2 == s]) for s in steps]
        ax.plot(steps, mean, marker="o", ms=3, label=f"{cell} (n={len(curves)})")
    ax.set_xlabel("step")
    ax.set_ylabel("held-out exact-match (greedy)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
