"""Your own policy loss, advantage estimator and KL estimator, by import path, end to end
through the console script: `rlctl train algo.policy_loss=mymod:my_loss ...`.

The user's entries return constants a built-in could not produce, so the logged metrics
show exactly that they were used: a loss of 7 on every counted token gives
policy/loss = 7 under token-mean (sum(7 m) / sum(m): integer sums, exact in float32);
advantages of 2 give advantage/mean = 2 and a KL estimate of 0.25 gives
policy/kl_ref = 0.25 (masked means of a constant, exact for the same reason). The module
also logs each call, so the calling convention (arguments and options) is checked."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

RLCTL = shutil.which("rlctl") or str(Path(sys.executable).parent / "rlctl")
FAST = ["trainer.steps=2", "trainer.eval_every=0", "task.num_eval=8", "trainer.prompts_per_step=2",
        "algo.group_size=4", "logger=jsonl", "logger.console=false", "run.save_model=false"]

USER_MODULE = '''"""A user's own registry entries (one calling convention per kind)."""
import os

import torch

NOT_CALLABLE = 3


def _note(line):
    with open(os.environ["MY_ENTRY_LOG"], "a") as f:
        f.write(line + "\\n")


def my_loss(logp, old_logp, advantages, mask, clip_low, clip_high, clip_ratio_c=None):
    _note(f"loss clip_low={clip_low} shape={tuple(logp.shape) == tuple(mask.shape)}")
    return (7.0 + 0.0 * logp) * mask, {"my_metric": torch.tensor(1.5)}


def my_adv(rewards, eps, **options):
    _note(f"adv dim={rewards.dim()} options={sorted(options)}")
    return torch.full_like(rewards, 2.0)


def my_k(logp, ref_logp):
    _note("kl")
    return 0.25 + 0.0 * (logp - ref_logp)
'''


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    d = tmp_path_factory.mktemp("entries")
    (d / "mymod.py").write_text(USER_MODULE)
    return d


def _rlctl(project, *args, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(project),
               MY_ENTRY_LOG=str(project / "calls.log"))
    return subprocess.run([RLCTL, "train", *args, *FAST], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=project)


def test_user_loss_advantage_and_kl_are_used(project):
    out = _rlctl(project, "algo.policy_loss=mymod:my_loss", "algo.advantage=mymod:my_adv",
                 "algo.kl.estimator=mymod:my_k", "algo.kl.coef=0.1",
                 "algo.loss_agg_mode=token-mean", "algo.clip_eps=0.15", "run.output_dir=runs/ok")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "warning" not in out.stderr       # no placement note applies to a user estimator
    run = sorted((project / "runs" / "ok").iterdir())[-1]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "policy/loss" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["policy/loss"] == 7.0, r["policy/loss"]
        assert r["advantage/mean"] == 2.0, r["advantage/mean"]
        assert r["policy/kl_ref"] == 0.25, r["policy/kl_ref"]
        mine = {k: v for k, v in r.items() if k.rpartition("/")[2] == "my_metric"}
        assert mine == {"my_metric": 1.5}, r     # the loss's own metrics, logged as given
    calls = (project / "calls.log").read_text().splitlines()
    assert "loss clip_low=0.15 shape=True" in calls
    assert any(c.startswith("adv dim=2 options=") and "'baseline'" in c for c in calls), calls
    assert "kl" in calls


@pytest.mark.parametrize("arg, fragment", [
    ("algo.policy_loss=not_my_module_xyz:f",
     "invalid algo.policy_loss: policy loss 'not_my_module_xyz:f': cannot import module "
     "'not_my_module_xyz'"),
    ("algo.kl.estimator=mymod:NOT_CALLABLE",
     "invalid algo.kl.estimator: KL estimator 'mymod:NOT_CALLABLE': 'NOT_CALLABLE' is not "
     "callable"),
])   # the other failures of a path (no attribute, malformed) are in tests/test_registry.py
def test_bad_import_paths_fail_in_one_line(project, arg, fragment, rlctl_app):
    # in-process (the module's first test runs the console script with the same module)
    out = rlctl_app("train", arg, "run.output_dir=runs/bad", *FAST, cwd=project, path=[project],
                    env={"MY_ENTRY_LOG": project / "calls.log"})
    assert out.returncode == 2, out.stdout[-1000:] + out.stderr[-2000:]
    err = out.stderr.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert fragment in err, err
    assert not (project / "runs" / "bad").exists()           # failed before the run dir
