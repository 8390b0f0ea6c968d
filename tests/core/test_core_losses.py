"""Policy / value losses against hand-worked tables and derivations."""
import math

import pytest
import torch

from loss_reference import ppo_clip_loss, value_loss, vanilla_pg_loss
from rlctl.core import AGG_MODES, get_policy_loss, ppo_clip_per_token, token_logprobs

# PPO clipping worked by hand (eps = 0.2): (A, rho, min-objective, gradient flows?)
PPO_TABLE = [(+2.0, 1.1, 2.2, True), (+2.0, 1.5, 2.4, False),
             (-1.0, 0.6, -0.8, False), (-1.0, 1.5, -1.5, True)]


def _table_inputs(dtype=torch.float64):
    adv = torch.tensor([[a for a, _, _, _ in PPO_TABLE]], dtype=dtype)  # [1, 4]
    rho = torch.tensor([[r for _, r, _, _ in PPO_TABLE]], dtype=dtype)
    old = torch.tensor([[-0.7, -2.0, -1.3, -0.2]], dtype=dtype)
    logp = (old + torch.log(rho)).requires_grad_(True)
    return logp, old, adv, torch.ones_like(adv)


def test_ppo_seed_table_values_and_gradients():
    logp, old, adv, mask = _table_inputs()
    loss_mat, metrics = ppo_clip_per_token(logp, old, adv, mask, 0.2, 0.2)
    expected = torch.tensor([[-obj for _, _, obj, _ in PPO_TABLE]], dtype=torch.float64)
    torch.testing.assert_close(loss_mat.detach(), expected)
    (grad,) = torch.autograd.grad(loss_mat.sum(), logp)
    for j, (a, rho, _, flows) in enumerate(PPO_TABLE):
        if flows:  # d(-A * rho)/d logp = -A * rho on the unclipped branch
            assert grad[0, j].item() == pytest.approx(-a * rho)
            assert grad[0, j].item() != 0.0
        else:
            assert grad[0, j].item() == 0.0
    # case 3 is clipped low (A<0, rho<0.8), case 2 clipped high (A>0, rho>1.2)
    assert metrics["policy/clip_frac_low"].item() == pytest.approx(0.25)
    assert metrics["policy/clip_frac_high"].item() == pytest.approx(0.25)
    assert metrics["policy/clip_frac"].item() == pytest.approx(0.5)
    rhos = [r for _, r, _, _ in PPO_TABLE]
    kl = sum((r - 1) - math.log(r) for r in rhos) / 4
    assert metrics["policy/approx_kl"].item() == pytest.approx(kl)
    assert all(not v.requires_grad for v in metrics.values())


def test_ppo_seed_self_test_and_asymmetric_clip():
    # seed self-test: A=+1, rho=1.3, eps=0.2 -> objective min(1.3, 1.2) = 1.2, zero grad
    logp = torch.tensor([[math.log(1.3)]], dtype=torch.float64, requires_grad=True)
    old, adv, mask = torch.zeros(1, 1, dtype=torch.float64), torch.ones(1, 1), torch.ones(1, 1)
    loss, m = ppo_clip_loss(logp, old, adv, mask)
    assert loss.item() == pytest.approx(-1.2)
    loss.backward()
    assert logp.grad.item() == 0.0 and m["policy/clip_frac_high"].item() == 1.0
    # clip-higher 0.4: 1.3 is inside the range, gradient flows, objective 1.3
    logp.grad = None
    loss, m = ppo_clip_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.4)
    loss.backward()
    assert loss.item() == pytest.approx(-1.3)
    assert logp.grad.item() == pytest.approx(-1.3) and m["policy/clip_frac"].item() == 0.0


def _reinforce_grads(baseline):
    """Per-action gradient of the objective (minus the loss gradient) for the 3-action bandit."""
    grads = []
    for a in range(3):
        logits = torch.zeros(3, dtype=torch.float64, requires_grad=True)
        logp = token_logprobs(logits.view(1, 1, 3), torch.tensor([[a]]))  # [1, 1]
        adv = torch.tensor([(1.0 if a == 0 else 0.0) - baseline], dtype=torch.float64)
        loss, _ = vanilla_pg_loss(logp, logp.detach(), adv, torch.ones(1, 1))
        (g,) = torch.autograd.grad(loss, logits)
        grads.append(-g)
    return torch.stack(grads)  # [3 actions, 3 logits]


@pytest.mark.parametrize("baseline,per_action,var0", [
    (0.0, [[2 / 3, -1 / 3, -1 / 3], [0, 0, 0], [0, 0, 0]], 8 / 81),
    (1 / 3, [[4 / 9, -2 / 9, -2 / 9], [1 / 9, -2 / 9, 1 / 9], [1 / 9, 1 / 9, -2 / 9]], 2 / 81),
])
def test_reinforce_seed_worked_example(baseline, per_action, var0):
    p = torch.full((3,), 1 / 3, dtype=torch.float64)  # softmax of logits (0, 0, 0)
    g = _reinforce_grads(baseline)
    torch.testing.assert_close(g, torch.tensor(per_action, dtype=torch.float64))
    mean = (p[:, None] * g).sum(0)
    torch.testing.assert_close(mean, torch.tensor([2 / 9, -1 / 9, -1 / 9], dtype=torch.float64))
    var_first = (p * g[:, 0] ** 2).sum() - mean[0] ** 2
    assert var_first.item() == pytest.approx(var0)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_ratio_one_matches_vanilla_pg(mode):
    torch.manual_seed(0)
    logp = (-torch.rand(4, 6, dtype=torch.float64) * 3).requires_grad_(True)
    adv = torch.randn(4, 6, dtype=torch.float64)
    mask = (torch.arange(6)[None, :] < torch.tensor([[6], [3], [1], [5]])).double()
    loss, m = ppo_clip_loss(logp, logp.detach(), adv, mask, agg_mode=mode)
    (g_ppo,) = torch.autograd.grad(loss, logp)
    for key in ("policy/clip_frac_low", "policy/clip_frac_high", "policy/clip_frac", "policy/approx_kl"):
        assert m[key].item() == 0.0
    # independent REINFORCE objective: -A * logp, aggregated by hand for token-mean
    vpg, _ = vanilla_pg_loss(logp, logp.detach(), adv, mask, agg_mode=mode)
    (g_vpg,) = torch.autograd.grad(vpg, logp)
    torch.testing.assert_close(g_ppo, g_vpg)
    if mode == "token-mean":
        torch.testing.assert_close(g_ppo, -adv * mask / mask.sum())


def test_masked_garbage_and_empty_mask_are_safe():
    logp = torch.randn(2, 3, requires_grad=True)
    old = torch.tensor([[0.0, float("nan"), float("inf")], [float("-inf"), 0.0, 0.0]])
    mask = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 1.0]])
    for name in ("ppo_clip", "vanilla_pg"):
        loss_mat, m = get_policy_loss(name)(logp, old, torch.ones(2, 3), mask, 0.2, 0.2)
        assert torch.isfinite(loss_mat).all() and all(torch.isfinite(v) for v in m.values())
    loss, m = ppo_clip_loss(logp, old, torch.ones(2, 3), torch.zeros(2, 3))
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(logp.grad, torch.zeros(2, 3))
    assert all(v.item() == 0.0 for v in m.values())


def test_bf16_inputs_and_1d_advantages():
    logp = torch.randn(3, 4).bfloat16().requires_grad_(True)
    loss, m = ppo_clip_loss(logp, logp.detach() + 0.1, torch.tensor([1.0, -1.0, 0.5]),
                            torch.ones(3, 4), agg_mode="seq-mean-token-mean")
    loss.backward()
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert logp.grad is not None and logp.grad.dtype == torch.bfloat16


def test_get_policy_loss_unknown_lists_names():
    with pytest.raises(ValueError, match="ppo_clip.*vanilla_pg"):
        get_policy_loss("gspo_typo")


def test_value_loss_clipping_by_hand():
    values = torch.tensor([[1.0, 2.0, 1.6, 2.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[1.5, 1.5, 1.5, 1.5]], dtype=torch.float64)
    returns = torch.tensor([[0.0, 3.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.ones(1, 4)
    # tok0: V-R=1 -> 1; V_clip=1.3 -> 1.69 (clipped wins). tok1: 1 vs (1.7-3)^2=1.69.
    # tok2: V moved 0.1 < 0.2, V_clip = V -> 2.56 both, not counted as clipped.
    # tok3: the clamp moves V (2.0 -> 1.7) but the clipped error 2.89 is the smaller
    # (unclipped 4): the max takes the unclipped branch, not counted as clipped.
    loss, m = value_loss(values, old, returns, mask, clip=0.2)
    assert loss.item() == pytest.approx(0.5 * (1.69 + 1.69 + 2.56 + 4) / 4)
    assert set(m) == {"value/clip_frac"}      # named where computed, logged as is
    assert m["value/clip_frac"].item() == pytest.approx(2 / 4)
    loss.backward()  # clipped tokens give zero grad; tok2, tok3 grad = (V - R) / 4
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 0.0, 1.6 / 4, 2.0 / 4]],
                                                         dtype=torch.float64))
    loss, m = value_loss(values, None, returns, mask)
    assert loss.item() == pytest.approx(0.5 * (1 + 1 + 2.56 + 4) / 4) and m["value/clip_frac"] == 0


def test_value_clip_frac_is_zero_when_the_clip_is_too_wide_to_act():
    """old + (V - old) differs from V by rounding; that must not count as clipping. In
    float32 with V, old ~ N(0, 1) some tokens round so that the 'clipped' error is larger
    by an ulp (measured here: 11% of these 1024 tokens, all counted as clipped before)."""
    from rlctl.core.losses import value_loss_per_token
    g = torch.Generator().manual_seed(0)
    v, old, ret = (torch.randn(64, 16, generator=g) for _ in range(3))
    mask = torch.ones(64, 16)
    _, wide = value_loss_per_token(v, old, ret, mask, clip=100.0)
    assert wide["value/clip_frac"] == 0      # where the clamp acts: test_value_loss_clipping_by_hand
