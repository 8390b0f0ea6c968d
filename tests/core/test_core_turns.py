"""Turn-reward rules of multi-turn episodes (rlctl.core.turns) against hand-computed values,
and counted_width (the column a row's counted tokens reach)."""
import pytest
import torch

from rlctl.core import counted_width, place_turn_rewards, turn_weights

F64 = torch.float64

# Two episodes in a T = 10 completion:
#   row 0: three model turns ending at columns 2, 5, 8 with turn rewards 0.5, -1.0, 2.0
#   row 1: one model turn ending at column 3 with reward 1.5
REWARDS = [[0.5, -1.0, 2.0], [1.5]]
ENDS = [[2, 5, 8], [3]]


def test_turn_weights_by_hand():
    assert turn_weights(3, "last") == [0.0, 0.0, 1.0]
    assert turn_weights(1, "last") == [1.0]
    assert turn_weights(0, "last") == []
    assert turn_weights(3, "sum") == [1.0, 1.0, 1.0]
    assert turn_weights(4, "discounted", 0.5) == [1.0, 0.5, 0.25, 0.125]   # 0.5 ** (k - 1)
    assert turn_weights(3, "discounted", 1.0) == [1.0, 1.0, 1.0]           # = sum
    assert turn_weights(3, "discounted", 0.0) == [1.0, 0.0, 0.0]           # 0 ** 0 = 1


@pytest.mark.parametrize("rule,discount,row0,total0", [
    # last: only turn 3 counts: R = 2.0 at column 8
    ("last", 1.0, {8: 2.0}, 2.0),
    # sum: 0.5 + (-1.0) + 2.0 = 1.5
    ("sum", 1.0, {2: 0.5, 5: -1.0, 8: 2.0}, 1.5),
    # discounted, gamma 0.5: 1 * 0.5 + 0.5 * (-1.0) + 0.25 * 2.0 = 0.5 - 0.5 + 0.5 = 0.5
    ("discounted", 0.5, {2: 0.5, 5: -0.5, 8: 0.5}, 0.5),
    # discounted, gamma 0.9: 0.5 + 0.9 * (-1.0) + 0.81 * 2.0 = 0.5 - 0.9 + 1.62 = 1.22
    ("discounted", 0.9, {2: 0.5, 5: -0.9, 8: 1.62}, 1.22),
])
def test_place_turn_rewards_by_hand(rule, discount, row0, total0):
    rewards, token = place_turn_rewards(REWARDS, ENDS, 10, rule, discount, dtype=F64)
    want = torch.zeros(2, 10, dtype=F64)
    for col, v in row0.items():
        want[0, col] = v
    want[1, 3] = 1.5                         # a one-turn episode: w_1 = 1 under every rule
    torch.testing.assert_close(token, want, rtol=0, atol=1e-15)
    torch.testing.assert_close(rewards, torch.tensor([total0, 1.5], dtype=F64), rtol=0, atol=1e-15)
    torch.testing.assert_close(token.sum(-1), rewards, rtol=0, atol=0)    # rows sum to R
    assert token.dtype == rewards.dtype == F64


def test_no_model_turn_is_zero_and_dtype_default_is_float32():
    rewards, token = place_turn_rewards([[], [3.0]], [[], [0]], 4, "sum")
    assert rewards.tolist() == [0.0, 3.0] and token.dtype == torch.float32
    assert token.tolist() == [[0.0] * 4, [3.0, 0.0, 0.0, 0.0]]


@pytest.mark.parametrize("args,named", [
    (([[1.0]], [[0]], 4, "mean"), "unknown turn-reward rule 'mean'; valid: last, sum, discounted"),
    (([[1.0]], [[0]], 4, "discounted", 1.5), "turn discount must be in [0, 1], got 1.5"),
    (([[1.0, 2.0]], [[0]], 4, "sum"), "row 0: 2 turn rewards but 1 turn ends"),
    (([[1.0]], [[4]], 4, "sum"), "row 0: turn end column 4 must be in (-1, 4)"),
    (([[1.0, 1.0]], [[2, 2]], 4, "sum"), "row 0: turn end column 2 must be in (2, 4)"),
    (([[1.0]], [[0], [1]], 4, "sum"), "turn_rewards has 1 rows but turn_ends has 2"),
])
def test_bad_input_is_one_clear_error(args, named):
    with pytest.raises(ValueError) as e:
        place_turn_rewards(*args)
    assert named in str(e.value)


def test_counted_width_is_the_last_counted_column_plus_one():
    mask = torch.tensor([[1, 1, 1, 0, 0, 0],     # single-turn: width 3 = mask.sum
                         [1, 1, 0, 0, 1, 0],     # a gap (an observation) at 2..3: width 5, sum 3
                         [0, 0, 0, 0, 0, 0],     # nothing counted: 0
                         [0, 0, 0, 0, 0, 1]], dtype=torch.float32)
    assert counted_width(mask).tolist() == [3, 5, 0, 6]
    assert counted_width(torch.zeros(2, 0)).tolist() == [0, 0]
