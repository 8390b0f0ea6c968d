"""The TensorBoard sink, read back with TensorBoard's own reader (EventAccumulator)."""

import math
import subprocess
import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import (
    SCALARS,
    TENSORS,
    EventAccumulator,
)

from rlctl.sinks import MultiSink, build_sinks
from rlctl.sinks.tensorboard_sink import TensorboardSink, markdown_cell, markdown_table

METRICS = {
    1: {"reward/mean": 0.25, "policy/clip_frac": 0.0, "length/mean": 6.0},
    2: {"reward/mean": 0.5, "policy/clip_frac": 0.125, "length/mean": 7.0},
    3: {"reward/mean": 0.875, "policy/clip_frac": float("nan"), "length/mean": 5.5},
}
ROWS = [{"prompt": "sort 3 1 2", "completion": "1 2 3", "reward": 1.0, "finish_reason": "stop"},
        {"prompt": "sort 9 8", "completion": "8 | 9\n", "reward": 0.0, "finish_reason": "length"}]


def accumulator(log_dir):
    acc = EventAccumulator(str(log_dir), size_guidance={SCALARS: 0, TENSORS: 0})
    acc.Reload()
    return acc


def texts(acc, tag):
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(tag)]


def test_scalars_and_sample_text_read_back(tmp_path):
    sink = TensorboardSink(tmp_path)
    for step, metrics in METRICS.items():
        sink.log(metrics, step=step)
    sink.samples(ROWS, step=2)
    sink.samples(ROWS[:1], step=3, table="eval")
    sink.summary({"final/reward": 0.875, "wall_s": 12})
    sink.close()
    acc = accumulator(tmp_path / "tensorboard")
    assert sorted(acc.Tags()["scalars"]) == sorted(METRICS[1])
    for key in METRICS[1]:
        got = [(e.step, e.value) for e in acc.Scalars(key)]
        assert [s for s, _ in got] == [1, 2, 3]
        for (_, value), step in zip(got, METRICS):
            want = METRICS[step][key]
            # float32 in the event file; NaN stays NaN
            assert (math.isnan(value) and math.isnan(want)) or value == pytest.approx(want, rel=1e-6)
    assert sorted(acc.Tags()["tensors"]) == ["samples/eval/text_summary",
                                             "samples/train/text_summary", "summary/text_summary"]
    [(step, train)] = texts(acc, "samples/train/text_summary")
    assert step == 2
    lines = train.splitlines()
    assert lines[0] == "| prompt | completion | reward | finish\\_reason |"
    assert lines[1] == "|---|---|---|---|"
    assert lines[2] == "| sort 3 1 2 | 1 2 3 | 1 | stop |"
    assert lines[3] == "| sort 9 8 | 8 \\| 9<br> | 0 | length |"  # one markdown row per row
    assert len(lines) == 4
    assert [s for s, _ in texts(acc, "samples/eval/text_summary")] == [3]
    [(step, summary)] = texts(acc, "summary/text_summary")
    assert step == 3 and "| final/reward | 0.875 |" in summary and "| wall\\_s | 12 |" in summary


def test_markdown_cells_show_text_literally():
    assert markdown_cell("a|b") == "a\\|b"
    assert markdown_cell("<script>*x*</script>") == "&lt;script&gt;\\*x\\*&lt;/script&gt;"
    assert markdown_cell("[link](u) `code` _i_ #h \\") == \
        "\\[link\\](u) \\`code\\` \\_i\\_ \\#h \\\\"
    assert markdown_cell("one\r\ntwo\nthree") == "one<br>two<br>three"
    assert markdown_cell(None) == "" and markdown_cell(True) == "true"
    assert markdown_cell(1 / 3) == "0.3333" and markdown_cell(7) == "7"
    assert markdown_table(["a"], [[1], [2]]) == "| a |\n|---|\n| 1 |\n| 2 |"


def test_the_writer_is_made_at_the_first_call(tmp_path):
    sink = TensorboardSink(tmp_path)
    assert not (tmp_path / "tensorboard").exists()  # constructing writes nothing
    sink.close()
    assert not (tmp_path / "tensorboard").exists()
    sink.log({"a": 1.0}, step=1)  # after close: ignored
    assert not (tmp_path / "tensorboard").exists()


def test_an_unwritable_run_dir_disables_only_this_sink(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    sink = MultiSink([TensorboardSink(blocker)])
    sink.log({"a": 1.0}, step=1)
    sink.samples(ROWS, step=1)
    sink.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "metric sink tensorboard failed in log()" in err[0]
    assert sink.sinks == []


def test_build_sinks_tensorboard_flag(tmp_path):
    sink = build_sinks(tmp_path, jsonl=False, wandb=False, wandb_mode="offline", project="p",
                       name="n", run_config={}, console=False, total_steps=1, tensorboard=True)
    assert [s.name for s in sink.sinks] == ["tensorboard"]
    sink.log({"reward/mean": 0.5}, step=1)
    sink.close()
    acc = accumulator(tmp_path / "tensorboard")
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(1, 0.5)]
    none = build_sinks(None, jsonl=False, wandb=False, wandb_mode="offline", project="p",
                       name="n", run_config={}, console=False, total_steps=1, tensorboard=True)
    assert none.sinks == []


def test_importing_the_sinks_loads_neither_torch_nor_tensorboard():
    code = ("import sys, rlctl.sinks; print(sorted(m for m in ('torch', 'tensorboard', 'wandb', "
            "'rlctl.sinks.wandb_sink', 'rlctl.sinks.tensorboard_sink') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
