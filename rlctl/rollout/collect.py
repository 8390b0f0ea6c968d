"""Collecting a step's rollout, with optional dynamic sampling (DAPO).

Dynamic sampling drops groups whose G rewards are all equal (their advantages are 0:
they cost compute and carry no signal) and samples more prompts until B informative
groups are kept or ``max_rounds`` rollouts were made; the step then trains on what was
kept (possibly fewer than B groups, never an empty batch if any group was kept).
"""
from __future__ import annotations

from typing import Callable, List, Tuple

import torch

from rlctl.core import zero_std_groups
from rlctl.types import RolloutBatch


def keep_informative_groups(batch: RolloutBatch) -> RolloutBatch:
    """Rows of the groups whose rewards are not all equal."""
    keep = ~zero_std_groups(batch.rewards.view(-1, batch.group_size))        # [B]
    rows = keep.repeat_interleave(batch.group_size).nonzero().squeeze(-1)  # [N_kept]
    # renumber groups 0..kept-1 so rows of group g stay at g*G .. g*G+G-1
    return batch.select(rows).replace(group_ids=_group_ids(int(keep.sum()), batch.group_size, rows.device))


def _group_ids(num_groups: int, G: int, device) -> torch.Tensor:
    return torch.arange(num_groups, device=device).repeat_interleave(G)        # [B*G]


def collect(sample: Callable[[int], RolloutBatch], num_groups: int, dynamic: bool,
            max_rounds: int, pad_id: int) -> Tuple[RolloutBatch, float]:
    """One step's batch and the fraction of sampled groups kept (1.0 without filtering)."""
    if not dynamic:
        return sample(num_groups), 1.0
    kept: List[RolloutBatch] = []
    have, sampled = 0, 0
    for _ in range(max_rounds):
        batch = sample(num_groups)
        sampled += num_groups
        good = keep_informative_groups(batch)
        n_good = good.num_sequences // batch.group_size
        if n_good:
            take = min(n_good, num_groups - have)
            kept.append(good.select(torch.arange(take * batch.group_size, device=good.mask.device)))
            have += take
        if have >= num_groups:
            break
    if not kept:              # every group constant: train on the last batch (zero advantages)
        return batch, 0.0
    # one batch kept: no re-padding copy; several: stale and fresh old log-probs kept as a pair
    out = kept[0] if len(kept) == 1 else RolloutBatch.concat(kept, pad_id)
    return out.replace(group_ids=_group_ids(have, out.group_size, out.mask.device)), have / sampled
