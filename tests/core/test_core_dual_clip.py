"""Dual-clip PPO and the shared policy-loss contract (registry signature, metric schema)."""
import math

import pytest
import torch

from loss_reference import ppo_clip_loss
from rlctl.core import POLICY_LOSSES, aggregate, get_policy_loss, ppo_clip_per_token

# clip_low = clip_high = 0.2, c = 3. (A, rho, loss, d loss / d logp), by hand:
#   A < 0: PPO loss = -A * max(rho, clip(rho)); dual clip: min(that, c * |A|)
DUAL_TABLE = [
    (-1.0, 4.0, 3.0, 0.0),    # 4 > c: capped at 3 * 1, constant -> no gradient
    (-1.0, 2.0, 2.0, 2.0),    # 1.2 < 2 < 3: PPO's unclipped branch, d(-A rho)/dlogp = 2
    (-1.0, 0.5, 0.8, 0.0),    # PPO clip low (0.5 < 0.8), unaffected by c
    (+1.0, 4.0, -1.2, 0.0),   # A > 0: PPO clip high, unaffected by c
    (+1.0, 0.5, -0.5, -0.5),  # A > 0 unclipped, unaffected by c
    (-2.0, 3.5, 6.0, 0.0),    # capped at c * |A| = 6 (PPO alone: 7)
    (-2.0, 2.9, 5.8, 5.8),    # just below c: not capped
]
# Without the dual clip rows 0 and 5 are PPO's unclipped branch: loss = grad = -A * rho.
NO_DUAL = {0: (4.0, 4.0), 5: (7.0, 7.0)}


def _inputs(table, pad=True):
    adv = [a for a, _, _, _ in table] + ([-1.0] if pad else [])
    rho = [r for _, r, _, _ in table] + ([100.0] if pad else [])  # padding: huge, A < 0
    old = torch.linspace(-2.0, -0.1, len(rho), dtype=torch.float64)[None]  # [1, T]
    logp = (old + torch.tensor([rho], dtype=torch.float64).log()).requires_grad_(True)
    mask = torch.tensor([[1.0] * len(table) + ([0.0] if pad else [])], dtype=torch.float64)
    return logp, old, torch.tensor([adv], dtype=torch.float64), mask


def test_dual_clip_hand_table_values_gradients_metrics():
    logp, old, adv, mask = _inputs(DUAL_TABLE)
    loss_mat, m = ppo_clip_per_token(logp, old, adv, mask, 0.2, 0.2, 3.0)
    expect = [loss for _, _, loss, _ in DUAL_TABLE] + [0.0]
    torch.testing.assert_close(loss_mat.detach(), torch.tensor([expect], dtype=torch.float64))
    (grad,) = torch.autograd.grad(loss_mat.sum(), logp)
    expect_grad = [g for _, _, _, g in DUAL_TABLE] + [0.0]
    torch.testing.assert_close(grad, torch.tensor([expect_grad], dtype=torch.float64))
    n = len(DUAL_TABLE)  # the padded token (A < 0, rho 100) is not counted
    assert m["policy/clip_frac_dual"].item() == pytest.approx(2 / n)
    assert m["policy/clip_frac_low"].item() == pytest.approx(1 / n)
    assert m["policy/clip_frac_high"].item() == pytest.approx(1 / n)
    assert m["policy/clip_frac"].item() == pytest.approx(2 / n)  # ratio clip only, dual separate
    assert all(not v.requires_grad for v in m.values())


def test_dual_clip_off_is_plain_ppo():
    logp, old, adv, mask = _inputs(DUAL_TABLE)
    loss_mat, m = ppo_clip_per_token(logp, old, adv, mask, 0.2, 0.2, None)
    (grad,) = torch.autograd.grad(loss_mat.sum(), logp)
    for j, (_, _, loss, g) in enumerate(DUAL_TABLE):
        want_loss, want_grad = NO_DUAL.get(j, (loss, g))
        assert loss_mat[0, j].item() == pytest.approx(want_loss)
        assert grad[0, j].item() == pytest.approx(want_grad)
    assert m["policy/clip_frac_dual"].item() == 0.0
    # the 6-positional-argument call (the engine's) is the same as clip_ratio_c=None
    a, _ = ppo_clip_per_token(logp, old, adv, mask, 0.2, 0.2)
    b, _ = ppo_clip_per_token(logp, old, adv, mask, 0.2, 0.2, None)
    assert torch.equal(a, b)


def test_dual_clip_never_changes_positive_advantages():
    torch.manual_seed(0)
    old = -torch.rand(5, 7, dtype=torch.float64) * 3
    logp = old + torch.randn(5, 7, dtype=torch.float64) * 2  # ratios from ~e^-6 to e^6
    adv = torch.rand(5, 7, dtype=torch.float64) + 0.1  # all > 0
    mask = torch.ones(5, 7)
    with_c, m = ppo_clip_per_token(logp, old, adv, mask, 0.2, 0.28, 1.5)
    without, _ = ppo_clip_per_token(logp, old, adv, mask, 0.2, 0.28)
    assert torch.equal(with_c, without) and m["policy/clip_frac_dual"].item() == 0.0


def test_dual_clip_gradcheck_away_from_kinks():
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(4, 6, generator=g, dtype=torch.float64)
    log_rho = (torch.rand(4, 6, generator=g, dtype=torch.float64) - 0.3) * 3  # rho in ~0.4..8
    kinks = torch.tensor([0.8, 1.25, 2.5]).log().double()
    log_rho = torch.where((log_rho[..., None] - kinks).abs().min(-1).values < 0.05,
                          log_rho + 0.1, log_rho)
    adv = torch.randn(4, 6, generator=g, dtype=torch.float64)
    mask = (torch.arange(6)[None] < torch.tensor([[6], [4], [0], [2]])).double()

    def f(lp):
        loss_mat, _ = ppo_clip_per_token(lp, old, adv, mask, 0.2, 0.25, 2.5)
        return aggregate(loss_mat, mask, "seq-mean-token-mean")

    assert torch.autograd.gradcheck(f, ((old + log_rho).requires_grad_(True),))


def test_dual_clip_validation_and_wrapper():
    logp, old, adv, mask = _inputs(DUAL_TABLE, pad=False)
    for bad in (1.0, 0.5, -3.0):
        with pytest.raises(ValueError, match="clip_ratio_c"):
            ppo_clip_per_token(logp, old, adv, mask, 0.2, 0.2, bad)
        with pytest.raises(ValueError, match="clip_ratio_c"):
            get_policy_loss("gspo")(logp, old, adv, mask, 0.2, 0.2, bad)
    loss, m = ppo_clip_loss(logp, old, adv, mask, clip_ratio_c=3.0)
    assert loss.item() == pytest.approx(sum(x for _, _, x, _ in DUAL_TABLE) / len(DUAL_TABLE))
    assert m["policy/clip_frac_dual"].item() == pytest.approx(2 / len(DUAL_TABLE))


SCHEMA = {"policy/clip_frac_low", "policy/clip_frac_high", "policy/clip_frac", "policy/clip_frac_dual",
          "policy/approx_kl"}


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_registry_signature_and_metric_schema(name):
    fn = get_policy_loss(name)
    torch.manual_seed(1)
    logp = (-torch.rand(3, 4) * 2).requires_grad_(True)
    old, adv, mask = logp.detach() + 0.3, torch.tensor([1.0, -1.0, 0.5]), torch.ones(3, 4)
    a, m6 = fn(logp, old, adv, mask, 0.2, 0.2)  # engine call: 6 positional args
    b, m7 = fn(logp, old, adv, mask, 0.2, 0.2, None)
    c, _ = fn(logp, old, adv, mask, 0.2, 0.2, clip_ratio_c=2.0)
    assert a.shape == (3, 4) and torch.equal(a, b)
    assert set(m6) == set(m7) == SCHEMA
    assert all(v.dim() == 0 and not v.requires_grad for v in m6.values())
    assert torch.isfinite(c).all()


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_masked_garbage_empty_rows_and_bf16(name):
    fn = get_policy_loss(name)
    logp = torch.tensor([[-0.5, float("-inf"), float("nan")], [-1.0, -0.2, -3.0],
                         [float("nan")] * 3], requires_grad=True)
    old = torch.tensor([[-0.4, float("nan"), float("inf")], [-0.9, -0.3, -2.0],
                        [0.0, 0.0, 0.0]])
    adv = torch.tensor([[1.0, float("nan"), 7.0], [-1.0, -1.0, -1.0], [float("inf")] * 3])
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    loss_mat, m = fn(logp, old, adv, mask, 0.2, 0.2)
    assert torch.isfinite(loss_mat).all() and all(torch.isfinite(v) for v in m.values())
    loss = aggregate(loss_mat, mask, "seq-mean-token-mean")
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.isfinite(grad).all() and (grad[mask == 0] == 0).all()
    zero_mat, zm = fn(logp, old, adv, torch.zeros(3, 3), 0.2, 0.2)
    assert (zero_mat == 0).all() and all(v.item() == 0.0 for v in zm.values())
    lp16 = torch.randn(2, 5).bfloat16().requires_grad_(True)
    out, m16 = fn(lp16, lp16.detach() + 0.05, torch.tensor([1.0, -1.0]), torch.ones(2, 5),
                  0.2, 0.2)
    aggregate(out, torch.ones(2, 5)).backward()
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert lp16.grad.dtype == torch.bfloat16 and math.isfinite(m16["policy/approx_kl"].item())
