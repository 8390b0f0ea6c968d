"""The console script: help, bad input (one line, exit 2, no traceback)."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

RLCTL = shutil.which("rlctl") or str(Path(sys.executable).parent / "rlctl")


def run(*args, cwd=None, timeout=120):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([RLCTL, *args], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout, env=env)


def test_help_does_not_import_heavy_modules():
    code = ("import sys; import rlctl.cli; "
            "heavy = [m for m in ('torch', 'transformers', 'wandb', 'deepspeed', 'peft', 'hydra') "
            "if m in sys.modules]; print(heavy); assert not heavy")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_help_lists_commands_and_groups():
    top = run("--help")
    assert top.returncode == 0 and "train" in top.stdout
    sub = run("train", "--help")
    assert sub.returncode == 0
    text = " ".join(sub.stdout.split())
    for fragment in ("algo=grpo", "task=sorting", "model=hf|tiny", "hardware=cpu",
                     "logger=jsonl|none|tensorboard|wandb", "--recipe"):
        assert fragment in text, fragment


@pytest.mark.parametrize("args, fragment", [
    (["algo.foo=1"], "unknown config key 'algo.foo'"),
    (["algo.clip_eps=abc"], "expected a float"),
    (["algo=nope"], "valid: cispo, dapo, dpo, dr_grpo, grpo, gspo, ppo, reinforce, rloo"),
    (["task=nope"], "unknown task 'nope'; valid: "),
    (["algo.loss_agg_mode=mean"], "valid: token-mean"),
    (["--recipe", "/nonexistent/recipe.yaml"], "cannot read recipe"),
    (["--bogus"], "unknown option '--bogus'"),
    (["task.reward=bogus"], "valid: exact, positional, inclusion_order"),
    (["model=hf", "model.name_or_path=/nonexistent/model"], "/nonexistent/model"),
    (["run.output_dir=/proc/forbidden"], "run.output_dir"),
])
def test_bad_input_one_line_exit_2(tmp_path, args, fragment, rlctl_app):
    """One case through the console script (the exit code and stderr a user sees, after the
    imports a real process makes); the others through the same Typer app in-process."""
    argv = ["train", "trainer.steps=1", f"run.output_dir={tmp_path}", *args]
    out = run(*argv, cwd=tmp_path) if args == ["algo.foo=1"] else rlctl_app(*argv, cwd=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    assert fragment in lines[0], lines[0]


def test_dry_run_lists_resident_models_and_memory(tmp_path, rlctl_app):
    out = run("train", "--dry-run", "algo=ppo", "algo.kl.coef=0.1", "hardware=deepspeed",
              "hardware.zero_stage=3", "hardware.num_processes=2", f"run.output_dir={tmp_path}")
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    for fragment in ("policy + value head", "reference (frozen copy", "optimizer state", "total",
                     "old-policy forward", "reference forward"):
        assert fragment in text, fragment
    assert not any(tmp_path.iterdir())                     # nothing written
    # the first plan through the console script, the two others in-process
    plain = rlctl_app("train", "--dry-run", f"run.output_dir={tmp_path}").stdout
    assert "policy" in plain and "total" in plain                            # the plan is there
    assert "reference (" not in plain and "reference forward" not in plain   # kl 0: no reference
    assert "old-policy forward" not in plain                                 # single pass
    adaptive = rlctl_app("train", "--dry-run", "algo.kl.coef=0.1", "algo.kl.target=0.05",
                   f"run.output_dir={tmp_path}").stdout      # the controller needs pi_old
    assert "old-policy forward" in " ".join(adaptive.split())
