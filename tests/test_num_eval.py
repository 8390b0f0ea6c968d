"""task.num_eval=0: no held-out set. The config's range and the generated tasks agree
on [0, ...]; it trains with trainer.eval_every=0, and asking to evaluate every k steps
on an empty set is one line (exit 2), not a row of eval/* zeros."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlctl.config.checks import RANGES
from rlctl.sinks.jsonl import read_jsonl
from rlctl.tasks.arithmetic import ArithmeticTask
from rlctl.tasks.sorting import SortingTask

RLCTL = shutil.which("rlctl") or str(Path(sys.executable).parent / "rlctl")
TINY = ["trainer.steps=1", "trainer.prompts_per_step=2", "algo.group_size=2", "logger=jsonl"]


def _rlctl(tmp_path, *args):
    return subprocess.run([RLCTL, "train", *args, f"run.output_dir={tmp_path}"], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))


@pytest.fixture
def train(tmp_path, rlctl_app):
    """`rlctl train ARGS run.output_dir=tmp_path` through the Typer app in-process (the
    console script itself: test_negative_is_one_line)."""
    return lambda *args: rlctl_app("train", *args, f"run.output_dir={tmp_path}")


def test_config_and_tasks_agree_on_zero():
    assert RANGES["task.num_eval"].contains(0) and not RANGES["task.num_eval"].contains(-1)
    for task in (SortingTask(num_eval=0), ArithmeticTask(num_eval=0)):
        assert task.eval_examples() == [] and len(task.train_examples()) > 0
    for cls in (SortingTask, ArithmeticTask):
        with pytest.raises(ValueError, match=r"\[0, "):
            cls(num_eval=-1)


@pytest.mark.parametrize("task", ["sorting", "arithmetic"])
def test_no_held_out_set_trains(tmp_path, task, train):
    # the arithmetic warm-up's default 200 steps teach a format this test does not read;
    # 1 step is the model test_byo_e2e builds too (the same cache key, built once)
    warmup = ["model.warmup_steps=1"] if task == "arithmetic" else []
    out = train(f"task={task}", "task.num_eval=0", "trainer.eval_every=0", *TINY, *warmup)
    assert out.returncode == 0, out.stderr[-2000:]
    run = next(p for p in tmp_path.iterdir() if p.is_dir())
    rows = read_jsonl(run / "metrics.jsonl")
    assert rows and not any(k.startswith("eval/") for r in rows for k in r)


def test_evaluating_an_empty_set_is_one_line(tmp_path, train):
    out = train("task.num_eval=0", "trainer.eval_every=5", *TINY)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "task.num_eval=0" in lines[0] and "trainer.eval_every=0" in lines[0]
    assert not list(tmp_path.iterdir())                     # no run directory


def test_negative_is_one_line(tmp_path):
    out = _rlctl(tmp_path, "task.num_eval=-1", *TINY)
    assert out.returncode == 2 and out.stderr.strip() == "error: invalid task.num_eval '-1'; must be >= 0"
