"""Advantage estimators against hand computations and slow loops."""
import math
import statistics

import pytest
import torch

from rlctl.core import (ADVANTAGE_ESTIMATORS, broadcast_to_tokens, gae,
                        get_advantage_estimator, group_advantages, rloo_advantages)


def test_group_advantages_by_hand():
    # mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 1/sqrt(3) -> +-0.5 * sqrt(3)
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]), eps=0.0)
    h = 0.5 * math.sqrt(3)
    torch.testing.assert_close(adv, torch.tensor([[h, -h, -h, h]]))


def test_group_advantages_vs_slow_loop():
    torch.manual_seed(0)
    r = torch.randn(5, 6, dtype=torch.float64)
    adv = group_advantages(r, eps=1e-6)
    for b in range(5):
        row = r[b].tolist()
        mu, sd = statistics.mean(row), statistics.stdev(row)
        for g in range(6):
            assert adv[b, g].item() == pytest.approx((row[g] - mu) / (sd + 1e-6))
    dr = get_advantage_estimator("dr_grpo")(r, 1e-6)
    torch.testing.assert_close(dr, r - r.mean(-1, keepdim=True))


def test_constant_groups_and_single_sample_give_exact_zeros():
    r = torch.tensor([[0.1, 0.1, 0.1], [1.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    for e in map(ADVANTAGE_ESTIMATORS.entry, ADVANTAGE_ESTIMATORS):
        if e.level == "outcome":
            assert torch.isfinite(e.fn(r, 1e-6)).all()
    for name in ("grpo", "dr_grpo", "rloo"):
        adv = get_advantage_estimator(name)(r, 1e-6)
        assert (adv[:2] == 0).all(), name  # exactly zero, not ~1e-11
        assert (adv[2] != 0).all()
        assert (get_advantage_estimator(name)(torch.randn(4, 1), 1e-6) == 0).all()


def test_constant_group_rounding_is_not_amplified():
    # float32 mean of eight 0.3s is off by ~3e-8; dividing by (std + eps) would turn that
    # into advantages of ~0.03. A constant group must carry no signal at all.
    r = torch.tensor([[0.3] * 8, [0.7] * 8, [0.1] * 7 + [0.2]])
    for name in ("grpo", "dr_grpo", "rloo"):
        adv = get_advantage_estimator(name)(r, 1e-6)
        assert (adv[:2] == 0).all(), name
        assert (adv[2] != 0).all()


def test_rloo_vs_loop_and_scaled_centering():
    torch.manual_seed(1)
    r = torch.rand(3, 5, dtype=torch.float64)
    adv = rloo_advantages(r)
    for b in range(3):
        for i in range(5):
            others = [r[b, j].item() for j in range(5) if j != i]
            assert adv[b, i].item() == pytest.approx(r[b, i].item() - sum(others) / 4)
    torch.testing.assert_close(adv, 5 / 4 * (r - r.mean(-1, keepdim=True)))


def test_reinforce_estimators_and_registry():
    r = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    assert set(ADVANTAGE_ESTIMATORS) == {"reinforce", "reinforce_baseline", "rloo", "grpo",
                                         "dr_grpo", "gae"}
    levels = {e.name: e.level for e in map(ADVANTAGE_ESTIMATORS.entry, ADVANTAGE_ESTIMATORS)}
    assert levels.pop("gae") == "token" and set(levels.values()) == {"outcome"}
    torch.testing.assert_close(get_advantage_estimator("reinforce")(r, 0.0), r)
    torch.testing.assert_close(get_advantage_estimator("reinforce_baseline")(r, 0.0),
                               r - 0.25)
    assert get_advantage_estimator("dr-grpo") is get_advantage_estimator("dr_grpo")
    assert get_advantage_estimator("gae") is gae
    with pytest.raises(ValueError, match="gae, grpo, reinforce, reinforce_baseline"):
        get_advantage_estimator("nope")


def test_broadcast_to_tokens():
    adv = torch.tensor([[1.0, -1.0], [2.0, 0.5]])  # [B=2, G=2] -> N = 4
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]]).float()
    out = broadcast_to_tokens(adv, mask)
    expect = torch.tensor([[1, 1, 0], [-1, 0, 0], [2, 2, 2], [0, 0, 0]]).float()
    torch.testing.assert_close(out, expect)
    with pytest.raises(ValueError):
        broadcast_to_tokens(adv, mask[:3])


def _gae_one(rewards, values, gamma, lam):
    """The textbook GAE loop, on plain Python floats, for one unpadded sequence."""
    adv, next_value, running = [0.0] * len(rewards), 0.0, 0.0
    for t in reversed(range(len(rewards))):
        delta = rewards[t] + gamma * next_value - values[t]
        running = delta + gamma * lam * running
        adv[t], next_value = running, values[t]
    return adv


def test_gae_hand_example_in_padded_batch():
    beta, logp, ref = 0.05, [-1.0, -0.5, -0.2], [-1.2, -0.5, -0.4]
    r = [-beta * (a - b) for a, b in zip(logp, ref)]  # kl_shaped_rewards
    r[-1] += 1.0
    v = [0.5, 0.6, 0.8]
    hand = _gae_one(r, v, 1.0, 0.95)
    # by hand: 0.19; 0.2 + 0.95 * 0.19 = 0.3805; 0.09 + 0.95 * 0.3805 = 0.451475
    assert hand == pytest.approx([0.451475, 0.3805, 0.19])
    rewards = torch.tensor([r + [5.0, 5.0], [0.0, 0.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([v + [9.0, 9.0], [0.1, 0.2, 0.3, 0.4, 0.5]])
    mask = torch.tensor([[1.0, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=0.95)
    torch.testing.assert_close(adv[0], torch.tensor(hand + [0.0, 0.0]))
    torch.testing.assert_close(adv[1], torch.tensor(_gae_one(rewards[1].tolist(),
                                                             values[1].tolist(), 1.0, 0.95)))
    torch.testing.assert_close(ret, adv + values)


def _ragged(n=6, t=7, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 1, 4, 0, 6, 3])[:n]
    mask = (torch.arange(t)[None, :] < lengths[:, None]).to(dtype)
    return (torch.randn(n, t, generator=g, dtype=dtype),
            torch.randn(n, t, generator=g, dtype=dtype), mask, lengths)


def test_gae_lambda_one_is_reward_to_go_minus_value():
    r, v, mask, lengths = _ragged()
    adv, _ = gae(r, v, mask, gamma=1.0, lam=1.0)
    for i, length in enumerate(lengths.tolist()):
        for t in range(length):
            rtg = sum(r[i, k].item() for k in range(t, length))
            assert adv[i, t].item() == pytest.approx(rtg - v[i, t].item())
    assert (adv[mask == 0] == 0).all()


def test_gae_lambda_zero_is_one_step_td():
    r, v, mask, lengths = _ragged(seed=1)
    adv, _ = gae(r, v, mask, gamma=0.9, lam=0.0)
    for i, length in enumerate(lengths.tolist()):
        for t in range(length):
            v_next = v[i, t + 1].item() if t + 1 < length else 0.0
            td = r[i, t].item() + 0.9 * v_next - v[i, t].item()
            assert adv[i, t].item() == pytest.approx(td)


@pytest.mark.parametrize("seed", range(3))
def test_gae_vectorised_equals_loop_on_ragged_rows(seed):
    g = torch.Generator().manual_seed(seed)
    n, t = 8, 11
    lengths = torch.randint(0, t + 1, (n,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).double()
    r, v = torch.randn(n, t, generator=g).double(), torch.randn(n, t, generator=g).double()
    adv, ret = gae(r, v, mask, gamma=0.97, lam=0.9)
    for i, length in enumerate(lengths.tolist()):
        ref = _gae_one(r[i, :length].tolist(), v[i, :length].tolist(), 0.97, 0.9)
        torch.testing.assert_close(adv[i, :length], torch.tensor(ref, dtype=torch.float64))
        assert (adv[i, length:] == 0).all()


def test_gae_skips_masked_gaps_no_grad_and_bf16():
    r = torch.tensor([[0.0, 7.0, 0.0, 1.0]])
    v = torch.tensor([[0.2, 9.0, 0.4, 0.6]], requires_grad=True)
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0]])  # a masked gap (e.g. tool output)
    adv, ret = gae(r, v, mask, gamma=1.0, lam=0.5)
    ref = _gae_one([0.0, 0.0, 1.0], [0.2, 0.4, 0.6], 1.0, 0.5)
    torch.testing.assert_close(adv[0, [0, 2, 3]], torch.tensor(ref))
    assert adv[0, 1] == 0 and not ret.requires_grad
    adv, ret = gae(r.bfloat16(), v.detach().bfloat16(), torch.zeros(1, 4), 1.0, 0.95)
    assert adv.dtype == torch.float32 and (adv == 0).all() and torch.isfinite(ret).all()
