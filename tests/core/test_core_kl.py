"""KL estimators (hand values, sign, exact expectations on a small categorical), KL-shaped
rewards on ragged rows, and the KL coefficient controllers."""
import math

import pytest
import torch

from rlctl.core import (KL_ESTIMATORS, AdaptiveKLController, FixedKLController, kl_estimate,
                        kl_shaped_rewards)


def test_hand_values():
    logp, ref = torch.tensor([[-1.0]]), torch.tensor([[-1.5]])
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(0.5)
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(0.125)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(math.exp(-0.5) + 0.5 - 1)


def test_k3_nonnegative_and_zero_at_equality():
    torch.manual_seed(0)
    logp, ref = -torch.rand(64, 9) * 5, -torch.rand(64, 9) * 5
    assert (kl_estimate(logp, ref, "k3") >= 0).all()
    assert (kl_estimate(logp, ref, "k2") >= 0).all()
    for kind in KL_ESTIMATORS:
        assert (kl_estimate(logp, logp.clone(), kind) == 0).all()


def test_k1_k3_expectation_is_exact_kl():
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.2, 0.6], dtype=torch.float64)
    kl = sum(pi * math.log(pi / qi) for pi, qi in zip(p.tolist(), q.tolist()))
    for kind in ("k1", "k3"):  # unbiased on samples from p
        est = kl_estimate(p.log()[None], q.log()[None], kind)[0]
        assert (p * est).sum().item() == pytest.approx(kl)


def test_unknown_kind_aliases_and_dtype():
    with pytest.raises(ValueError, match="k1.*k2.*k3"):
        kl_estimate(torch.zeros(1, 1), torch.zeros(1, 1), "k4")
    a, b = torch.randn(2, 3), torch.randn(2, 3)
    torch.testing.assert_close(kl_estimate(a, b, "low_var_kl"), kl_estimate(a, b, "k3"))
    out = kl_estimate(a.bfloat16(), b.bfloat16(), "k3")
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


def _loop_kl_shaped_rewards(final_reward, logp, ref, beta, kind="k1"):
    """A one-row reference on Python floats: -beta * k per token, the final reward added at
    the last token (k1; also k2 / k3)."""
    est = {"k1": lambda a, b: a - b, "k2": lambda a, b: 0.5 * (a - b) ** 2,
           "k3": lambda a, b: math.exp(b - a) - (b - a) - 1}[kind]
    r = [-beta * est(a, b) for a, b in zip(logp, ref)]
    r[-1] += final_reward
    return r


def test_kl_shaped_rewards_hand_example_in_ragged_batch():
    logp, ref = [-1.0, -0.5, -0.2], [-1.2, -0.5, -0.4]
    assert _loop_kl_shaped_rewards(1.0, logp, ref, 0.05) == pytest.approx([-0.01, 0.0, 0.99])
    nan = float("nan")
    lp = torch.tensor([logp + [nan, 3.0], [-0.3, -0.1, -2.0, -0.7, -0.4], [nan] * 5,
                       [-0.2, nan, -0.9, -0.1, nan]])
    rf = torch.tensor([ref + [7.0, nan], [-0.5, -0.1, -1.0, -0.6, -0.9], [0.0] * 5,
                       [-0.4, 5.0, -0.3, -0.2, 1.0]])
    mask = torch.tensor([[1.0, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0],
                         [1, 0, 1, 1, 0]])  # row 3: a masked gap, last counted token t=3
    rewards = torch.tensor([1.0, -2.0, 9.0, 0.5])
    out = kl_shaped_rewards(rewards, lp, rf, mask, beta=0.05)
    torch.testing.assert_close(out[0], torch.tensor([-0.01, 0.0, 0.99, 0.0, 0.0]))
    assert (out[2] == 0).all()  # no counted token: no KL, no reward
    for kind in ("k1", "k3"):
        out = kl_shaped_rewards(rewards, lp, rf, mask, 0.05, kind)
        assert out.dtype == torch.float32 and torch.isfinite(out).all()
        for i in (0, 1, 3):
            idx = [t for t in range(5) if mask[i, t]]
            row = _loop_kl_shaped_rewards(rewards[i].item(), [lp[i, t].item() for t in idx],
                                          [rf[i, t].item() for t in idx], 0.05, kind)
            expect = torch.zeros(5)
            expect[idx] = torch.tensor(row)
            torch.testing.assert_close(out[i], expect)


def test_kl_shaped_rewards_shapes_dtype_no_grad():
    lp = torch.randn(4, 3, requires_grad=True)
    out = kl_shaped_rewards(torch.ones(2, 2), lp.bfloat16(), lp.detach().bfloat16(),
                            torch.ones(4, 3), 0.1, "low_var_kl")  # rewards [B, G] ok
    assert out.shape == (4, 3) and out.dtype == torch.float32 and not out.requires_grad
    torch.testing.assert_close(out, torch.tensor([[0.0, 0.0, 1.0]] * 4))
    assert kl_shaped_rewards(torch.ones(2), torch.zeros(2, 0), torch.zeros(2, 0),
                             torch.zeros(2, 0), 0.1).shape == (2, 0)
    with pytest.raises(ValueError, match="rows"):
        kl_shaped_rewards(torch.ones(3), lp, lp, torch.ones(4, 3), 0.1)
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_shaped_rewards(torch.ones(4), lp, lp, torch.ones(4, 3), 0.1, "k9")


def test_adaptive_kl_controller_two_updates_by_hand():
    ctl = AdaptiveKLController(init_coef=0.1, target=6.0, horizon=10000)
    # KL 9: error 9/6 - 1 = 0.5, clipped to 0.2; coef = 0.1 * (1 + 0.2 * 256/10000)
    assert ctl.update(9.0, 256) == pytest.approx(0.100512)
    # KL 5.4: error 0.9 - 1 = -0.1; coef = 0.100512 * (1 - 0.1 * 512/10000) = 0.100512 * 0.99488
    ctl.update(5.4, n_steps=512)
    assert ctl.coef == pytest.approx(0.09999737856)
    # KL 1.0: error -5/6 clipped to -0.2
    ctl2 = AdaptiveKLController(0.2, 6.0, 100)
    assert ctl2.update(1.0, 10) == pytest.approx(0.2 * 0.98)
    assert isinstance(ctl.coef, float)


def test_kl_controllers_state_and_edge_cases():
    ctl = AdaptiveKLController(0.05, 6.0, 1000)
    ctl.update(12.0, 100)
    fresh = AdaptiveKLController(0.05, 6.0, 1000)
    fresh.load_state_dict(ctl.state_dict())
    assert fresh.coef == ctl.coef == pytest.approx(0.05 * 1.02)
    before = ctl.coef
    ctl.update(float("nan"), 100)  # a NaN KL measurement does not poison the coefficient
    ctl.update(torch.tensor(6.0), 100)  # zero error; a tensor scalar is accepted
    assert ctl.coef == before
    ctl.update(0.0, 10_000_000)  # absurd n_steps: floored at 0, never negative
    assert ctl.coef == 0.0
    fixed = FixedKLController(0.1)
    assert fixed.update(100.0, 1000) == 0.1 and fixed.state_dict() == {"coef": 0.1}
    fixed.load_state_dict({"coef": 0.3})
    assert fixed.coef == 0.3
    for args in ((0.1, 0.0, 10), (0.1, 6.0, 0), (-0.1, 6.0, 10)):
        with pytest.raises(ValueError):
            AdaptiveKLController(*args)


def test_adaptive_kl_controller_counts_sequences_closed_form():
    """Ziegler et al. / TRL: n_steps = sequences in the update. KL held at 10x the target:
    the error 10 - 1 = 9 is clipped to 0.2, so each update of 64 sequences with horizon
    1000 multiplies beta by 1 + 0.2 * 64 / 1000 = 1.0128; after 100 updates 1.0128**100."""
    ctl = AdaptiveKLController(init_coef=0.05, target=2.0, horizon=1000)
    for _ in range(100):
        ctl.update(20.0, 64)
    assert abs(ctl.coef / 0.05 - 1.0128 ** 100) < 1e-12 * 1.0128 ** 100
    assert 3.5 < 1.0128 ** 100 < 3.6       # a real move (the old per-update count gave 1.002)
