"""Console progress: a live rich bar on a TTY, else a plain line per `print_every` steps."""
from __future__ import annotations

import math
import re
import sys
import time
from typing import Any, Mapping, Sequence, TextIO

from rich import box
from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)
from rich.table import Table
from rich.text import Text

from .sink import cell_text, table_columns

DEFAULT_KEYS = ("reward/mean", "rewards/accuracy", "eval/exact_match", "policy/kl_ref", "policy/clip_frac",
                "length/mean", "perf/tokens_per_s")
REWARD_MODEL_KEYS = ("train/loss", "train/accuracy", "eval/pairwise_accuracy", "eval/margin")
# Short labels for the live row; REWARD_MODEL_KEYS: `rlctl reward-model train`'s figures
SHORT_LABELS = {"train/loss": "loss", "train/accuracy": "acc", "eval/pairwise_accuracy": "eval_acc",
                "eval/margin": "eval_margin", "reward/mean": "reward", "rewards/accuracy": "pair_acc", "eval/exact_match": "exact",
                "policy/kl_ref": "kl_ref", "policy/clip_frac": "clip", "length/mean": "len",
                "perf/tokens_per_s": "tok/s"}


def format_value(value: float) -> str:
    if not math.isfinite(value):
        return str(value)
    return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def _format_seconds(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class ConsoleSink:
    name = "console"

    def __init__(self, total_steps: int, keys: Sequence[str] = DEFAULT_KEYS, *,
                 print_every: int | None = None, live: bool | None = None,
                 file: TextIO | None = None, description: str = "train"):
        """live=None: the rich view on a TTY; print_every=None: about 20 plain lines a run."""
        self.total_steps = max(int(total_steps), 0)
        self.keys = list(keys)
        self.file = file
        self.print_every = print_every or max(1, math.ceil(self.total_steps / 20))
        stream = file if file is not None else sys.stdout
        if live is None:
            try:
                live = stream.isatty()
            except Exception:
                live = False
        self.live = bool(live)
        self.description = description
        self.latest: dict[str, float] = {}
        self._progress: Any = None
        self._task: Any = None
        self._t0: float | None = None
        self._first_step = self._last_step = self._printed_step = None   # int once logged
        self._plain_console: Console | None = None
        self._closed = False

    def line(self, step: int) -> str:
        """The plain line: `step s/total | key value | ... | elapsed<eta`."""
        parts = [f"step {step}/{self.total_steps}"]
        for key in self.keys:
            if key in self.latest:
                parts.append(f"{key} {format_value(self.latest[key])}")
        elapsed = time.perf_counter() - (self._t0 or time.perf_counter())
        timing = _format_seconds(elapsed)
        done = step - (self._first_step or 0)
        if 0 < done and step < self.total_steps:
            timing += "<" + _format_seconds(elapsed / done * (self.total_steps - step))
        return " | ".join(parts + [timing])

    def _start_live(self) -> None:
        console = Console(file=self.file) if self.file is not None else None
        self._progress = FiguresProgress(
            TextColumn("[bold]{task.description}"), BarColumn(bar_width=30), MofNCompleteColumn(),
            TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), console=console,
            refresh_per_second=4)
        self._progress.start()
        self._task = self._progress.add_task(self.description, total=self.total_steps)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if self._closed:
            return
        step = int(step)
        if self._t0 is None:
            self._t0 = time.perf_counter()
            self._first_step = step
        for key in self.keys:
            if key in metrics:
                self.latest[key] = float(metrics[key])
        self._last_step = step
        if self.live:
            if self._progress is None:
                self._start_live()
            completed = min(max(step, 0), self.total_steps)
            self._progress.figures = "  " + "  ".join(   # the live row: short labels
                f"{SHORT_LABELS.get(k, k)} {format_value(self.latest[k])}"
                for k in self.keys if k in self.latest)
            self._progress.update(self._task, completed=completed)
            return
        due = (self._printed_step is None or step >= self._printed_step + self.print_every
               or step == self.total_steps)
        if due and step != self._printed_step:
            print(self.line(step), file=self.file or sys.stdout, flush=True)
            self._printed_step = step

    def samples(self, rows: Sequence[Mapping[str, Any]], step: int, table: str = "train") -> None:
        if self._closed or not rows:
            return
        if self.live:
            if self._progress is None:
                self._start_live()
            console = self._progress.console  # the live view's: it prints above the view
        else:
            if self._plain_console is None:  # file=None: sys.stdout as it is at each print
                self._plain_console = Console(file=self.file, highlight=False)
            console = self._plain_console
        console.print(sample_table(rows, int(step), str(table), console.width))

    def summary(self, values: Mapping[str, Any]) -> None:
        pass  # the run report prints final values

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        elif not self.live and self._last_step is not None and self._last_step != self._printed_step:
            print(self.line(self._last_step), file=self.file or sys.stdout, flush=True)


class FiguresProgress(Progress):
    """The bar row, then the key figures on a line of their own."""

    figures = ""

    def get_renderables(self):
        yield self.make_tasks_table(self.tasks)
        if self.figures:
            yield Text(self.figures, overflow="ellipsis")


# ---- the sample table: short columns keep their width, the long texts share the rest
SHORT = 12  # a column this wide or narrower is never cut
HEADER_PARTS = re.compile(r"[^/_]+[/_]?|[/_]")


def _one_line(value: Any) -> str:
    return cell_text(value).replace("\r\n", "\n").replace("\n", "\\n")


def header_lines(key: str, width: int) -> str:
    """`key` broken after '/' and '_' into lines of at most `width` (longer parts kept whole)."""
    lines: list[str] = []
    for part in HEADER_PARTS.findall(key):
        if lines and len(lines[-1]) + len(part) <= width:
            lines[-1] += part
        else:
            lines.append(part)
    return "\n".join(lines)


def sample_table(rows: Sequence[Mapping[str, Any]], step: int, table: str, width: int) -> Table:
    """The rows as a rich Table at most `width` wide; Text cells, so never read as markup."""
    columns = table_columns(rows)
    if "step" in columns and all(row.get("step") == step for row in rows):
        columns.remove("step")
    if "user_prompt" in columns:       # the user's text, not the chat template's header
        columns.remove("user_prompt")
    cells = {key: [_one_line(row.get("user_prompt", row.get(key)) if key == "prompt"
                             else row.get(key)) for row in rows] for key in columns}
    widths = {key: max(max(len(c) for c in cells[key]),
                       min(max(len(p) for p in HEADER_PARTS.findall(key) or [key]), SHORT), 1)
              for key in columns}
    long = [key for key in columns if widths[key] > SHORT]
    left = width - (len(columns) - 1) - sum(widths[k] for k in columns if k not in long)
    for key in long:  # the long texts share what the short columns leave (at least 4 each)
        widths[key] = min(widths[key], max(left // len(long), 4))
    view = Table(title=f"samples: {table}, step {step}", title_justify="left",
                 box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 0))
    for key in columns:
        numeric = all(isinstance(row.get(key), (int, float)) for row in rows)
        head = key if key in long else header_lines(key, widths[key])
        view.add_column(Text(head, overflow="ellipsis"), width=widths[key], no_wrap=True,
                        overflow="ellipsis", justify="right" if numeric else "left")
    for i in range(len(rows)):
        view.add_row(*(Text(cells[key][i], no_wrap=True, overflow="ellipsis") for key in columns))
    return view
