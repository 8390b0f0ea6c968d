"""Console progress: a live rich bar on a terminal, plain lines elsewhere.

On a TTY: a rich progress row `bar  step/total  elapsed  eta ETA` with the key figures on
the line below, updated on every log() call. Off a TTY (CI logs, subprocess tests, `| tee`): no control codes, one
line per `print_every` steps, e.g.

    step 20/100 | reward/mean 0.5125 | policy/clip_frac 0.0123 | length/mean 6.1 | perf/tokens_per_s 2345 | 4.1s<16.4s

Steps follow the trainer: step 0 is the evaluation before training, 1..total_steps the
updates. Figures show the latest value of each key (an eval figure stays shown until
the next evaluation). Keys that were never logged are left out.

samples(): a table titled with its table and step (rlctl/sinks/console_table.py: one line
per row, cut to the terminal width), printed through the console that the live view draws
on, so rich prints it above the view and the view stays intact; off a TTY, plain text.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any, Mapping, Sequence, TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from .base import to_float
from .console_table import sample_table

DEFAULT_KEYS = (
    "reward/mean",
    "eval/exact_match",
    "policy/kl_ref",
    "policy/clip_frac",
    "length/mean",
    "perf/tokens_per_s",
)
# `rlctl reward-model train`: the Bradley-Terry fit's own figures (rlctl/reward_models/fit.py).
REWARD_MODEL_KEYS = (
    "train/loss",
    "train/accuracy",
    "eval/pairwise_accuracy",
    "eval/margin",
)
# Short labels for the live row, where width is scarce.
SHORT_LABELS = {
    "train/loss": "loss",
    "train/accuracy": "acc",
    "eval/pairwise_accuracy": "eval_acc",
    "eval/margin": "eval_margin",
    "reward/mean": "reward",
    "eval/exact_match": "exact",
    "policy/kl_ref": "kl_ref",
    "policy/clip_frac": "clip",
    "length/mean": "len",
    "perf/tokens_per_s": "tok/s",
}


def format_value(value: float) -> str:
    if math.isnan(value) or math.isinf(value):
        return str(value)
    if value != 0 and (abs(value) >= 1000):
        return f"{value:.0f}"
    return f"{value:.4g}"


def _format_seconds(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class ConsoleSink:
    name = "console"

    def __init__(
        self,
        total_steps: int,
        keys: Sequence[str] = DEFAULT_KEYS,
        *,
        print_every: int | None = None,
        live: bool | None = None,
        file: TextIO | None = None,
        description: str = "train",
    ):
        """live=None picks the rich view when `file` (default stdout) is a TTY.
        print_every=None prints about 20 lines per run off a TTY."""
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
        self._first_step: int | None = None
        self._last_step: int | None = None
        self._printed_step: int | None = None
        self._plain_console: Console | None = None
        self._closed = False

    # ------------------------------------------------------------ formatting
    def figures(self, short: bool = False) -> str:
        parts = []
        for key in self.keys:
            if key in self.latest:
                label = SHORT_LABELS.get(key, key) if short else key
                parts.append(f"{label} {format_value(self.latest[key])}")
        return ("  " if short else " | ").join(parts)

    def line(self, step: int) -> str:
        elapsed = time.perf_counter() - (self._t0 or time.perf_counter())
        text = f"step {step}/{self.total_steps}"
        figures = self.figures()
        if figures:
            text += " | " + figures
        timing = _format_seconds(elapsed)
        done = step - (self._first_step or 0)
        if 0 < done and step < self.total_steps:
            timing += "<" + _format_seconds(elapsed / done * (self.total_steps - step))
        return text + " | " + timing

    # ------------------------------------------------------------ sink API
    def _start_live(self) -> None:
        console = Console(file=self.file) if self.file is not None else None
        self._progress = FiguresProgress(
            TextColumn("[bold]{task.description}"),
            BarColumn(bar_width=30),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=console,
            refresh_per_second=4,
        )
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
                self.latest[key] = to_float(metrics[key])
        self._last_step = step
        if self.live:
            if self._progress is None:
                self._start_live()
            completed = min(max(step, 0), self.total_steps)
            self._progress.figures = "  " + self.figures(short=True)
            self._progress.update(self._task, completed=completed)
            return
        due = (
            self._printed_step is None
            or step >= self._printed_step + self.print_every
            or step == self.total_steps
        )
        if due and step != self._printed_step:
            self._print(step)

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

    def _print(self, step: int) -> None:
        print(self.line(step), file=self.file if self.file is not None else sys.stdout, flush=True)
        self._printed_step = step

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
            self._print(self._last_step)


class FiguresProgress(Progress):
    """The bar row, then the key figures on a line of their own (an 80-column terminal
    has no room for both on one row)."""

    figures = ""

    def get_renderables(self):
        yield self.make_tasks_table(self.tasks)
        if self.figures:
            yield Text(self.figures, overflow="ellipsis")
