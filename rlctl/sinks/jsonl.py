"""`metrics.jsonl` and `samples.jsonl` (docs/metrics.md), each line flushed when written."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping, Sequence


def _json_safe(value: Any) -> Any:
    """``value`` as strict JSON: non-finite numbers None, what float() refuses str()."""
    if isinstance(value, (bool, int, str)) or value is None:
        return value
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    try:
        number = float(value)
    except (TypeError, ValueError):
        return str(value)
    return number if math.isfinite(number) else None


class JsonlSink:
    name = "jsonl"

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        row: dict[str, Any] = {"step": int(step)}
        for key, value in metrics.items():
            value = float(value)
            row[str(key)] = value if math.isfinite(value) else None
        self._file.write(json.dumps(row, allow_nan=False) + "\n")
        self._file.flush()

    def samples(self, rows: Sequence[Mapping[str, Any]], step: int, table: str = "train") -> None:
        pass  # rows go to samples.jsonl (SamplesFile): a bad row can never stop this file

    def summary(self, values: Mapping[str, Any]) -> None:
        self._file.write(json.dumps({"summary": _json_safe(dict(values))}, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


class SamplesFile:
    """The sample tables as JSON lines; log() ignores metrics."""

    name = "samples.jsonl"

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._file: Any = None

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        pass

    def samples(self, rows: Sequence[Mapping[str, Any]], step: int, table: str = "train") -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")
        lines = []
        for row in rows:
            line = {"table": str(table), "step": int(step)}
            line.update({str(k): _json_safe(v) for k, v in row.items() if k not in line})
            lines.append(json.dumps(line, allow_nan=False) + "\n")
        self._file.write("".join(lines))
        self._file.flush()

    def summary(self, values: Mapping[str, Any]) -> None:
        pass

    def close(self) -> None:
        if self._file is not None and not self._file.closed:
            self._file.close()


def _json_lines(path: str | Path, what: str) -> list[tuple[int, Any]]:
    """(line number, decoded JSON or None where the line is not JSON) of each non-blank line."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:   # not a file these sinks wrote
        raise ValueError(f"cannot read {path}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at "
                         f"offset {exc.start}); {what} holds one JSON object per line") from None
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                out.append((number, json.loads(line)))
            except json.JSONDecodeError:
                out.append((number, None))  # torn (the last line of a run killed mid-write) or damaged
    return out


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The metric rows of a metrics.jsonl file (a torn last line is skipped)."""
    return [obj for _, obj in _json_lines(path, "metrics.jsonl") if isinstance(obj, dict) and "step" in obj]


def read_samples(path: str | Path, table: str | None = None, step: int | None = None,
                 skipped: list[int] | None = None) -> list[dict[str, Any]]:
    """The rows of a samples.jsonl file in order, only `table`'s and/or `step`'s if given;
    ``skipped`` gets the numbers of the lines that are not sample rows (torn, damaged)."""
    rows = []
    for number, obj in _json_lines(path, "samples.jsonl"):
        if not (isinstance(obj, dict) and "table" in obj and "step" in obj):
            if skipped is not None:
                skipped.append(number)
        elif (table is None or obj["table"] == table) and (step is None or obj["step"] == step):
            rows.append(obj)
    return rows
