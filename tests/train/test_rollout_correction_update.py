"""The rollout correction in the learner: where the weight enters the loss, that it is
off by default and changes nothing then, bypass, and the old forward it needs (float64
tiny model unless said otherwise)."""
import copy
import re

import pytest
import torch
from omegaconf import OmegaConf

from rlctl.dist.backends import TorchBackend
from learner_kit import settings
from rlctl.config.compose import compose
from rlctl.core import get_policy_loss
from rlctl.train.update import old_policy_inputs
from rlctl.models.forward import learner_forward
from rlctl.train.trainer import needs_old_forward
from rlctl.train.update import UpdateState, accumulate_gradients
from rlctl.models.loading import load_model_and_tokenizer
from rlctl.config.schema import RolloutCorrectionConfig
from rlctl.types import LogProbs, RolloutBatch

F64 = torch.float64


@pytest.fixture(scope="module")
def tiny64():
    model, tok = load_model_and_tokenizer("tiny", **{k: v for k, v in dict(compose([]).cfg.model).items()
                                                     if k != "name"})
    return copy.deepcopy(model).double(), tok


def _batch(model, tokenizer, n=4, t=5, seed=0) -> RolloutBatch:
    """Completions of lengths 5, 3, 1, 4; engine log-probs = the learner's + noise of 0.3
    (so w spreads over roughly [0.4, 2.5]); advantages of both signs."""
    g = torch.Generator().manual_seed(seed)
    enc = tokenizer(["3 1 4 1 5 ="] * n, return_tensors="pt")
    digits = torch.tensor(tokenizer.convert_tokens_to_ids([str(d) for d in range(10)]))
    comp = digits[torch.randint(0, 10, (n, t), generator=g)]                     # [N, T]
    mask = (torch.arange(t)[None, :] < torch.tensor([5, 3, 1, 4])[:, None]).double()
    ids = torch.cat([enc["input_ids"], comp], 1)
    attn = torch.cat([enc["attention_mask"], mask.long()], 1)
    with torch.no_grad():
        old = learner_forward(model, ids, attn, enc["input_ids"].shape[1]).logp * mask
    engine = (old + 0.3 * torch.randn(n, t, generator=g, dtype=F64)) * mask
    return RolloutBatch(input_ids=ids, attention_mask=attn, mask=mask, truncated=mask[:, -1] > 0,
                        rewards=torch.zeros(n), group_ids=torch.arange(n) // 2,
                        prompt_len=enc["input_ids"].shape[1], group_size=2, prompts=["p"] * n,
                        completions=["c"] * n, logprobs=LogProbs(old=old, engine=engine),
                        advantages=torch.tensor([[1.0], [-0.5], [2.0], [-1.5]], dtype=F64) * mask)


def _corr(**fields):
    """``algo.rollout_correction`` as the update gets it when enabled."""
    return RolloutCorrectionConfig(enabled=True, **fields)


def _settings(corr=None, agg="token-mean", micro=0):
    return settings(policy_loss=get_policy_loss("ppo_clip"), clip_low=0.2, clip_high=0.2,
                          agg_mode=agg, norm_len=5, epochs=1, minibatches=1, kl_estimator="k3",
                          kl_in_loss=True, temperature=1.0,
                          micro_batch_size=micro, rollout_correction=corr)


def _grads(model, batch, s):
    model.zero_grad(set_to_none=True)
    metrics = accumulate_gradients(model, TorchBackend(), batch, s, UpdateState())
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]), metrics


def test_off_ignores_the_engine_logprobs_bit_for_bit(tiny64):
    """Correction off: a batch carrying engine log-probs gives exactly today's gradient and
    loss (the same batch without them); ``measure`` mode (weight 1) too."""
    model, tok = tiny64
    b = _batch(model, tok)
    today, m0 = _grads(model, b.replace(logprobs=dict(engine=None)), _settings())
    off, m1 = _grads(model, b, _settings())
    measure, _ = _grads(model, b, _settings(_corr(mode="measure")))
    assert today.abs().sum() > 0
    assert torch.equal(off, today) and torch.equal(measure, today)
    assert torch.equal(m1["policy/loss"], m0["policy/loss"])


@pytest.mark.parametrize("level,mode,upper,lower", [("token", "truncate", 1.2, 0.0),
                                                    ("token", "mask", 1.3, 0.8),
                                                    ("sequence", "truncate", 1.3, 0.0),
                                                    ("sequence", "mask", 1.3, 0.9)])
def test_the_weight_multiplies_each_tokens_policy_loss(tiny64, level, mode, upper, lower):
    """At theta = theta_old (rho = 1, no clip acts) the PPO token loss -A rho has gradient
    -A grad log pi, so weighting the loss by w is the same step as the uncorrected update
    with advantages A * w: checked with w written out here from its definition, over two
    micro-batches; the thresholds are chosen so that some tokens (rows) are changed."""
    model, tok = tiny64
    b = _batch(model, tok)
    d = (b.logprobs.old - b.logprobs.engine) * b.mask                              # log w per token
    lw = d if level == "token" else d.sum(-1, keepdim=True).expand_as(d)
    w = lw.exp()
    w = torch.minimum(w, torch.tensor(upper, dtype=F64)) if mode == "truncate" else \
        torch.where((w >= lower) & (w <= upper), w, 0.0)
    changed = ((w != lw.exp()) & (b.mask > 0)).sum()
    assert 0 < changed < b.mask.sum()
    want, m_want = _grads(model, b.replace(advantages=b.advantages * w * b.mask), _settings(micro=2))
    got, m_got = _grads(model, b, _settings(_corr(level=level, mode=mode, upper=upper, lower=lower), micro=2))
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(m_got["policy/loss"], m_want["policy/loss"], atol=1e-12, rtol=0)
    plain, _ = _grads(model, b, _settings(micro=2))
    assert (got - plain).abs().max() > 1e-4                    # the weight did change the step


def test_bypass_equals_the_correction_with_old_set_to_the_engine(tiny64):
    """Bypass: pi_old := pi_engine, weight 1, only the PPO ratio pi / pi_engine left. The
    same step as the correction (bypass off) on a batch whose old log-probs are the
    engine's (w = exp(0) = 1 exactly), bit for bit."""
    model, tok = tiny64
    b = _batch(model, tok)
    corr = _corr(mode="truncate", upper=1.2)
    bypass = old_policy_inputs(b.replace(logprobs=dict(old=None)), _corr(upper=1.2, bypass=True))
    assert torch.equal(bypass.logprobs.old, b.logprobs.engine)
    g_bypass, _ = _grads(model, bypass, _settings(_corr(upper=1.2, bypass=True)))
    g_corr, _ = _grads(model, b.replace(logprobs=dict(old=b.logprobs.engine)), _settings(corr))
    assert torch.equal(g_bypass, g_corr)
    g_learner_old, _ = _grads(model, b, _settings(corr))          # pi_old from the learner
    assert (g_bypass - g_learner_old).abs().max() > 1e-4


def test_without_bypass_the_learner_computes_pi_old_for_every_row(tiny64):
    """The batch the old forward sees: no old log-probs (stale async rows' behaviour ones
    included, they stay in logprobs.engine); off: unchanged; no engine log-probs: one line."""
    model, tok = tiny64
    b = _batch(model, tok).replace(logprobs=dict(behaviour_rows=torch.tensor([True, False, True, False])))
    out = old_policy_inputs(b, _corr())
    assert out.logprobs.old is None and out.logprobs.behaviour_rows is None
    assert out.logprobs.engine is b.logprobs.engine
    assert old_policy_inputs(b, None) is b
    with pytest.raises(Exception, match="needs the sampler's log-probs"):
        old_policy_inputs(b.replace(logprobs=dict(engine=None)), _corr())


@pytest.mark.parametrize("overrides,needs", [([], False),
                                             (["algo.rollout_correction.enabled=true"], True),
                                             (["algo.rollout_correction.enabled=true",
                                               "algo.rollout_correction.bypass=true"], False),
                                             (["algo=ppo", "algo.rollout_correction.enabled=true",
                                               "algo.rollout_correction.bypass=true"], True)])
def test_the_old_forward_runs_when_the_weight_needs_it(overrides, needs):
    assert needs_old_forward(compose(overrides).cfg.algo) is needs


def test_a_bf16_sampler_against_the_fp32_learner(make_trainer):
    """Trainer steps with rollout.sample_dtype=bfloat16, then float32 (the same source,
    its setting swapped): pi_old is the learner's float32 forward, pi_engine the sampler's,
    and rollout_corr/* sees the gap; with a float32 sampler the two differ only by the KV
    cache's float32 rounding. Measured on this model: mean |log w| 2.9e-3 (bf16) vs 1.6e-7
    (float32); the bound 1e-4 sits a factor 29 and 600 from them."""
    tr = make_trainer(["trainer.prompts_per_step=2", "algo.group_size=4", "trainer.eval_every=0",
                       "algo.rollout_correction.enabled=true", "rollout.sample_dtype=bfloat16"])
    gap = {}
    for step, dtype in enumerate(("bfloat16", "float32"), 1):
        tr.source.rollout = OmegaConf.merge(tr.source.rollout, {"sample_dtype": dtype})
        values = tr.step(step)
        gap[dtype] = values["rollout_corr/log_w_abs_mean"]
        assert 0 < values["rollout_corr/ess"] <= 1 and values["rollout_corr/k3"] >= 0
    assert gap["bfloat16"] > 1e-4 > gap["float32"], gap


@pytest.mark.parametrize("overrides,message", [
    (["algo.rollout_correction.mode=clip"], "invalid algo.rollout_correction.mode 'clip'; valid: truncate, mask, measure"),
    (["algo.rollout_correction.level=turn"], "invalid algo.rollout_correction.level 'turn'; valid: token, sequence"),
    (["algo.rollout_correction.mode=mask", "algo.rollout_correction.lower=3"], "lower=3.0 must be <="),
    (["algo.rollout_correction.upper=0"], "invalid algo.rollout_correction.upper '0.0'; must be > 0"),
    (["rollout.sample_dtype=float16"], "invalid rollout.sample_dtype 'float16'; valid: float32, bfloat16")])
def test_bad_settings_are_one_line(overrides, message):
    from rlctl.errors import ConfigError
    with pytest.raises(ConfigError, match=re.escape(message)):
        compose(overrides)
