"""The rollout correction's weights and mismatch metrics (rlctl.core.rollout_correction)
against values worked by hand, in float64.

The batch: row 0 has three counted tokens and one padded, row 1 two counted tokens.
    old    row 0: [-1.0, -2.0, -0.5,  0.0]   row 1: [-0.2, -0.3, 0, 0]
    engine row 0: [-1.5, -1.0, -0.5, -3.0]   row 1: [-0.4, -0.6, 0, 0]
so log w = old - engine on counted tokens:
    row 0: [0.5, -1.0, 0.0]  ->  w = [e^0.5, e^-1, 1] = [1.6487212707, 0.3678794412, 1.0]
    row 1: [0.2,  0.3]       ->  w = [e^0.2, e^0.3]
and per sequence: log W_0 = 0.5 - 1.0 + 0.0 = -0.5, W_0 = e^-0.5 = 0.6065306597;
                  log W_1 = 0.2 + 0.3 = 0.5,        W_1 = e^0.5 = 1.6487212707.
"""
import math

import pytest
import torch

from rlctl.core.rollout_correction import (correction_weights, log_importance_weights,
                                           mismatch_metrics)

F64 = torch.float64
E_HALF, E_MINUS_1, E_MINUS_HALF = 1.6487212707001282, 0.36787944117144233, 0.6065306597126334
E_02, E_03 = 1.2214027581601699, 1.3498588075760032          # e^0.2, e^0.3


def _close(actual, expected):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=F64), atol=1e-15, rtol=0)


def _two_rows():
    old = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-0.2, -0.3, 0.0, 0.0]], dtype=F64)
    engine = torch.tensor([[-1.5, -1.0, -0.5, -3.0], [-0.4, -0.6, 0.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]], dtype=F64)
    return old, engine, mask


def _row0():
    old, engine, mask = _two_rows()
    return old[:1], engine[:1], mask[:1]


def test_token_level_log_weights_and_the_padded_position():
    old, engine, mask = _two_rows()
    lw = log_importance_weights(old, engine, mask, "token")
    # the padded column (old 0, engine -3) would give 3.0; it is 0 off the mask
    _close(lw, [[0.5, -1.0, 0.0, 0.0], [0.2, 0.3, 0.0, 0.0]])


def test_truncate_token_level_by_hand():
    """min(w, 1.5): [min(1.6487, 1.5), min(0.3679, 1.5), min(1, 1.5)] = [1.5, 0.3679, 1.0];
    row 1: e^0.2 = 1.2214 and e^0.3 = 1.3499 are both under the cap."""
    w = correction_weights(*_two_rows(), "token", "truncate", upper=1.5)
    _close(w, [[1.5, E_MINUS_1, 1.0, 0.0], [E_02, E_03, 0.0, 0.0]])


def test_mask_token_level_by_hand():
    """Keep w in [0.5, 2.0]: 1.6487 kept, 0.3679 < 0.5 -> 0, 1.0 kept; row 1 kept."""
    w = correction_weights(*_two_rows(), "token", "mask", upper=2.0, lower=0.5)
    _close(w, [[E_HALF, 0.0, 1.0, 0.0], [E_02, E_03, 0.0, 0.0]])


def test_truncate_sequence_level_by_hand():
    """W_0 = e^-0.5 = 0.6065 < 1.5 stays; W_1 = e^0.5 = 1.6487 > 1.5 is cut to 1.5; the same
    value on every counted token of the row."""
    w = correction_weights(*_two_rows(), "sequence", "truncate", upper=1.5)
    _close(w, [[E_MINUS_HALF] * 3 + [0.0], [1.5, 1.5, 0.0, 0.0]])


def test_mask_sequence_level_drops_the_whole_row():
    """[0.7, 2.0]: W_0 = 0.6065 < 0.7, so all of row 0 gets 0; W_1 = 1.6487 is kept."""
    w = correction_weights(*_two_rows(), "sequence", "mask", upper=2.0, lower=0.7)
    _close(w, [[0.0] * 4, [E_HALF, E_HALF, 0.0, 0.0]])


def test_measure_mode_weighs_every_counted_token_one():
    w = correction_weights(*_two_rows(), "token", "measure", upper=2.0)
    assert torch.equal(w, _two_rows()[2])


def test_a_huge_sequence_weight_is_capped_without_overflow():
    """400 tokens of log w = 2 each: log W = 800, e^800 overflows float64 (max ~e^709.8);
    truncation caps it at 2.0 in log space, and mask mode drops the row."""
    old, engine, mask = torch.zeros(1, 400, dtype=F64), torch.full((1, 400), -2.0, dtype=F64), \
        torch.ones(1, 400, dtype=F64)
    assert torch.equal(correction_weights(old, engine, mask, "sequence", "truncate", 2.0),
                       torch.full((1, 400), 2.0, dtype=F64))
    assert correction_weights(old, engine, mask, "sequence", "mask", 2.0, 0.5).abs().sum() == 0


def test_metrics_token_level_by_hand():
    """Row 0 only (3 counted tokens, log w = [0.5, -1, 0]).
    k3 = mean(e^d - 1 - d) = ((1.6487213 - 1 - 0.5) + (0.3678794 - 1 + 1) + 0) / 3
       = (0.1487213 + 0.3678794) / 3 = 0.5166007 / 3 = 0.1722002.
    ppl: engine's -log p = [1.5, 1.0, 0.5], mean 1.0, exp 2.7182818; learner's [1, 2, 0.5],
       mean 3.5/3 = 1.1666667, exp 3.2112705; gap 2.7182818 - 3.2112705 = -0.4929887.
    ess: sum w = 1.6487213 + 0.3678794 + 1 = 3.0166007, squared 9.0998798;
       sum w^2 = e^1 + e^-2 + 1 = 2.7182818 + 0.1353353 + 1 = 3.8536171, times n = 3:
       11.5608513; ess = 9.0998798 / 11.5608513 = 0.7871289.
    mean |log w| = (0.5 + 1 + 0) / 3 = 0.5; truncated at 1.5: only 1.6487 -> 1/3;
    applied weights [1.5, 0.3679, 1] -> mean 2.8678794 / 3 = 0.9559598."""
    m = mismatch_metrics(*_row0(), "token", "truncate", upper=1.5)
    assert float(m["k3"]) == pytest.approx(0.1722002373, abs=1e-9)
    assert float(m["ppl_gap"]) == pytest.approx(-0.4929887147, abs=1e-9)
    assert float(m["ess"]) == pytest.approx(0.7871288706, abs=1e-9)
    assert float(m["log_w_abs_mean"]) == pytest.approx(0.5, abs=1e-15)
    assert float(m["truncated_frac"]) == pytest.approx(1 / 3, abs=1e-15)
    assert float(m["weight_mean"]) == pytest.approx(0.9559598137, abs=1e-9)
    masked = mismatch_metrics(*_row0(), "token", "mask", upper=2.0, lower=0.5)
    assert float(masked["masked_frac"]) == pytest.approx(1 / 3, abs=1e-15)   # 0.3679 < 0.5
    assert "truncated_frac" not in masked


def test_metrics_sequence_level_by_hand():
    """Two rows, W = [e^-0.5, e^0.5]: ess = (2 cosh 0.5)^2 / (2 * 2 cosh 1)
    = cosh^2(0.5) / cosh 1 = (1 + cosh 1) / (2 cosh 1) = 0.5 + 1 / (2 * 1.5430806)
    = 0.5 + 0.3240271 = 0.8240271; mean |log W| = (0.5 + 0.5) / 2 = 0.5; at cap 1.5 one of
    two rows is cut: 0.5. k3 and ppl stay per token over all 5 counted tokens."""
    m = mismatch_metrics(*_two_rows(), "sequence", "truncate", upper=1.5)
    assert float(m["ess"]) == pytest.approx(0.8240271368, abs=1e-9)
    assert float(m["log_w_abs_mean"]) == pytest.approx(0.5, abs=1e-15)
    assert float(m["truncated_frac"]) == pytest.approx(0.5, abs=1e-15)
    # k3 over 5 tokens: row 0's 0.5166007 + (e^0.2 - 1.2) + (e^0.3 - 1.3)
    #   = 0.5166007 + 0.0214028 + 0.0498588 = 0.5878623; / 5 = 0.1175725 (0.11757245552)
    assert float(m["k3"]) == pytest.approx(0.1175724555, abs=1e-9)


def test_equal_policies_give_no_mismatch():
    """old == engine: w = 1 everywhere, k3 0, ppl gap 0, ess 1, nothing truncated."""
    old, _, mask = _two_rows()
    m = mismatch_metrics(old, old.clone(), mask, "token", "truncate", upper=2.0)
    assert float(m["k3"]) == 0 and float(m["ppl_gap"]) == 0 and float(m["truncated_frac"]) == 0
    assert float(m["ess"]) == pytest.approx(1.0, abs=1e-15)
    assert torch.equal(correction_weights(old, old.clone(), mask, "sequence", "truncate", 2.0), mask)


def test_empty_mask_gives_zeros_not_nan():
    old, engine, mask = _two_rows()
    m = mismatch_metrics(old, engine, torch.zeros_like(mask), "sequence", "mask", 2.0, 0.5)
    assert all(math.isfinite(float(v)) for v in m.values())
    assert float(m["ess"]) == 1.0 and float(m["masked_frac"]) == 0.0


def test_unknown_level_and_mode_are_named():
    with pytest.raises(ValueError, match="level must be one of"):
        correction_weights(*_two_rows(), "episode", "truncate", 2.0)
    with pytest.raises(ValueError, match="mode must be one of"):
        correction_weights(*_two_rows(), "token", "clip", 2.0)
