"""Turn rewards of multi-turn episodes (docs/math.md, section 13): turn k's reward r_k weighted
by the rule (last, sum, discounted: w_k = discount ** (k - 1)); R = sum_k w_k r_k, w_k r_k on
the last token of turn k (``turn_ends[i]``, strictly increasing, < T). Sums in float64."""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

TURN_REWARD_RULES = ("last", "sum", "discounted")


def turn_weights(num_turns: int, rule: str, discount: float = 1.0) -> List[float]:
    """The weight w_k of each of ``num_turns`` turns under ``rule``. ValueError for an unknown
    rule, a negative count or a discount outside [0, 1]."""
    if rule not in TURN_REWARD_RULES:
        raise ValueError(f"unknown turn-reward rule {rule!r}; valid: {', '.join(TURN_REWARD_RULES)}")
    if num_turns < 0:
        raise ValueError(f"num_turns must be >= 0, got {num_turns}")
    if not 0.0 <= discount <= 1.0:
        raise ValueError(f"turn discount must be in [0, 1], got {discount}")
    if rule == "last":
        return [0.0] * (num_turns - 1) + [1.0] if num_turns else []
    if rule == "sum":
        return [1.0] * num_turns
    return [float(discount) ** k for k in range(num_turns)]      # k = turn index - 1


def place_turn_rewards(turn_rewards: Sequence[Sequence[float]], turn_ends: Sequence[Sequence[int]],
                       T: int, rule: str, discount: float = 1.0,
                       dtype: torch.dtype = torch.float32,
                       device: Optional[torch.device] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(episode rewards [N], token_rewards [N, T]): w_k r_k of row i on column
    ``turn_ends[i][k]``. ValueError naming the row for mismatched or misordered ends."""
    if len(turn_rewards) != len(turn_ends):
        raise ValueError(f"turn_rewards has {len(turn_rewards)} rows but turn_ends has {len(turn_ends)}")
    token = torch.zeros(len(turn_rewards), T, dtype=torch.float64)    # [N, T]
    totals = torch.zeros(len(turn_rewards), dtype=torch.float64)     # [N]
    for i, (rewards, ends) in enumerate(zip(turn_rewards, turn_ends)):
        _check_row(i, rewards, ends, T)
        for w, r, end in zip(turn_weights(len(rewards), rule, discount), rewards, ends):
            token[i, end] = w * float(r)
        totals[i] = token[i].sum()
    return totals.to(dtype=dtype, device=device), token.to(dtype=dtype, device=device)


def _check_row(i: int, rewards: Sequence[float], ends: Sequence[int], T: int) -> None:
    if len(rewards) != len(ends):
        raise ValueError(f"row {i}: {len(rewards)} turn rewards but {len(ends)} turn ends")
    previous = -1
    for end in ends:
        if not previous < end < T:
            raise ValueError(f"row {i}: turn end column {end} must be in ({previous}, {T}) "
                             f"(after the previous turn's end, inside the completion)")
        previous = end
