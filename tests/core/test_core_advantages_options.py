"""REINFORCE baseline options, estimator **options, DAPO overlong penalty, zero-std groups."""
import pytest
import torch

from rlctl.core import (ADVANTAGE_ESTIMATORS, REINFORCE_BASELINES, get_advantage_estimator,
                        overlong_penalty, reinforce_advantages, zero_std_groups)

R = torch.tensor([[1.0, 0.0, 0.5], [0.0, 0.0, 2.5]])  # mean of all six rewards: 4 / 6


def test_reinforce_baseline_options_by_hand():
    fn = get_advantage_estimator("reinforce")
    torch.testing.assert_close(fn(R, 0.0), R)  # default "none": raw rewards
    torch.testing.assert_close(fn(R, 0.0, baseline="none"), R)
    m = 4 / 6
    expect = torch.tensor([[1 - m, -m, 0.5 - m], [-m, -m, 2.5 - m]])
    torch.testing.assert_close(fn(R, 0.0, baseline="batch_mean"), expect)
    # the old alias keeps meaning batch_mean, whatever baseline option is passed along
    alias = get_advantage_estimator("reinforce_baseline")
    torch.testing.assert_close(alias(R, 0.0), expect)
    torch.testing.assert_close(alias(R, 0.0, baseline="none"), expect)
    assert REINFORCE_BASELINES == ("none", "batch_mean")


def test_reinforce_unknown_baseline_lists_valid():
    with pytest.raises(ValueError, match="valid: batch_mean, none"):
        reinforce_advantages(R, baseline="group_mean")
    with pytest.raises(ValueError, match="batch_mean"):
        get_advantage_estimator("reinforce")(R, 0.0, baseline="ema")


def test_every_estimator_accepts_and_ignores_irrelevant_options():
    outcome = [e for e in map(ADVANTAGE_ESTIMATORS.entry, ADVANTAGE_ESTIMATORS) if e.level == "outcome"]
    assert len(outcome) == 5
    for name, fn in ((e.name, e.fn) for e in outcome):
        plain = fn(R, 1e-6)
        torch.testing.assert_close(fn(R, 1e-6, some_future_option=3), plain)
        if name != "reinforce":
            torch.testing.assert_close(fn(R, 1e-6, baseline="batch_mean"), plain)


@pytest.mark.parametrize("length,expect", [
    (0, 0.0), (10, 0.0), (16, 0.0),   # L <= max_len - buffer = 16: no penalty
    (17, -0.25), (18, -0.5),          # (16 - L) / 4
    (20, -1.0),                       # L = max_len: the whole penalty
    (21, -1.0), (50, -1.0),           # beyond max_len: -penalty
])
def test_overlong_penalty_by_hand(length, expect):
    out = overlong_penalty(torch.tensor([length]), max_len=20, buffer=4, penalty=1.0)
    assert out.item() == pytest.approx(expect)
    half = overlong_penalty(torch.tensor([float(length)]), 20, 4, penalty=0.5)
    assert half.item() == pytest.approx(expect / 2)


def test_overlong_penalty_batch_edges_and_validation():
    lengths = torch.tensor([3, 8, 9, 10, 11])
    out = overlong_penalty(lengths, max_len=10, buffer=0, penalty=2.0)  # hard cliff
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, 0.0, 0.0, -2.0]))
    full = overlong_penalty(lengths, max_len=10, buffer=10, penalty=1.0)  # ramp from 0
    torch.testing.assert_close(full, torch.tensor([-0.3, -0.8, -0.9, -1.0, -1.0]))
    assert overlong_penalty(torch.zeros(0), 10, 2, 1.0).shape == (0,)
    for buffer in (-1, 11):
        with pytest.raises(ValueError, match="buffer"):
            overlong_penalty(lengths, max_len=10, buffer=buffer, penalty=1.0)


def test_zero_std_groups_exact_equality():
    r = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.3, 0.3, 0.3],
                      [0.3, 0.3, 0.3000001]])  # a few float32 ulps apart
    assert zero_std_groups(r).tolist() == [True, False, True, False]
    assert zero_std_groups(torch.tensor([[5.0], [2.0]])).tolist() == [True, True]  # G = 1
    assert zero_std_groups(r.bfloat16()[:3]).dtype == torch.bool
