"""The engine/learner mismatch is measured whenever a rollout carries the sampler's
log-probs, with the correction off: rollout_corr/* logged, the update unchanged bit for bit."""
import copy

import torch

from learner_kit import settings
from test_rollout_correction_update import _batch as correction_batch, tiny64  # noqa: F401 (fixture)
from omegaconf import OmegaConf
from rlctl.config.compose import compose
from rlctl.core.rollout_correction import mismatch_metrics
from rlctl.dist.backends import TorchBackend
from rlctl.models.loading import load_model_and_tokenizer
from rlctl.rollout.engines.engine_source import EngineSource
from rlctl.rollout.engines.protocol import TorchEngine
from rlctl.sinks import NullSink
from rlctl.train.build import prepare_task
from rlctl.train.sources import weight_buckets
from rlctl.train.trainer import Trainer
from rlctl.train.update import UpdateState, update_policy



def _batch(model, tok):
    """The correction tests' batch (ragged completions, engine = learner + noise 0.3) with no
    pi_old: the learner's own forward is pi_old -> (batch, the learner's log-probs [N, T])."""
    b = correction_batch(model, tok)
    return b.replace(logprobs=dict(old=None)), b.logprobs.old


def _step(model, batch):
    """One optimizer step (two micro-batches) on a copy -> (its parameters, the metrics)."""
    model = copy.deepcopy(model)
    backend = TorchBackend()
    engine = backend.prepare(model, None, lr=1e-2, betas=(0.9, 0.999), weight_decay=0.0,
                             warmup_steps=0, max_grad_norm=1.0)
    m = update_policy(engine, backend, batch, settings(micro_batch_size=2), UpdateState())
    return torch.cat([p.detach().flatten() for p in model.parameters()]), m


def test_the_mismatch_is_measured_without_changing_the_step(tiny64):
    model, tok = tiny64
    b, learner = _batch(model, tok)
    with_lp, m1 = _step(model, b)
    without, m0 = _step(model, b.replace(logprobs=dict(engine=None)))
    assert torch.equal(with_lp, without) and torch.equal(m1["policy/loss"], m0["policy/loss"])
    assert not any(k.startswith("rollout_corr/") for k in m0)
    want = mismatch_metrics(learner, b.logprobs.engine, b.mask, "token", "measure", float("inf"))
    assert set(want) == {"k3", "ppl_gap", "ess", "log_w_abs_mean", "weight_mean"}
    for k, v in want.items():        # pi_old here: the update's own first forward, float64
        torch.testing.assert_close(m1[f"rollout_corr/{k}"], v, atol=1e-10, rtol=1e-10)
    assert m1["rollout_corr/k3"] > 1e-3 and 0 < m1["rollout_corr/ess"] < 1


def test_an_engine_source_logs_the_mismatch_with_the_correction_off():
    """An engine (here the torch one, in this process: a server's or a local engine
    process's rollouts reach the learner the same way) samples; nothing is corrected."""
    cfg = compose(["trainer.prompts_per_step=2", "algo.group_size=2", "trainer.eval_every=0"]).cfg
    OmegaConf.resolve(cfg)
    model, tok = load_model_and_tokenizer("tiny", **{k: v for k, v in dict(cfg.model).items() if k != "name"})
    task = prepare_task(cfg, tok, model, quiet=True)
    source = EngineSource(TorchEngine(copy.deepcopy(model), tok.pad_token_id), model, tok, list(task.train),
                          task.scorer(), cfg.rollout, cfg.algo.group_size, cfg.trainer.async_rollout, seed=0,
                          gather=weight_buckets(cfg.hardware))
    tr = Trainer.from_config(cfg, model, tok, task, NullSink(), source=source)
    try:
        values = tr.step(1)
    finally:
        tr.close()
    # the torch engine runs the learner's own float32 forward on the same weights: per-token
    # log-prob gaps are rounding (~1e-6), so k3 ~ gap^2 / 2 and ess within 1e-6 of 1
    assert values["rollout_corr/k3"] < 1e-9 and abs(values["rollout_corr/ess"] - 1) < 1e-6
    assert values["rollout_corr/weight_mean"] == 1.0              # measured only: weight 1


def test_the_learners_own_sampler_has_nothing_to_measure(make_trainer):
    tr = make_trainer(["trainer.prompts_per_step=2", "algo.group_size=2", "trainer.eval_every=0"])
    assert not any(k.startswith("rollout_corr/") for k in tr.step(1))
