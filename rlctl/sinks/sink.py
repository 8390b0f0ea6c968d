"""The metric sink protocol, a null sink and a fan-out that survives broken sinks."""
from __future__ import annotations

import contextlib
import sys
from functools import partialmethod
from typing import Any, Iterable, Mapping, Protocol, Sequence, runtime_checkable


@runtime_checkable
class Sink(Protocol):
    """Where training metrics go: log (several calls may share a step), samples (one table for
    a step), summary (final values), close (once, also after a failed run)."""

    def log(self, metrics: Mapping[str, float], step: int) -> None: ...

    def samples(self, rows: Sequence[Mapping[str, Any]], step: int, table: str = "train") -> None: ...

    def summary(self, values: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def table_columns(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Every column of a sample table: the union of the rows' keys, in first-seen order."""
    return list(dict.fromkeys(str(k) for row in rows for k in row))


def cell_text(value: Any) -> str:
    """One sample value as table text (floats to 4 digits, turns as `role: text | ...`)."""
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


class MultiSink:
    """Fans every call out to `sinks`; a sink that raises is said once and disabled for the run."""

    def __init__(self, sinks: Iterable[Sink]):
        self.sinks: list[Sink] = list(sinks)
        self.failed: dict[str, str] = {}  # sink name -> error text
        self._closed = False

    def _call(self, method: str, *args: Any, **kwargs: Any) -> None:
        for sink in list(self.sinks):
            if method == "samples" and not hasattr(sink, "samples"):
                continue  # a sink written before samples existed still logs metrics
            try:
                getattr(sink, method)(*args, **kwargs)
            except Exception as exc:  # a logger must never kill training
                self._disable(sink, method, exc)

    def _disable(self, sink: Sink, method: str, exc: BaseException) -> None:
        name = getattr(sink, "name", None) or type(sink).__name__
        self.sinks.remove(sink)
        self.failed[name] = f"{type(exc).__name__}: {exc}"
        first_line = (str(exc).splitlines() or [""])[0]
        print(f"rlctl: warning: metric sink {name} failed in {method}() and is disabled: "
              f"{type(exc).__name__}: {first_line}", file=sys.stderr, flush=True)
        if method != "close":   # give it a chance to release files / processes, quietly
            with contextlib.suppress(Exception):
                sink.close()

    log = partialmethod(_call, "log")            # (metrics, step)
    samples = partialmethod(_call, "samples")    # (rows, step, table="train")
    summary = partialmethod(_call, "summary")    # (values)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._call("close")


class NullSink(MultiSink):
    """Accepts everything, does nothing (a fan-out to no sinks)."""

    def __init__(self):
        super().__init__(())
