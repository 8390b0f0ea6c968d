"""Sample tables in every sink, each read back with that sink's own reader: samples.jsonl
with read_samples, the W&B offline files with tests/wandb_file.py, the console's text."""

import io
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from wandb_file import find_run_file, read_history, read_tables

from rlctl.sinks import (
    ConsoleSink,
    JsonlSink,
    MultiSink,
    NullSink,
    SamplesFile,
    build_sinks,
    read_jsonl,
    read_samples,
)
from rlctl.sinks.wandb_sink import WandbSink, sample_key

COLUMNS = ["step", "prompt", "completion", "reward/exact_match", "reward/format", "reward",
           "advantage", "length", "finish_reason", "policy_version"]


def sample_rows(step, n=4, table="train"):
    """Rows as the trainer draws them: every row the same keys in the same order."""
    rows = []
    for i in range(n):
        exact = float(i % 2)
        rows.append(dict(zip(COLUMNS, [
            step, f"{table} prompt {i}: sort 3 1 2", f"1 2 3 [bold]{i}[/bold]\nline two",
            exact, 0.25, exact + 0.25, (-1) ** (i + 1) * 0.5, 6 + i,
            "stop" if i else "length", step - 1 if i == 3 else step])))
    return rows


def lines_of(rows, step, table):
    """What samples.jsonl should hold for these rows: table and step first."""
    return [{"table": table, "step": step, **{k: v for k, v in r.items() if k != "step"}}
            for r in rows]


def test_samples_file_one_line_per_row_with_table_and_step(tmp_path):
    path = tmp_path / "samples.jsonl"
    sink = SamplesFile(path)
    sink.log({"reward/mean": 1.0}, step=1)
    assert not path.exists()  # created at the first table only
    sink.samples(sample_rows(5), step=5)
    sink.samples(sample_rows(5, n=2, table="eval"), step=5, table="eval")
    sink.samples(sample_rows(10), step=10)
    sink.close()
    raw = path.read_text().splitlines()
    assert len(raw) == 4 + 2 + 4
    assert list(json.loads(raw[0])) == ["table", "step"] + COLUMNS[1:]  # the rows' order kept
    assert read_samples(path) == (lines_of(sample_rows(5), 5, "train")
                                  + lines_of(sample_rows(5, n=2, table="eval"), 5, "eval")
                                  + lines_of(sample_rows(10), 10, "train"))
    assert read_samples(path, table="eval") == lines_of(sample_rows(5, 2, "eval"), 5, "eval")
    assert [r["step"] for r in read_samples(path, table="train", step=10)] == [10] * 4


def test_samples_file_keeps_any_columns_and_strict_json(tmp_path):
    path = tmp_path / "samples.jsonl"
    sink = SamplesFile(path)
    rows = [{"zeta": "z", "alpha": float("nan"), "ok": True, "none": None},
            {"zeta": "y", "alpha": 2.5, "ok": False, "none": None}]
    sink.samples(rows, step=3, table="eval")
    sink.close()
    first = path.read_text().splitlines()[0]
    assert list(json.loads(first)) == ["table", "step", "zeta", "alpha", "ok", "none"]
    assert "NaN" not in first  # a non-finite value is null, as in metrics.jsonl
    assert read_samples(path)[1] == {"table": "eval", "step": 3, "zeta": "y", "alpha": 2.5,
                                     "ok": False, "none": None}
    path.write_text(path.read_text() + '{"table": "eval", "st')  # a run killed mid-line
    assert len(read_samples(path)) == 2


def test_build_sinks_writes_samples_beside_metrics_only_with_jsonl(tmp_path):
    on = build_sinks(tmp_path / "on", jsonl=True, wandb=False, wandb_mode="offline",
                     project="p", name="n", run_config={}, console=False, total_steps=2)
    off = build_sinks(tmp_path / "off", jsonl=False, wandb=False, wandb_mode="offline",
                      project="p", name="n", run_config={}, console=False, total_steps=2)
    for sink in (on, off):
        sink.log({"reward/mean": 0.5}, step=1)
        sink.samples(sample_rows(1), step=1)
        sink.close()
    assert read_samples(tmp_path / "on" / "samples.jsonl") == lines_of(sample_rows(1), 1, "train")
    assert read_jsonl(tmp_path / "on" / "metrics.jsonl") == [{"step": 1, "reward/mean": 0.5}]
    assert not (tmp_path / "off").exists()


class Recorder:
    name = "recorder"

    def __init__(self):
        self.calls = []

    def log(self, metrics, step):
        self.calls.append(("log", step))

    def samples(self, rows, step, table="train"):
        self.calls.append(("samples", step, table, len(rows)))

    def summary(self, values):
        pass

    def close(self):
        self.calls.append(("close",))


class BrokenSamples(Recorder):
    name = "broken-samples"

    def samples(self, rows, step, table="train"):
        raise TypeError("cannot draw this table\nmore detail")


class Older:
    """A sink written before samples() existed."""
    name = "older"

    def __init__(self):
        self.steps = []

    def log(self, metrics, step):
        self.steps.append(step)

    def summary(self, values):
        pass

    def close(self):
        pass


def test_a_failing_samples_sink_is_disabled_and_the_others_go_on(capsys):
    broken, good, older = BrokenSamples(), Recorder(), Older()
    sink = MultiSink([broken, good, older])
    sink.log({"a": 1.0}, step=1)
    sink.samples(sample_rows(1), step=1)
    sink.log({"a": 2.0}, step=2)
    sink.samples(sample_rows(2, n=2), step=2, table="eval")
    sink.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["rlctl: warning: metric sink broken-samples failed in samples() and is "
                   "disabled: TypeError: cannot draw this table"]
    assert sink.failed == {"broken-samples": "TypeError: cannot draw this table\nmore detail"}
    assert broken.calls == [("log", 1), ("close",)]  # closed once when disabled, not again
    assert good.calls == [("log", 1), ("samples", 1, "train", 4), ("log", 2),
                          ("samples", 2, "eval", 2), ("close",)]
    assert older.steps == [1, 2]  # no samples() method: skipped, not disabled
    NullSink().samples(sample_rows(1), step=1)


def test_console_off_a_tty_prints_the_table_cut_to_the_width():
    out = io.StringIO()
    sink = ConsoleSink(total_steps=20, print_every=10, file=out)
    sink.log({"reward/mean": 0.5}, step=10)
    sink.samples(sample_rows(10), step=10)
    sink.samples(sample_rows(10, n=2, table="eval"), step=10, table="eval")
    sink.close()
    text = out.getvalue()
    assert "\x1b" not in text
    lines = [line.rstrip() for line in text.splitlines()]
    assert lines[0].startswith("step 10/20")
    title = lines.index("samples: train, step 10")  # step is in the title, not a column
    assert "samples: eval, step 10" in lines
    assert all(len(line) <= 80 for line in text.splitlines())  # rich's width off a TTY
    body = lines[title + 1:title + 12]
    rows = [line for line in body if line.startswith("train prom")]
    assert len(rows) == 4  # one line per row: the completion's line break is shown as \n
    for name in ("prompt", "completion", "advantage", "finish_", "policy_"):
        assert any(name in line for line in body[:4]), name
    assert all("…" in row for row in rows)  # the long texts are cut
    # numbers in full; brackets of the completion are text, not rich markup
    assert "-0.5" in rows[0] and "length" in rows[0] and "1 2 3 [b" in rows[0]


def test_console_wide_terminal_shows_the_whole_texts(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # rich's width off a TTY
    out = io.StringIO()
    sink = ConsoleSink(total_steps=2, file=out)
    sink.samples(sample_rows(1), step=1)
    sink.close()
    text = out.getvalue()
    assert "train prompt 0: sort 3 1 2" in text
    assert "1 2 3 [bold]0[/bold]\\nline two" in text  # the line break as a literal \n
    assert "…" not in text and max(len(line) for line in text.splitlines()) > 80


@pytest.mark.usefixtures("wandb_env")
def test_wandb_one_table_per_logged_step_read_back_from_offline_files(tmp_path, capsys):
    sink = WandbSink(tmp_path, project="p", name="samples", run_config={})
    assert sink.mode == "offline"
    sink.log({"reward/mean": 0.25}, step=1)
    sink.samples(sample_rows(1), step=1)
    sink.log({"reward/mean": 0.5}, step=2)
    sink.samples(sample_rows(3), step=3)               # before the step's metrics
    sink.samples(sample_rows(3, n=2, table="eval"), step=3, table="eval")
    sink.log({"reward/mean": 0.75}, step=3)
    sink.samples(sample_rows(2), step=2)               # too late: wandb keeps steps in order
    sink.close()
    tables = read_tables(tmp_path)
    # wandb keeps no order between keys logged at one step: compare as a set
    assert set(tables) == {"samples/train/step_000001", "samples/train/step_000003",
                           "samples/eval/step_000003"}
    assert sample_key("train", 25) == "samples/train/step_000025"
    for (table, step, n) in [("train", 1, 4), ("train", 3, 4), ("eval", 3, 2)]:
        got = tables[sample_key(table, step)]
        assert got["step"] == step and got["columns"] == COLUMNS
        assert got["rows"] == [list(r.values()) for r in sample_rows(step, n, table)]
    history = read_history(find_run_file(tmp_path))
    assert [(r["_step"], r["reward/mean"]) for r in history] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert "step 2 came after step 3" in capsys.readouterr().err


def test_cell_values_are_not_changed_on_the_way(tmp_path):
    """A value the console shows to 4 digits is written in full to samples.jsonl."""
    sink = SamplesFile(tmp_path / "s.jsonl")
    sink.samples([{"advantage": 1 / 3, "text": "x"}], step=1)
    sink.close()
    assert math.isclose(read_samples(tmp_path / "s.jsonl")[0]["advantage"], 1 / 3, rel_tol=0)
    metrics = JsonlSink(tmp_path / "m.jsonl")
    metrics.samples([{"a": 1}], step=1)  # rows go to SamplesFile, not metrics.jsonl
    metrics.close()
    assert (tmp_path / "m.jsonl").read_text() == ""


def test_console_live_view_prints_the_table_through_its_console():
    out = io.StringIO()
    sink = ConsoleSink(total_steps=4, live=True, file=out)
    sink.samples(sample_rows(0, n=2, table="eval"), step=0, table="eval")  # before any log()
    for step in range(1, 5):
        sink.log({"reward/mean": 0.25 * step}, step=step)
    sink.close()
    text = out.getvalue()
    assert text.count("samples: eval, step 0") == 1 and "eval prom" in text
    assert "4/4" in text and "reward 1" in text


CHILD = '''
import sys, time
sys.path[:0] = [{tests!r}, {root!r}]  # test_sinks_samples imports wandb_file
from test_sinks_samples import sample_rows
from rlctl.sinks import ConsoleSink
sink = ConsoleSink(total_steps=6)
assert sink.live, "not a terminal"
for step in range(1, 7):
    sink.log({{"reward/mean": 0.125 * step}}, step=step)
    time.sleep(0.3)  # the live view redraws 4 times a second
    if step in (2, 4):
        sink.samples(sample_rows(step, n=3), step=step)
        time.sleep(0.3)
sink.close()
print("child done")
'''


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (a real terminal)")
def test_console_tables_in_a_real_terminal_leave_the_live_view_whole(tmp_path):
    """Under tmux (80 x 40): each table is printed once above the view, and the final
    screen holds one progress row, below both tables (the earlier renders were erased)."""
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(tests=str(Path(__file__).parent),
                                    root=str(Path(__file__).parents[1])))
    tmux = ["tmux", "-L", f"rlctl-test-{os.getpid()}"]
    command = f"{shlex.quote(sys.executable)} {shlex.quote(str(script))} 2>&1; sleep 60"
    subprocess.run(tmux + ["new-session", "-d", "-s", "t", "-x", "80", "-y", "40", command],
                   check=True, env={**os.environ, "TERM": "xterm-256color"})
    try:
        deadline, screen = time.monotonic() + 90, ""
        while "child done" not in screen and time.monotonic() < deadline:
            time.sleep(0.5)
            screen = subprocess.run(tmux + ["capture-pane", "-p", "-t", "t"], check=True,
                                    capture_output=True, text=True).stdout
    finally:
        subprocess.run(tmux + ["kill-server"], check=False)
    lines = [line.rstrip() for line in screen.splitlines()]
    assert "child done" in lines, screen
    titles = [i for i, line in enumerate(lines) if line.startswith("samples: train, step")]
    assert [lines[i] for i in titles] == ["samples: train, step 2", "samples: train, step 4"]
    bars = [i for i, line in enumerate(lines) if re.match(r"train .*\d/6", line)]
    assert len(bars) == 1 and "6/6" in lines[bars[0]] and bars[0] > titles[-1], screen
    for title in titles:  # title, 3 header lines, the rule, 3 rows: each row on one line
        assert [line.startswith("train prom") for line in lines[title + 5:title + 9]] == \
            [True, True, True, False], screen
