"""Collecting a step's rollout, with optional dynamic sampling (DAPO).

Dynamic sampling drops groups whose G rewards are all equal (their advantages are 0:
they cost compute and carry no signal) and samples more prompts until B informative
groups are kept or ``max_rounds`` rollouts were made; the step then trains on what was
kept (possibly fewer than B groups, never an empty batch if any group was kept).
"""
from __future__ import annotations

from typing import Callable, List, Tuple

import torch
import torch.nn.functional as F

from rlctl.core import zero_std_groups
from rlctl.types import RolloutBatch


def concat_batches(batches: List[RolloutBatch], pad_id: int) -> RolloutBatch:
    """Stack rollouts: prompts left-padded to the longest P, completions right-padded to
    the longest T (padding has mask 0 and attention 0)."""
    if len(batches) == 1:
        return batches[0]
    P = max(b.prompt_len for b in batches)
    T = max(b.mask.shape[1] for b in batches)

    def pad(b: RolloutBatch, x: torch.Tensor, value, prompt_part: bool = True) -> torch.Tensor:
        left = P - b.prompt_len if prompt_part else 0
        right = T - b.mask.shape[1]
        return F.pad(x, (left, right), value=value)

    def cat_opt(name: str):
        parts = [getattr(b, name) for b in batches]
        if any(p is None for p in parts):
            return None
        return torch.cat([pad(b, p, 0.0, prompt_part=False) for b, p in zip(batches, parts)])

    old, behaviour = _cat_behaviour(batches, T)

    offsets = torch.cumsum(torch.tensor([0] + [int(b.group_ids.max()) + 1 for b in batches[:-1]]), 0)
    return RolloutBatch(
        input_ids=torch.cat([pad(b, b.input_ids, pad_id) for b in batches]),
        attention_mask=torch.cat([pad(b, b.attention_mask, 0) for b in batches]),
        mask=torch.cat([pad(b, b.mask, 0.0, prompt_part=False) for b in batches]),
        truncated=torch.cat([b.truncated for b in batches]),
        rewards=torch.cat([b.rewards for b in batches]),
        group_ids=torch.cat([b.group_ids + int(o) for b, o in zip(batches, offsets)]),
        prompt_len=P, group_size=batches[0].group_size,
        prompts=[p for b in batches for p in b.prompts],
        completions=[c for b in batches for c in b.completions],
        old_logprobs=old, ref_logprobs=cat_opt("ref_logprobs"),
        advantages=cat_opt("advantages"), old_values=cat_opt("old_values"),
        returns=cat_opt("returns"), behaviour_rows=behaviour)


def _cat_behaviour(batches: List[RolloutBatch], T: int):
    """(old_logprobs [N, T] or None, behaviour_rows [N] bool or None) of the stacked
    batches. When only some batches carry old log-probs (stale async rollouts next to
    on-policy ones), theirs are kept exactly, the others' rows are 0-filled placeholders
    and ``behaviour_rows`` marks which rows hold real values (the learner fills the rest)."""
    have = [b.old_logprobs is not None for b in batches]
    if not any(have):
        return None, None
    olds, rows = [], []
    for b in batches:
        n, t = b.mask.shape
        old = b.old_logprobs if b.old_logprobs is not None else b.mask.new_zeros(n, t)   # [n, t]
        olds.append(F.pad(old, (0, T - t)))                                              # [n, T]
        kept = b.behaviour_rows if b.behaviour_rows is not None else \
            torch.full((n,), b.old_logprobs is not None, dtype=torch.bool, device=b.mask.device)
        rows.append(kept)                                                                # [n]
    behaviour = torch.cat(rows)                                                          # [N]
    return torch.cat(olds), (None if bool(behaviour.all()) else behaviour)


def keep_informative_groups(batch: RolloutBatch) -> RolloutBatch:
    """Rows of the groups whose rewards are not all equal."""
    keep = ~zero_std_groups(batch.rewards.view(-1, batch.group_size))        # [B]
    rows = keep.repeat_interleave(batch.group_size).nonzero().squeeze(-1)  # [N_kept]
    out = batch.select(rows)
    # renumber groups 0..kept-1 so rows of group g stay at g*G .. g*G+G-1
    out.group_ids = torch.arange(int(keep.sum()), device=rows.device).repeat_interleave(batch.group_size)
    return out


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
    out = concat_batches(kept, pad_id)
    out.group_ids = torch.arange(have, device=out.mask.device).repeat_interleave(out.group_size)
    return out, have / sampled
