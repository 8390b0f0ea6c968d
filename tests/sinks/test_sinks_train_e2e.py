"""`rlctl train logger=[jsonl,wandb,tensorboard]`: every sink of one run, read back with its
own reader, holds the same metrics and the same sample tables."""
import os
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import (
    SCALARS,
    TENSORS,
    EventAccumulator,
)

from wandb_file import find_run_file, read_history, read_tables

from rlctl.sinks import read_jsonl, read_samples
from rlctl.sinks.wandb_sink import sample_key

RLCTL = shutil.which("rlctl") or str(Path(sys.executable).parent / "rlctl")
SMALL = ["trainer.steps=4", "trainer.eval_every=2", "task.num_eval=16",
         "trainer.prompts_per_step=4", "algo.group_size=4"]
N = 4


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sinks-e2e")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(OMP_NUM_THREADS="1", HOME=str(tmp), WANDB_MODE="offline")
    out = subprocess.run([RLCTL, "train", f"run.output_dir={tmp}", *SMALL,
                          "logger=[jsonl,wandb,tensorboard]", "logger.samples.every=2",
                          f"logger.samples.n={N}"],
                         capture_output=True, text=True, timeout=600, env=env, cwd=tmp)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    [run_dir] = [p for p in tmp.iterdir() if p.is_dir() and (p / "metrics.jsonl").exists()]
    return out, run_dir


def test_tensorboard_scalars_equal_metrics_jsonl(run):
    _, run_dir = run
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={SCALARS: 0, TENSORS: 0})
    acc.Reload()
    rows = read_jsonl(run_dir / "metrics.jsonl")
    for key in ("reward/mean", "policy/loss", "eval/exact_match"):
        want = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        got = [(e.step, e.value) for e in acc.Scalars(key)]
        assert [s for s, _ in got] == [s for s, _ in want], key
        for (_, g), (_, w) in zip(got, want):
            assert g == pytest.approx(w, rel=1e-6, abs=1e-30), key  # float32 in the event file
    wandb_steps = [h["_step"] for h in read_history(find_run_file(run_dir))]
    assert wandb_steps == [r["step"] for r in rows]


def test_every_sink_holds_the_same_sample_tables(run):
    out, run_dir = run
    groups = defaultdict(list)
    for line in read_samples(run_dir / "samples.jsonl"):
        groups[(line["table"], line["step"])].append(line)
    assert {"train", "eval"} <= {table for table, _ in groups}, sorted(groups)
    tables = read_tables(run_dir)
    assert sorted(tables) == sorted(sample_key(t, s) for t, s in groups)  # one table per step
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={SCALARS: 0, TENSORS: 0})
    acc.Reload()
    for (table, step), lines in groups.items():
        assert 1 <= len(lines) <= N
        columns = [k for k in lines[0] if k not in ("table", "step")]
        got = tables[sample_key(table, step)]
        keep = [i for i, c in enumerate(got["columns"]) if c != "step"]
        assert [got["columns"][i] for i in keep] == columns
        assert [[r[i] for i in keep] for r in got["rows"]] == [[ln[c] for c in columns]
                                                              for ln in lines]
        texts = {e.step: e.tensor_proto.string_val[0].decode()
                 for e in acc.Tensors(f"samples/{table}/text_summary")}
        assert len(texts[step].splitlines()) == 2 + len(lines)  # header, rule, a line per row
        assert f"samples: {table}, step {step}" in out.stdout  # the console's table
