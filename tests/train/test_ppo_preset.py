"""The ``ppo`` preset is PPO as Schulman et al. (2017) run it: each rollout is reused for
several optimizer steps, so from the second step on the ratio pi / pi_old leaves 1 and
the clipped surrogate really clips (a single pass has ratio 1 exactly and never clips:
recipes/ppo-single-pass.yaml)."""
import torch
from omegaconf import OmegaConf

from rlctl.config.compose import compose
from rlctl.train.trainer import Trainer
from rlctl.train.build import model_from_config, prepare_task
from rlctl.train.sources import build_source
from rlctl.sinks import NullSink

NO_EVAL = ["trainer.eval_every=0", "task.num_eval=4"]
SMALL = ["trainer.prompts_per_step=4", "algo.group_size=4", *NO_EVAL]


def _trainer(overrides, recipe=None):
    cfg = compose(overrides if recipe else ["algo=ppo", *overrides], recipe=recipe).cfg
    OmegaConf.resolve(cfg)
    model, critic, tok, _ = model_from_config(cfg)
    torch.manual_seed(0)
    task = prepare_task(cfg, tok, model, quiet=True)   # as rlctl train prepares it
    return cfg, Trainer.from_config(cfg, model, tok, task, NullSink(),
                                    source=build_source(cfg, model, tok, task), critic=critic)


def _run(overrides, steps, recipe=None):
    cfg, tr = _trainer(overrides, recipe)
    calls = []
    step = tr.backend.step
    tr.backend.step = lambda: calls.append(1) or step()     # count optimizer steps
    try:
        rows = [tr.step(i) for i in range(1, steps + 1)]
    finally:
        tr.close()
    return cfg, rows, len(calls)


def test_preset_reuses_each_rollout_and_clips():
    """The preset as shipped (its own batch sizes and learning rate), 3 steps: two
    optimizer steps per rollout, and the second pass over a rollout sees pi != pi_old, so
    some tokens leave [1 - eps, 1 + eps] (measured: 19% of tokens at step 1)."""
    cfg, rows, optimizer_steps = _run(NO_EVAL, steps=3)
    a = cfg.algo
    assert a.epochs * a.minibatches >= 2 and a.clip_eps > 0 and a.value_clip is not None
    assert optimizer_steps == 3 * a.epochs * a.minibatches >= 6
    assert all(r["policy/clip_frac"] > 0 and r["policy/approx_kl"] > 0 for r in rows)


def test_preset_value_clip_acts():
    """The value clip (0.02) acts once one optimizer step moves V by more than 0.02 toward
    the return. At the preset's learning rate that takes ~30 steps (measured on seed 0:
    4 of 60 steps clip 0.1-0.5% of tokens, seed- and machine-dependent); at lr 1e-3 the
    first step already does (measured 27-29% of value tokens in each of 3 steps), so the
    check does not hang on a borderline trajectory. Control: a clip too wide to act."""
    _, rows, _ = _run([*NO_EVAL, "trainer.lr=1e-3"], steps=3)
    assert all(r["value/clip_frac"] > 0 for r in rows)
    _, wide, _ = _run([*NO_EVAL, "trainer.lr=1e-3", "algo.value_clip=100"], steps=3)
    assert all(r["value/clip_frac"] == 0 for r in wide)


def test_single_pass_recipe_never_clips():
    """The control, trained from the recipe itself: one optimizer step per rollout,
    ratio exactly 1, nothing clipped."""
    cfg, rows, optimizer_steps = _run(["seed=0", *SMALL], steps=2, recipe="ppo-single-pass")
    assert cfg.algo.name == "ppo" and cfg.algo.advantage == "gae" and cfg.algo.value_clip is not None
    assert cfg.algo.epochs * cfg.algo.minibatches == 1
    assert optimizer_steps == 2
    assert all(r["policy/clip_frac"] == 0 and r["value/clip_frac"] == 0 for r in rows)
