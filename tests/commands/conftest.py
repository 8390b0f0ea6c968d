"""Two real short training runs (in-process `run_training`, the tiny model, the sorting
task), shared by the eval / rollout / inspect tests, and a CLI runner.
(Threads are pinned to 1 by tests/conftest.py.)"""
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

FAST = ["trainer.steps=4", "trainer.eval_every=2", "task.num_eval=32",
        "trainer.prompts_per_step=4", "algo.group_size=4", "logger=jsonl",
        "logger.console=false"]


def _train(out_dir: Path, *overrides: str) -> Path:
    from rlctl.train.run import run_training

    summary = run_training([f"run.output_dir={out_dir}", *FAST, *overrides])
    return Path(summary["run_dir"])


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    """(run A: defaults, run B: algo.clip_eps=0.1), both with metrics.jsonl and model/."""
    root = tmp_path_factory.mktemp("cmd_runs")
    return _train(root / "a"), _train(root / "b", "algo.clip_eps=0.1")


@pytest.fixture(scope="session")
def run_a(runs):
    return runs[0]


@pytest.fixture(scope="session")
def run_b(runs):
    return runs[1]


@pytest.fixture()
def cli():
    """Invoke the real Typer app in-process; returns click's Result (stdout, stderr)."""
    from rlctl.cli import app

    runner = CliRunner()

    def invoke(*args, cwd=None):
        old = os.getcwd()
        if cwd is not None:
            os.chdir(cwd)
        try:
            return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)
        finally:
            os.chdir(old)
    return invoke
