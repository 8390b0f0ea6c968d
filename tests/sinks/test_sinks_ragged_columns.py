"""A sample table whose rows do not all hold the same columns (a named reward only some
rows have) shows every column in every table sink: the union, in first-seen order, an empty
cell where a row has none; no column is dropped because the first row lacks it."""
import io

from rlctl.sinks import ConsoleSink
from rlctl.sinks.tensorboard_sink import TensorboardSink

ROWS = [{"prompt": "p0", "reward": 1.0}, {"prompt": "p1", "reward": 0.0, "reward/tool": 0.5}]


def test_the_console_table_shows_a_column_the_first_row_lacks(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    out = io.StringIO()
    sink = ConsoleSink(total_steps=2, file=out)
    sink.samples(ROWS, step=1)
    sink.close()
    text = out.getvalue()                     # the header wraps at "/": reward/ above tool
    assert "reward/" in text and "tool" in text
    assert [ln.split() for ln in text.splitlines() if ln.startswith(("p0", "p1"))] == [["p0", "1"], ["p1", "0", "0.5"]]


def test_the_tensorboard_table_shows_a_column_the_first_row_lacks(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    sink = TensorboardSink(tmp_path)
    sink.samples(ROWS, step=1)
    sink.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    [event] = acc.Tensors("samples/train/text_summary")
    lines = event.tensor_proto.string_val[0].decode().splitlines()
    assert lines[0] == "| prompt | reward | reward/tool |" and lines[2:] == ["| p0 | 1 |  |", "| p1 | 0 | 0.5 |"]
