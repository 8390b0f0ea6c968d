"""KL estimators: hand values, sign, and exact expectations on a small categorical."""
import math

import pytest
import torch

from rlctl.core import KL_ESTIMATORS, kl_estimate


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
