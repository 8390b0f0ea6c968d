"""Which divergence each (KL estimator, placement) pair really follows, by exact
enumeration over the 5 actions of a categorical policy pi = softmax(theta), float64.

The per-action gradient is computed by the engine itself: a one-token "language model"
whose logits are the leaf tensor theta goes through ``compute_advantages`` (in_reward:
-beta * k becomes the return, a constant) and ``accumulate_gradients`` (in_loss: beta * k
is added to the loss and differentiated through log pi). The expectation over the
action a is sum_a pi(a) * grad(a). The reference values are gradients of closed-form
divergences, computed independently by autograd on the full distributions:
    KL(pi||ref) = sum_a pi(a) (log pi(a) - log ref(a)),  KL(ref||pi) = sum_a ref(a) (log ref(a) - log pi(a)).
Everything is float64 and exact up to rounding, hence the 1e-10 tolerance.
"""
from types import SimpleNamespace

import pytest
import torch

from rlctl.dist.backends import TorchBackend
from learner_kit import settings
from rlctl.core import (KL_DEFAULT_ESTIMATOR, KL_PLACEMENT_NOTES, get_policy_loss,
                        kl_estimate, resolve_kl_estimator)
from rlctl.train.trainer import compute_advantages
from rlctl.train.update import UpdateState, accumulate_gradients
from rlctl.types import LogProbs, RolloutBatch

V, BETA = 5, 0.3
THETA = torch.tensor([0.4, -1.1, 0.9, 0.05, -0.3], dtype=torch.float64)
REF = torch.log_softmax(torch.tensor([-0.2, 0.7, 0.1, -0.9, 0.5], dtype=torch.float64), 0)


class Bandit(torch.nn.Module):
    """Every position's logits are theta [V]: a categorical policy in LM clothing."""

    def __init__(self):
        super().__init__()
        self.theta = torch.nn.Parameter(THETA.clone())

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
        return SimpleNamespace(logits=self.theta.expand(*input_ids.shape, V))   # [N, L, V]


def _batch(action: int) -> RolloutBatch:
    """One sequence: prompt token 0, completion token `action`."""
    return RolloutBatch(input_ids=torch.tensor([[0, action]]), attention_mask=torch.ones(1, 2, dtype=torch.long),
                        mask=torch.ones(1, 1, dtype=torch.float64), truncated=torch.tensor([False]),
                        rewards=torch.zeros(1, dtype=torch.float64), group_ids=torch.zeros(1, dtype=torch.long),
                        prompt_len=1, group_size=1, prompts=[""], completions=[""],
                        logprobs=LogProbs(ref=REF[action].reshape(1, 1)))


def _engine_grad(action: int, kind: str, placement: str) -> torch.Tensor:
    """The gradient the engine's update applies for one sampled action. [V]"""
    model, batch = Bandit(), _batch(action)
    logp = torch.log_softmax(model.theta, 0)[action].reshape(1, 1)          # [1, 1], has grad
    batch = batch.replace(logprobs=dict(old=logp))   # with grad: the shaping must not differentiate it
    adv = settings(estimator="reinforce", std_eps=0.0, baseline="none", gamma=1.0,
                            lam=1.0, whiten=False, kl_in_reward=placement == "in_reward",
                            kl_estimator=kind, overlong_buffer=0, overlong_penalty=0.0,
                            max_new_tokens=1)
    batch.advantages, _ = compute_advantages(batch, adv, BETA, None)
    assert not batch.advantages.requires_grad
    batch = batch.replace(logprobs=dict(old=None))   # single pass: ratio 1, old = current (detached)
    s = settings(policy_loss=get_policy_loss("ppo_clip"), clip_low=0.2, clip_high=0.2,
                       agg_mode="token-mean", norm_len=None, epochs=1, minibatches=1,
                       kl_estimator=kind, kl_in_loss=placement == "in_loss", temperature=1.0, share_prompts=False)
    accumulate_gradients(model, TorchBackend(), batch, s, UpdateState(kl_coef=BETA))
    return model.theta.grad.detach()


def _expected_engine_grad(kind: str, placement: str) -> torch.Tensor:
    pi = torch.softmax(THETA, 0)                                             # [V]
    return sum(pi[a] * _engine_grad(a, kind, placement) for a in range(V))  # [V]


def _grad(f) -> torch.Tensor:
    theta = THETA.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(f(theta), theta)
    return g


def kl_forward(theta):    # KL(pi || ref)
    logp = torch.log_softmax(theta, 0)
    return (logp.exp() * (logp - REF)).sum()


def kl_reverse(theta):    # KL(ref || pi)
    return (REF.exp() * (REF - torch.log_softmax(theta, 0))).sum()


def k2_mean(theta):       # E_pi[k2] = 0.5 * sum_a pi(a) (log pi(a) - log ref(a))^2
    logp = torch.log_softmax(theta, 0)
    return (logp.exp() * 0.5 * (logp - REF) ** 2).sum()


# What each pair follows, as stated in rlctl/core/losses.py's docstring and docs/algorithms.md.
STATED = {
    ("k1", "in_reward"): lambda: _grad(kl_forward),
    ("k2", "in_reward"): lambda: _grad(k2_mean) - _grad(kl_forward),
    ("k3", "in_reward"): lambda: _grad(kl_forward) - _grad(kl_reverse),
    ("k1", "in_loss"): lambda: torch.zeros(V, dtype=torch.float64),
    ("k2", "in_loss"): lambda: _grad(kl_forward),
    ("k3", "in_loss"): lambda: _grad(kl_reverse),
}


@pytest.mark.parametrize("kind,placement", sorted(STATED))
def test_expected_gradient_follows_the_stated_divergence(kind, placement):
    got = _expected_engine_grad(kind, placement)
    torch.testing.assert_close(got, BETA * STATED[kind, placement](), rtol=0, atol=1e-10)


def test_biased_pairs_miss_the_kl_gradient_by_the_stated_amount():
    g_fwd, g_rev = _grad(kl_forward), _grad(kl_reverse)
    bias = {("k2", "in_reward"): _grad(k2_mean) - 2 * g_fwd,   # k2 - KL(pi||ref) target
            ("k3", "in_reward"): -g_rev,
            ("k1", "in_loss"): -g_fwd}
    for pair, b in bias.items():
        miss = _expected_engine_grad(*pair) / BETA - g_fwd
        torch.testing.assert_close(miss, b, rtol=0, atol=1e-10)
        assert b.norm() > 0.1, pair        # a real bias on this categorical, not rounding
    assert g_fwd.norm() > 0.1 and (g_fwd - g_rev).norm() > 0.1   # the two KLs differ here


def test_warnings_cover_exactly_the_pairs_that_miss_a_kl():
    assert set(KL_PLACEMENT_NOTES) == {("k1", "in_loss"), ("k2", "in_reward"), ("k3", "in_reward")}
    assert KL_DEFAULT_ESTIMATOR == {"in_reward": "k1", "in_loss": "k3"}
    assert resolve_kl_estimator(None, "in_reward") == "k1"
    assert resolve_kl_estimator(None, "in_loss") == "k3"
    assert resolve_kl_estimator("mse", "in_reward") == "k2"
    for bad in (("k4", "in_loss"), ("k1", "in_value")):
        with pytest.raises(ValueError, match="valid"):
            resolve_kl_estimator(*bad)
    with pytest.raises(ValueError, match="resolve_kl_estimator"):
        kl_estimate(torch.zeros(1, 1), torch.zeros(1, 1), None)


def test_engine_in_reward_shaping_is_a_constant_reward():
    """The shaped return is -beta * k(old log-probs), detached, and the update adds no KL
    term to the loss: raising the coefficient changes nothing once advantages are fixed."""
    model, batch = Bandit(), _batch(2)
    logp = torch.log_softmax(model.theta, 0)[2].reshape(1, 1)
    batch = batch.replace(logprobs=dict(old=logp))
    adv = settings(estimator="reinforce", std_eps=0.0, baseline="none", gamma=1.0, lam=1.0,
                            whiten=False, kl_in_reward=True, kl_estimator="k1", overlong_buffer=0,
                            overlong_penalty=0.0, max_new_tokens=1)
    a, _ = compute_advantages(batch, adv, BETA, None)
    assert not a.requires_grad
    assert a.item() == pytest.approx(-BETA * (logp.item() - REF[2].item()), abs=1e-15)
    grads = [_engine_grad(2, "k1", "in_reward")]
    for coef in (0.0, 5.0):          # same advantages, different kl_coef in the update
        m, b = Bandit(), _batch(2)
        b.advantages = a
        s = settings(policy_loss=get_policy_loss("ppo_clip"), clip_low=0.2, clip_high=0.2,
                           agg_mode="token-mean", norm_len=None, epochs=1, minibatches=1,
                           kl_estimator="k1", kl_in_loss=False, temperature=1.0, share_prompts=False)
        accumulate_gradients(m, TorchBackend(), b, s, UpdateState(kl_coef=coef))
        grads.append(m.theta.grad)
    for g in grads[1:]:
        torch.testing.assert_close(g, grads[0], rtol=0, atol=1e-15)
