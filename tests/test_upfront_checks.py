"""Settings that used to fail late (at the first push, at the first step, or with a
message naming no valid value) are refused before a run directory exists: one line, exit 2."""
import pytest
from typer.testing import CliRunner

from rlctl.cli import app

CASES = [
    ("rollout.engine=server rollout.server.weight_sync=disk rollout.server.weight_dir={file}",
     "rollout.server.weight_dir={file} is a file; it must be a directory"),
    ("algo.overlong_buffer=500",
     "algo.overlong_buffer=500 must be <= rollout.max_new_tokens="),
    ("task=calculator algo.overlong_buffer=60 rollout.episode.max_tokens=40",
     "algo.overlong_buffer=60 must be <= rollout.episode.max_tokens=40"),
    ("logger=[]", "no logger chosen (logger=[]); choose one or more of: jsonl, none, tensorboard, wandb"),
    ("algo=[]", "no algo chosen (algo=[]); choose one of:"),
]


@pytest.mark.parametrize("args, fragment", CASES, ids=[c[0] for c in CASES])
def test_refused_up_front(tmp_path, args, fragment):
    file = tmp_path / "weights.bin"
    file.write_text("not a directory")
    argv = args.format(file=file).split()
    result = CliRunner().invoke(app, ["train", "trainer.steps=1", f"run.output_dir={tmp_path}/runs", *argv])
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert result.exit_code == 2, (result.exit_code, result.output)
    assert len(lines) == 1 and fragment.format(file=file) in lines[0], lines
    assert not (tmp_path / "runs").exists()


def test_an_overlong_buffer_inside_the_budget_is_accepted():
    from rlctl.config.compose import compose
    from rlctl.config.checks import check_overlong
    cfg = compose(["algo.overlong_buffer=4", "rollout.max_new_tokens=4"]).cfg
    check_overlong(cfg.algo, cfg.rollout, episodic=False)       # == the budget: a ramp over all of it
