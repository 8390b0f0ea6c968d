"""The short table printed at the end of a run."""
from __future__ import annotations

from typing import Any, Dict


def print_summary(summary: Dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="rlctl run summary", show_header=True)
    table.add_column("metric")
    table.add_column("start", justify="right")
    table.add_column("end", justify="right")
    start, end = summary.get("eval_start", {}), summary.get("eval_end", {})
    for key in sorted(set(start) | set(end)):
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        table.add_row(key, fmt(start.get(key)), fmt(end.get(key)))
    table.add_row("train time (s)", "", f"{summary['train_seconds']:.1f}")
    table.add_row("tokens/s", "", f"{summary['tokens_per_s']:.0f}")
    console = Console()
    console.print(table)
    console.print(f"run dir: {summary['run_dir']}")
