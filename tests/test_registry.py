"""rlctl.registry.Registry, the one shape of every registry, and its use: built-in
entries, aliases, user entries by import path (and their one-line errors), the engine's
name check, and config validation that imports no torch."""
import subprocess
import sys

import pytest
import torch

from rlctl.dist import BACKENDS
from rlctl.config.compose import compose
from rlctl.core import (ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, POLICY_LOSSES, gae,
                        get_advantage_estimator, get_policy_loss, kl_estimate,
                        ppo_clip_per_token, resolve_kl_estimator)
from rlctl.core.losses import kl_k2
from rlctl.errors import ConfigError
from rlctl.registry import Registry
from rlctl.train.preflight import check_entries
from rlctl.tasks import TASKS

USER = '''
import torch

NUMBER = 3


def outcome(rewards, eps, **options):
    return rewards * 0 + 5.0


def token(rewards, values, mask, gamma, lam):
    return rewards * 0, values


token.level = "token"


def bad_level(rewards, eps, **options):
    return rewards


bad_level.level = "sideways"


class Box:
    @staticmethod
    def double(logp, ref_logp):
        return 2 * (logp - ref_logp)
'''


@pytest.fixture()
def user_module(tmp_path, monkeypatch):
    name = f"rlctl_test_user_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(USER)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_register_get_names_aliases_and_dashes():
    reg = Registry("widget", attrs={"size": ("small", "big")}, aliases={"w": "wide_one"},
                   dashes=True)

    @reg.register("wide_one", size="big")
    def wide(x):
        return x

    @reg.register("plain")
    def plain(x):
        return x

    assert reg.names() == ["plain", "wide_one"] and list(reg) == reg.names() and len(reg) == 2
    assert reg.get("wide_one") is wide and reg.get("wide-one") is wide and reg.get("w") is wide
    assert reg.entry("w").name == "wide_one" and reg.entry("w").size == "big"
    assert reg.entry("plain").size == "small"                 # the first choice is the default
    assert "wide-one" in reg and "w" in reg and "nope" not in reg
    with pytest.raises(ValueError, match=r"unknown widget 'nope'; valid: plain, wide_one "
                                         r"\(aliases: w\), or package.module:function"):
        reg.get("nope")
    with pytest.raises(ValueError, match="invalid size 'huge'; valid: small, big"):
        reg.register("x", size="huge")(plain)
    with pytest.raises(ValueError, match="unknown attribute 'colour'; valid: size"):
        reg.register("x", colour="red")(plain)


def test_user_entries_by_import_path(user_module, tmp_path):
    e = ADVANTAGE_ESTIMATORS.entry(f"{user_module}:outcome")
    assert e.level == "outcome" and e.name == f"{user_module}:outcome"
    assert (e.fn(torch.zeros(2, 3), 0.0) == 5.0).all()
    assert ADVANTAGE_ESTIMATORS.entry(f"{user_module}:token").level == "token"   # its own attribute
    assert get_advantage_estimator(f"{user_module}:outcome") is e.fn
    # dotted attribute, and the path/file.py:attr form
    assert kl_estimate(torch.ones(1, 2), torch.zeros(1, 2), f"{user_module}:Box.double").eq(2).all()
    fn = KL_ESTIMATORS.get(f"{tmp_path / (user_module + '.py')}:Box.double")
    assert fn(torch.ones(1), torch.zeros(1)).item() == 2.0
    assert resolve_kl_estimator(f"{user_module}:Box.double", "in_loss") == f"{user_module}:Box.double"


@pytest.mark.parametrize("spec, message", [
    ("{m}:nope", "advantage estimator '{m}:nope': module '{m}' has no attribute 'nope'"),
    ("{m}:NUMBER", "advantage estimator '{m}:NUMBER': 'NUMBER' is not callable (it is a int)"),
    ("{m}:bad_level", "advantage estimator '{m}:bad_level': invalid level 'sideways'; valid: "
                      "outcome, token"),
    ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz' (No module named "
                             "'no_such_module_xyz'); put its directory on PYTHONPATH"),
    ("{m}:", "advantage estimator '{m}:' must look like package.module:function"),
    (":f", "must look like package.module:function"),
    ("/no/such/file.py:f", "no such file '/no/such/file.py'"),
])
def test_user_entry_errors_are_one_line(user_module, spec, message):
    with pytest.raises(ValueError) as info:
        ADVANTAGE_ESTIMATORS.get(spec.format(m=user_module))
    text = str(info.value)
    assert message.format(m=user_module) in text and "\n" not in text, text


def test_every_registry_has_its_built_ins():
    assert ADVANTAGE_ESTIMATORS.names() == ["dr_grpo", "gae", "grpo", "reinforce",
                                            "reinforce_baseline", "rloo"]
    assert ADVANTAGE_ESTIMATORS.get("gae") is gae and ADVANTAGE_ESTIMATORS.entry("gae").level == "token"
    assert ADVANTAGE_ESTIMATORS.entry("grpo").level == "outcome"
    assert POLICY_LOSSES.names() == ["cispo", "gspo", "ppo_clip", "vanilla_pg"]
    assert get_policy_loss("ppo-clip") is ppo_clip_per_token
    assert KL_ESTIMATORS.names() == ["k1", "k2", "k3"] and KL_ESTIMATORS.get("mse") is kl_k2
    assert {"sorting", "arithmetic", "jsonl"} <= set(TASKS)
    assert BACKENDS.names() == ["deepspeed", "fsdp2", "torch"]


def test_user_task_by_import_path(user_module, tmp_path):
    (tmp_path / f"{user_module}_task.py").write_text(
        "from rlctl.tasks.sorting import SortingTask\n"
        "def make(**options):\n    return SortingTask(num_digits=3)\n")
    from rlctl.tasks import build_task
    task = build_task(f"{user_module}_task:make")
    assert len(task.eval_examples()[0].prompt.split()) >= 3


@pytest.mark.parametrize("overrides, message", [
    (["algo.policy_loss=magic"], "invalid algo.policy_loss: unknown policy loss 'magic'; valid: "
                                 "cispo, gspo, ppo_clip, vanilla_pg"),
    (["algo.advantage=magic"], "invalid algo.advantage: unknown advantage estimator 'magic'"),
    (["algo.kl.estimator=k9"], "invalid algo.kl.estimator: unknown KL estimator 'k9'; valid: "
                               "k1, k2, k3 (aliases: kl, low_var_kl, mse)"),
    (["task.name=nope"], "invalid task.name: unknown task 'nope'; valid: arithmetic, calculator, "
                         "guess_number, jsonl, preferences, running_sum, sorting"),
    (["hardware.backend=tpu"], "invalid hardware.backend: unknown backend 'tpu'; valid: "
                               "deepspeed, fsdp2, torch"),
    (["algo=ppo", "algo.critic=none"], "algo.advantage=gae needs a critic"),
    (["algo.critic=shared"], "trains a value model that algo.advantage=grpo does not use"),
])
def test_check_entries_names_the_key(overrides, message):
    cfg = compose(overrides).cfg           # composes: the names are not checked there
    with pytest.raises(ConfigError) as info:
        check_entries(cfg.algo, cfg.task.name, cfg.hardware.backend)
    assert message in str(info.value), str(info.value)


def _check(cfg):
    check_entries(cfg.algo, cfg.task.name, cfg.hardware.backend)


def test_a_user_token_level_estimator_needs_a_critic(user_module):
    with pytest.raises(ConfigError, match=f"algo.advantage={user_module}:token needs a critic"):
        _check(compose([f"algo.advantage={user_module}:token"]).cfg)
    _check(compose(["algo=ppo"]).cfg)   # gae with its critic: fine


def test_validation_imports_no_torch():
    code = ("import sys; from rlctl.config.compose import compose; "
            "compose(['algo=ppo', 'algo.policy_loss=mypkg.losses:anything', 'algo.kl.coef=0.1']); "
            "heavy = [m for m in ('torch', 'transformers', 'rlctl.core', 'rlctl.learner', 'rlctl.run') "
            "if m in sys.modules]; print(heavy); assert not heavy")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
