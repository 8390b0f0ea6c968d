"""Property-based checks of the core math over random shapes, masks and lengths
(hypothesis): no NaN anywhere, and the invariants that must hold whatever the data."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loss_reference import ppo_clip_loss
from rlctl.core import (AGG_MODES, aggregate, gae, group_advantages, kl_estimate, masked_whiten,
                        rloo_advantages)


@st.composite
def ragged(draw):
    """(values [N, T], mask [N, T]) with per-row lengths 0..T (empty rows included)."""
    n, t = draw(st.integers(1, 6)), draw(st.integers(1, 7))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([draw(st.integers(0, t)) for _ in range(n)])
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()
    values = torch.randn(n, t, generator=g) * draw(st.sampled_from([1e-3, 1.0, 1e3]))
    return values, mask


@settings(max_examples=200, deadline=None)
@given(ragged(), st.floats(-5, 5), st.sampled_from(AGG_MODES))
def test_aggregation_finite_and_constant_invariant(data, c, mode):
    values, mask = data
    assert torch.isfinite(aggregate(values, mask, mode))
    const = aggregate(torch.full_like(values, c), mask, mode)
    rows = mask.sum(-1)
    if rows.sum() == 0:
        assert const == 0                                     # nothing counted: 0, not NaN
    elif mode in ("token-mean", "seq-mean-token-mean"):
        torch.testing.assert_close(const, torch.tensor(c), atol=1e-5, rtol=1e-5)
    elif mode == "seq-mean-token-sum":                        # c times the mean non-empty length
        torch.testing.assert_close(const, torch.tensor(c) * rows[rows > 0].mean(), atol=1e-4, rtol=1e-5)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5), st.integers(1, 6), st.floats(-10, 10), st.integers(0, 10**6))
def test_equal_rewards_give_zero_advantage(b, g, r, seed):
    equal = torch.full((b, g), r)
    assert torch.equal(group_advantages(equal), torch.zeros(b, g))
    assert torch.equal(group_advantages(equal, scale_std=False), torch.zeros(b, g))
    assert torch.equal(rloo_advantages(equal), torch.zeros(b, g))
    noisy = torch.randn(b, g, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    # Centred: each row sums to 0 exactly in real arithmetic. In float64 the mean and the g
    # differences carry at most about 2 g^2 u max|x| of rounding (u = 2^-53), which
    # group_advantages divides by (std + 1e-6); float32 would not do: two close rewards give a
    # tiny std and the rounding of their mean is magnified without bound.
    u, top = 2.0 ** -53, noisy.abs().amax(-1)                             # [B]
    slack = 2 * g ** 2 * u * top
    for adv, bound in ((group_advantages(noisy), slack / (noisy.std(-1).nan_to_num(0.0) + 1e-6)),   # g = 1: std NaN, adv 0
                       (rloo_advantages(noisy), slack * g / max(g - 1, 1))):
        assert torch.isfinite(adv).all()
        assert (adv.sum(-1).abs() <= bound).all(), (adv.sum(-1), bound)


@settings(max_examples=150, deadline=None)
@given(ragged(), st.sampled_from(AGG_MODES), st.floats(0.05, 0.5))
def test_first_pass_ratio_is_one(data, mode, eps):
    adv, mask = data
    logp = (-torch.rand_like(adv) * 3).requires_grad_()
    loss, m = ppo_clip_loss(logp, logp.detach(), adv, mask, eps, eps, agg_mode=mode)
    assert torch.isfinite(loss)
    assert m["policy/clip_frac"] == 0 and m["policy/approx_kl"] == 0
    torch.testing.assert_close(loss, aggregate(-adv, mask, mode), atol=1e-4, rtol=1e-4)


@settings(max_examples=150, deadline=None)
@given(ragged(), st.floats(0.5, 1.0), st.floats(0.0, 1.0))
def test_kl_gae_whiten_are_finite(data, gamma, lam):
    x, mask = data
    y = x + 0.1
    for kind in ("k1", "k2", "k3"):
        assert torch.isfinite(kl_estimate(x.clamp(-30, 0), y.clamp(-30, 0), kind)).all()
    assert (kl_estimate(x.clamp(-30, 0), y.clamp(-30, 0), "k3") >= 0).all()
    adv, ret = gae(x, y, mask, gamma, lam)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert (adv[mask == 0] == 0).all()
    assert torch.isfinite(masked_whiten(x, mask)).all()
