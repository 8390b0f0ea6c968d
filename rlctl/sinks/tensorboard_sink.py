"""TensorBoard event files under `<run_dir>/tensorboard/`; a failure disables only this sink."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

from .sink import cell_text, table_columns

TENSORBOARD_DIR = "tensorboard"
# Characters TensorBoard's Markdown would read as markup: each is escaped with a backslash.
MARKDOWN_ESCAPES = "\\`*_[]|#"


def markdown_cell(value: Any) -> str:
    """A value as one markdown table cell: HTML and markup escaped, line breaks as <br>."""
    text = cell_text(value).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    for char in MARKDOWN_ESCAPES:
        text = text.replace(char, "\\" + char)
    return text.replace("\r\n", "\n").replace("\n", "<br>")


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(markdown_cell(c) for c in columns) + " |",
             "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(markdown_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


class TensorboardSink:
    name = "tensorboard"

    def __init__(self, run_dir: str | Path, flush_secs: int = 10):
        self.log_dir = Path(run_dir) / TENSORBOARD_DIR
        self.flush_secs = flush_secs
        self._writer: Any = None
        self._last_step = 0
        self._closed = False

    def _open(self) -> Any:
        if self._writer is None and not self._closed:
            from torch.utils.tensorboard import SummaryWriter  # heavy: only when this sink is used

            self._writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=self.flush_secs)
        return self._writer

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        writer = self._open()
        if writer is None:
            return
        self._last_step = max(self._last_step, int(step))
        for key, value in metrics.items():
            writer.add_scalar(str(key), float(value), global_step=int(step))

    def samples(self, rows: Sequence[Mapping[str, Any]], step: int, table: str = "train") -> None:
        writer = self._open()
        if writer is None or not rows:
            return
        self._last_step = max(self._last_step, int(step))
        columns = table_columns(rows)
        text = markdown_table(columns, [[row.get(c) for c in columns] for row in rows])
        writer.add_text(f"samples/{table}", text, global_step=int(step))

    def summary(self, values: Mapping[str, Any]) -> None:
        writer = self._open()
        if writer is None or not values:
            return
        rows = [[str(k), v if isinstance(v, (str, int, float, bool)) or v is None
                 else json.dumps(v, default=str)] for k, v in values.items()]
        writer.add_text("summary", markdown_table(["key", "value"], rows),
                        global_step=self._last_step)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._writer is not None:
            self._writer.close()
            self._writer = None
