"""The metric sink protocol, a null sink and a fan-out that survives broken sinks.

The trainer logs through one `Sink` and never asks which loggers are on: a missing
logger is a `NullSink`, several are a `MultiSink` (a null sink instead of `if wandb:`
branches). Metric keys follow the schema of docs/metrics.md (`reward/mean`,
`policy/clip_frac`, ...).

Sample rows (`samples()`): dicts of JSON values (str, int, float, bool, None, and an
episode's `turns`: a list of {role, text, ...} dicts), every row with the same keys in the
same order; each sink keeps the columns in that order and assumes no fixed list. `table`
names the table: "train" or "eval". Sinks that show one line per cell write a list of
turns as `cell_text` does: `model: 8 | observation: higher | model: 1 2`.
"""

from __future__ import annotations

import math
import sys
from typing import Any, Iterable, Mapping, Protocol, Sequence, runtime_checkable


@runtime_checkable
class Sink(Protocol):
    """Where training metrics go.

    log:     one call per (step, group of metrics); several calls may share a step.
    samples: one table of sample rows for a step (see the module docstring).
    summary: final values of the run (best/last eval scores, wall time ...).
    close:   flush and release; called once, also after a failed run.
    """

    def log(self, metrics: Mapping[str, float], step: int) -> None: ...

    def samples(self, rows: Sequence[Mapping[str, Any]], step: int, table: str = "train") -> None: ...

    def summary(self, values: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


class NullSink:
    """Accepts everything, does nothing."""

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        pass

    def samples(self, rows: Sequence[Mapping[str, Any]], step: int, table: str = "train") -> None:
        pass

    def summary(self, values: Mapping[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def to_float(value: Any) -> float:
    """A Python float from a float, int, 0-d tensor or numpy scalar (`float()` calls
    `.item()` on tensors and numpy values)."""
    return float(value)


def finite_or_none(value: float) -> float | None:
    """`value`, or None when it is NaN or +-inf (for strict JSON)."""
    return value if math.isfinite(value) else None


def cell_text(value: Any) -> str:
    """One sample value as table text: "" for None, true/false, floats to 4 significant
    digits, an episode's turns as `role: text` joined by ` | `, anything else as str()."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list) and value and all(isinstance(v, Mapping) and "role" in v for v in value):
        return " | ".join(f"{v['role']}: {v.get('text', '')}" + (" [truncated]" if v.get("truncated") else "")
                          for v in value)
    return str(value)


def sink_name(sink: Any) -> str:
    return getattr(sink, "name", None) or type(sink).__name__


class MultiSink:
    """Fans every call out to `sinks`, in order.

    A sink that raises is reported with ONE line on stderr (sink name and error) and is
    disabled for the rest of the run; the other sinks and training carry on. This holds
    for log(), samples(), summary() and close() alike (close() is still called on every sink that
    has not failed).
    """

    def __init__(self, sinks: Iterable[Sink]):
        self.sinks: list[Sink] = list(sinks)
        self.failed: dict[str, str] = {}  # sink name -> error text
        self._closed = False

    def _call(self, method: str, *args: Any) -> None:
        for sink in list(self.sinks):
            if method == "samples" and not hasattr(sink, "samples"):
                continue  # a sink written before samples existed still logs metrics
            try:
                getattr(sink, method)(*args)
            except Exception as exc:  # a logger must never kill training
                self._disable(sink, method, exc)

    def _disable(self, sink: Sink, method: str, exc: BaseException) -> None:
        name = sink_name(sink)
        self.sinks.remove(sink)
        self.failed[name] = f"{type(exc).__name__}: {exc}"
        first_line = (str(exc).splitlines() or [""])[0]
        print(
            f"rlctl: warning: metric sink {name} failed in {method}() and is disabled: "
            f"{type(exc).__name__}: {first_line}",
            file=sys.stderr,
            flush=True,
        )
        if method != "close":
            try:  # give it a chance to release files / processes, quietly
                sink.close()
            except Exception:
                pass

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self._call("log", metrics, step)

    def samples(self, rows: Sequence[Mapping[str, Any]], step: int, table: str = "train") -> None:
        self._call("samples", rows, step, table)

    def summary(self, values: Mapping[str, Any]) -> None:
        self._call("summary", values)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._call("close")

    def __enter__(self) -> "MultiSink":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
