"""The ``ppo`` preset is PPO as Schulman et al. (2017) run it: each rollout is reused for
several optimizer steps, so from the second step on the ratio pi / pi_old leaves 1 and
the clipped surrogate really clips (a single pass has ratio 1 exactly and never clips:
recipes/ppo-single-pass.yaml)."""
import torch
from omegaconf import OmegaConf

from rlctl.compose import compose
from rlctl.engine.build import model_from_config, task_from_config
from rlctl.engine.async_rollout import build_source
from rlctl.engine.trainer import Trainer
from rlctl.sinks import NullSink

SMALL = ["trainer.prompts_per_step=4", "algo.group_size=4", "trainer.eval_every=0", "task.num_eval=4"]


def _trainer(overrides):
    cfg = compose(["algo=ppo", *SMALL, *overrides]).cfg
    OmegaConf.resolve(cfg)
    model, critic, tok, _ = model_from_config(cfg)
    torch.manual_seed(0)
    task = task_from_config(cfg)
    return cfg, Trainer(cfg, model, tok, task, NullSink(), source=build_source(cfg, model, tok, task),
                        critic=critic)


def _run(overrides, steps):
    cfg, tr = _trainer(overrides)
    calls = []
    step = tr.backend.step
    tr.backend.step = lambda: calls.append(1) or step()     # count optimizer steps
    try:
        rows = [tr.step(i) for i in range(1, steps + 1)]
    finally:
        tr.close()
    return cfg, rows, len(calls)


def test_preset_reuses_each_rollout_and_clips():
    cfg, rows, optimizer_steps = _run([], steps=3)
    a = cfg.algo
    assert a.epochs * a.minibatches >= 2 and a.clip_eps > 0 and a.value_clip is not None
    assert optimizer_steps == 3 * a.epochs * a.minibatches >= 6
    # the second pass over a rollout sees pi != pi_old: some tokens leave [1-eps, 1+eps]
    assert max(r["policy/clip_frac"] for r in rows) > 0
    assert max(r["policy/approx_kl"] for r in rows) > 0
    assert all(r["value/clip_frac"] >= 0 for r in rows)


def test_single_pass_recipe_never_clips():
    """The control: one optimizer step per rollout, ratio exactly 1, nothing clipped."""
    cfg = compose(["seed=0"], recipe="ppo-single-pass").cfg
    assert cfg.algo.epochs * cfg.algo.minibatches == 1 and cfg.algo.advantage == "gae"
    _, rows, optimizer_steps = _run(["algo.epochs=1", "algo.minibatches=1"], steps=2)
    assert optimizer_steps == 2
    assert all(r["policy/clip_frac"] == 0 and r["value/clip_frac"] == 0 for r in rows)
