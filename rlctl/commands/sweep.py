"""`rlctl train -m key=a,b seed=0,1,2`: a Hydra grid run job by job, summarized per cell."""
from __future__ import annotations

import json
import math
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from rich.cells import cell_len
from rich.console import Console
from rich.table import Table

from rlctl.commands.inspect.plots import pyplot
from rlctl.config.compose import check_override_syntax, compose
from rlctl.errors import TrainingFault, UserError, user_message
from rlctl.sinks.jsonl import read_jsonl
from rlctl.train.preflight import check_entries
from rlctl.train.run import run_training

METRICS = ("eval/exact_match", "eval/reward", "eval/length_mean")
COLUMNS = METRICS + ("train_seconds",)
HEADERS = {"eval/exact_match": "exact_match", "eval/reward": "reward",
           "eval/length_mean": "length", "train_seconds": "train s"}


def expand(overrides: Sequence[str]) -> List[List[str]]:
    """The jobs of a sweep: each a plain override list (ConfigError on bad syntax)."""
    check_override_syntax(overrides)
    parsed = OverridesParser.create().parse_overrides(list(overrides))
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def _key(override: str) -> str:
    return override.partition("=")[0].lstrip("+~")


def _pick(job: Sequence[str], keys: Sequence[str], skip_seed: bool) -> List[str]:
    return [o for o in job if o.partition("=")[0] in keys
            and not (skip_seed and _key(o) == "seed")]


def run_sweep(overrides: Sequence[str], recipe: Optional[str], output_dir: Optional[str] = None) -> Dict:
    """Run every job; at the end raise UserError (all failures bad input) or TrainingFault."""
    jobs = expand(overrides)
    for job in jobs:                     # validate every cell before the first one runs
        cfg = compose(job, recipe).cfg
        check_entries(cfg.algo, cfg.task.name, cfg.hardware.backend)
    root = Path(output_dir or compose(jobs[0], recipe).cfg.run.output_dir)
    sweep_dir = root / f"sweep-{time.strftime('%Y%m%d-%H%M%S')}"
    sweep_dir.mkdir(parents=True, exist_ok=True)
    results: List[Dict] = []
    values: Dict[str, set] = {}
    for job in jobs:
        for k, _, v in (o.partition("=") for o in job):
            values.setdefault(k, set()).add(v)
    swept = [k for k, vs in values.items() if len(vs) > 1]      # the keys whose values differ
    try:
        for i, job in enumerate(jobs, 1):
            results.append(_run_job(f"{i}/{len(jobs)}", job, swept, sweep_dir, recipe))
    except KeyboardInterrupt:            # Ctrl-C stops the sweep; keep what finished
        _write(results, summarize(results), sweep_dir, interrupted=True)
        raise
    table = summarize(results)
    _write(results, table, sweep_dir)
    plot(results, sweep_dir / "sweep.png")
    print_table(table, sweep_dir, [_key(k) for k in swept if _key(k) != "seed"], results)
    failed = [r for r in results if r["status"] == "failed"]
    if failed:
        names = "; ".join(r["job"] for r in failed[:3]) + ("; ..." if len(failed) > 3 else "")
        message = (f"{len(failed)} of {len(results)} sweep jobs failed ({names}); "
                   "sweep.json and sweep.md give each one's error")
        bad_input = all(r.get("exit_code") == 2 for r in failed)
        raise (UserError if bad_input else TrainingFault)(message)
    return {"sweep_dir": str(sweep_dir), "cells": table, "jobs": results}


def _run_job(pos: str, job: List[str], swept: List[str], sweep_dir: Path,
             recipe: Optional[str]) -> Dict:
    """One job of the sweep: its result row, ``status`` "ok" or "failed" (+ ``error``)."""
    label = " ".join(_pick(job, swept, skip_seed=False)) or "(one job)"
    print(f"[sweep {pos}] {label}", flush=True)
    name = re.sub(r"[^A-Za-z0-9_.-]", "", "_".join(
        o.partition("=")[0].split(".")[-1] + o.partition("=")[2]
        for o in _pick(job, swept, skip_seed=False)))[:80] or "job"
    cell_overrides = _pick(job, swept, skip_seed=True)
    row = {"overrides": list(job), "job": label, "cell": " ".join(cell_overrides) or "(all)",
           "values": {_key(o): o.partition("=")[2] for o in cell_overrides},
           "status": "ok", "run_dir": None, "eval_end": {}, "train_seconds": None}
    before = set(sweep_dir.iterdir())
    try:
        summary = run_training(list(job) + [f"run.output_dir={sweep_dir}", f"run.name={name}"], recipe)
    except Exception as exc:  # noqa: BLE001 - a failed job is reported, the sweep goes on
        message, code = user_message(exc)
        print(f"error: sweep job {pos} ({label}) failed: {message}; going on with the other jobs",
              file=sys.stderr, flush=True)
        made = sorted(p for p in set(sweep_dir.iterdir()) - before if p.is_dir())
        row.update(status="failed", error=message, exit_code=code,
                   run_dir=str(made[0]) if made else None)
        return row
    row.update(run_dir=summary["run_dir"], eval_end=summary.get("eval_end", {}),
               train_seconds=summary["train_seconds"], warnings=summary.get("warnings", []))
    return row


def _write(results: List[Dict], table: List[Dict], sweep_dir: Path, interrupted: bool = False) -> None:
    data = {"jobs": results, "cells": table, "failed": sum(r["status"] == "failed" for r in results)}
    if interrupted:
        data["interrupted"] = True
    (sweep_dir / "sweep.json").write_text(json.dumps(data, indent=2))
    (sweep_dir / "sweep.md").write_text(markdown(table, results) + "\n")


def summarize(results: List[Dict]) -> List[Dict]:
    """Per cell: finished ``runs``, ``failed`` jobs, each metric's mean and sample std (None: absent)."""
    cells: Dict[str, List[Dict]] = {}
    for r in results:
        cells.setdefault(r["cell"], []).append(r)
    out = []
    for cell, runs in cells.items():
        ok = [r for r in runs if r.get("status", "ok") == "ok"]
        row = {"cell": cell, "values": runs[0].get("values", {}), "runs": len(ok),
               "failed": len(runs) - len(ok)}
        for key in COLUMNS:
            vals = [r["train_seconds"] if key == "train_seconds" else r["eval_end"].get(key) for r in ok]
            vals = [v for v in vals if v is not None and math.isfinite(v)]
            row[key] = {"mean": statistics.fmean(vals) if vals else None,
                        "std": statistics.stdev(vals) if len(vals) > 1 else 0.0}
        out.append(row)
    return out


def _fmt(stat: Dict, sep: str = " ± ", spec: str = ".3f") -> str:
    return "-" if stat["mean"] is None else f"{stat['mean']:{spec}}{sep}{stat['std']:{spec}}"


def _runs(row: Dict) -> str:
    if not row.get("failed"):
        return str(row["runs"])
    return "failed" if not row["runs"] else f"{row['runs']} ({row['failed']} failed)"


def markdown(table: List[Dict], results: Sequence[Dict] = ()) -> str:
    lines = ["| cell | runs | " + " | ".join(COLUMNS) + " |", "|" + "---|" * (len(COLUMNS) + 2)]
    for row in table:
        vals = " | ".join(_fmt(row[k]) for k in COLUMNS)
        lines.append(f"| {row['cell']} | {_runs(row)} | {vals} |")
    failed = [r for r in results if r.get("status") == "failed"]
    if failed:
        lines += ["", "Failed jobs:", ""]
        lines += [f"- `{r['job']}`: {r['error']}" for r in failed]
    return "\n".join(lines)


def short_names(keys: Sequence[str]) -> Dict[str, str]:
    """Each key's shortest unique dotted suffix (``algo.kl.coef``, ``trainer.lr`` -> ``coef``, ``lr``)."""
    out = {}
    for k in keys:
        parts = k.split(".")
        for n in range(1, len(parts) + 1):
            tail = ".".join(parts[-n:])
            if not any(o != k and (o == tail or o.endswith("." + tail)) for o in keys):
                break
        out[k] = tail
    return out


def _metric_cells(row: Dict) -> List[str]:
    return [_fmt(row[k], "±", ".1f" if k == "train_seconds" else ".3f") for k in COLUMNS]


def _table(title: str, first: Dict[str, str], rows: List[List[str]]):
    """A borderless table: ``first`` columns (header -> overflow) then runs and metrics."""
    t = Table(title=title, box=None, padding=(0, 1), pad_edge=False, title_justify="left")
    for head, overflow in first.items():
        t.add_column(head, overflow=overflow, no_wrap=overflow != "fold")
    t.add_column("runs", justify="right")
    for k in COLUMNS:
        t.add_column(HEADERS[k], justify="right", no_wrap=True)
    for r in rows:
        t.add_row(*r)
    return t


def print_table(table: List[Dict], sweep_dir: Path, keys: Sequence[str] = (),
                results: Sequence[Dict] = ()) -> None:
    """One column per swept key when that fits the terminal, else numbered cells with a legend."""

    console = Console()
    title = "sweep: final held-out eval/* metrics, mean±std over seeds"
    heads = short_names(keys)
    t = _table(title, {heads[k]: "ignore" for k in keys} or {"cell": "ignore"},
               [([row["values"].get(k, "") for k in keys] if keys else [row["cell"]])
                + [_runs(row)] + _metric_cells(row) for row in table])
    widths = [max([cell_len(str(c.header))] + [cell_len(str(x)) for x in c.cells])
              for c in t.columns]       # what a borderless table needs with no cell cut
    if sum(widths) + 2 * (len(widths) - 1) <= console.width:
        if any(heads[k] != k for k in keys):
            console.print("swept: " + ", ".join(f"{heads[k]} = {k}" for k in keys), highlight=False)
    else:
        for i, row in enumerate(table, 1):
            console.print(f"cell {i}: {row['cell']}", highlight=False)
        t = _table(title, {"cell": "fold"}, [[str(i), _runs(row)] + _metric_cells(row)
                                             for i, row in enumerate(table, 1)])
    console.print(t)
    for r in results:
        if r.get("status") == "failed":
            console.print(f"failed: {r['job']}: {r['error']}", highlight=False,
                          soft_wrap=True)        # the terminal wraps: no newline inside a path
    console.print(f"sweep dir: {sweep_dir} (sweep.json, sweep.md, sweep.png)", highlight=False,
                  soft_wrap=True)


def plot(results: List[Dict], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    cells: Dict[str, List[List[tuple]]] = {}
    for r in results:
        if r.get("status", "ok") == "ok":
            metrics = Path(r["run_dir"]) / "metrics.jsonl"
            rows = read_jsonl(metrics) if metrics.exists() else []
            cells.setdefault(r["cell"], []).append(
                [(x["step"], x["eval/exact_match"]) for x in rows if "eval/exact_match" in x])
    for cell, curves in cells.items():
        steps = sorted({s for c in curves for s, _ in c})
        mean = [statistics.fmean([v for c in curves for s2, v in c if s2 == s]) for s in steps]
        ax.plot(steps, mean, marker="o", ms=3, label=f"{cell} (n={len(curves)})")
    ax.set_xlabel("step")
    ax.set_ylabel("held-out exact-match (greedy)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    if cells:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
