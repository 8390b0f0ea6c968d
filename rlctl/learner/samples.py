"""Sample tables: a few rows of a step's rollout, and of a held-out eval, for the sinks.

Every ``logger.samples.every`` steps (and at the last step, as metrics are logged) the
Trainer hands ``sink.samples(rows, step, "train")`` ``logger.samples.n`` rows of the
step's batch, drawn so that a group's spread shows: ceil(n / G) whole groups picked by
an RNG of their own, ``random.Random`` seeded with (seed, step), then the first n rows
of those groups (in group order). That RNG is made for the draw and dropped: the
training's streams (torch's, the prompt sampler's) are never touched, so a run's
metrics are the same with samples on or off. Only the chosen rows are read back from
the device and decoded. With several ranks, rank 0 draws from its own share of the step's
groups (the other ranks' sinks log nothing).

The columns of a train row, in order:
    step            the learner step (as in the metric logs)
    group           the row's prompt group within the step's batch (0 .. B-1)
    prompt          the text the model was given (the task's prompt, chat template applied)
    completion      the counted tokens decoded, the closing stop id left out
    reward/<name>   each named reward as the scorer gave it (the step's reward/<name>)
    reward          the total the advantage estimator received (the scorer's total, with
                    DAPO's overlong penalty when algo.overlong_buffer is set; KL shaping,
                    when in the reward, is per token and not in it)
    advantage       the row's advantage: for token-level estimators (GAE) the mean over its
                    counted tokens; outcome estimators give every token the same value
    length          counted completion tokens (the closing stop id included)
    finish_reason   "stop" (a stop id ended it) or "length" (rollout.max_new_tokens reached)
    stop_id         the id that ended it (null at the length cap)
    stop_token      that id's token in the vocabulary's spelling (as rollout.stop_token_ids
                    takes it), null at the length cap
    policy_version  learner updates in the weights that sampled the row (0: the initial
                    weights): step - 1 in the synchronous loop; step - 1 - staleness with
                    asynchronous actors (the async/staleness metric is its step maximum)

An eval row (``table="eval"``, at every held-out eval while samples are on: rank 0's first n
examples of the eval split, the same prompts each time): step, prompt, completion,
reward, exact_match (absent for a task scored by reward models alone), length,
finish_reason, stop_id, stop_token, policy_version (the step: eval follows its update).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch

from rlctl.core import counted_width
from rlctl.models.stop_ids import decode_completions
from rlctl.types import RolloutBatch

Row = Dict[str, Any]


@dataclass(frozen=True)
class SampleSettings:
    """``logger.samples`` as the loop reads it, and the run's seed for the draw."""
    every: int        # logger.samples.every: steps between tables (0: none)
    n: int            # logger.samples.n: rows per table
    seed: int         # seed: the draw's RNG is seeded with (seed, step)

    @property
    def on(self) -> bool:
        return self.every > 0 and self.n > 0

    def due(self, step: int, last: int) -> bool:
        """A table at this step: every ``every`` steps, and at the last one."""
        return self.on and (step % self.every == 0 or step == last)


def draw_rows(num_rows: int, group_size: int, n: int, seed: int, step: int) -> List[int]:
    """Row indices of a step's table: ceil(n / G) whole groups (of the num_rows // G in
    the batch, rows g*G .. g*G+G-1) chosen by ``random.Random`` seeded with (seed, step),
    taken in group order, then the first n of their rows (all rows when fewer)."""
    groups = num_rows // group_size
    k = min(math.ceil(n / group_size), groups)
    chosen = sorted(random.Random(f"rlctl-samples:{seed}:{step}").sample(range(groups), k))
    return [g * group_size + j for g in chosen for j in range(group_size)][:n]


def endings(completion_ids: torch.Tensor, mask: torch.Tensor, truncated: Sequence[bool],
            tokenizer) -> List[Row]:
    """finish_reason, stop_id and stop_token of each row (``completion_ids`` [n, T],
    ``mask`` [n, T], ``truncated`` [n]). The stop id is the last counted token, at the
    row's width - 1 (a multi-turn row's mask has gaps: its sum is not that column)."""
    widths = counted_width(mask).tolist()
    ids = completion_ids.tolist()
    out = []
    for row, n, cut in zip(ids, widths, truncated):
        stop = None if cut or n == 0 else int(row[n - 1])
        out.append({"finish_reason": "length" if stop is None else "stop", "stop_id": stop,
                    "stop_token": None if stop is None else tokenizer.convert_ids_to_tokens(stop)})
    return out


def sequence_advantages(advantages: torch.Tensor, mask: torch.Tensor) -> List[float]:
    """Each row's advantage (``advantages`` [n, T] or [n, 1], ``mask`` [n, T]): the mean
    over its counted tokens, in float64 (exact for a row holding one value)."""
    m = mask.double()
    total = (advantages.double().expand_as(m) * m).sum(-1)
    return (total / m.sum(-1).clamp(min=1)).tolist()


def train_rows(batch: RolloutBatch, rows: List[int], step: int, rewards: torch.Tensor,
               tokenizer, stops: Sequence[int]) -> List[Row]:
    """The table of ``rows`` of ``batch`` (after advantages); ``rewards`` [N]: the totals
    the advantage estimator received. Reads back and decodes only those rows."""
    idx = torch.tensor(rows, dtype=torch.long, device=batch.mask.device)
    mask, ids = batch.mask[idx], batch.completion_ids[idx]                   # [n, T] each
    texts = decode_completions(tokenizer, ids, mask, stops)
    ends = endings(ids, mask, batch.truncated[idx].tolist(), tokenizer)
    advantages = sequence_advantages(batch.advantages[idx], mask) \
        if batch.advantages is not None else [None] * len(rows)
    stale = batch.staleness[idx].tolist() if batch.staleness is not None else [0] * len(rows)
    parts = batch.reward_parts or {}
    out = []
    for j, (i, groups, reward, length) in enumerate(zip(
            rows, batch.group_ids[idx].tolist(), rewards[idx].tolist(),
            mask.sum(-1).long().tolist())):
        row: Row = {"step": step, "group": groups, "prompt": batch.prompts[i],
                    "completion": texts[j]}
        row.update({f"reward/{k}": float(parts[k][i]) for k in sorted(parts)})
        row.update({"reward": reward, "advantage": advantages[j], "length": length, **ends[j],
                    "policy_version": step - 1 - int(stale[j])})
        out.append(row)
    return out


def eval_rows(step: int, prompts: Sequence[str], texts: Sequence[str], rewards: Sequence[float],
              correct: Optional[Sequence[bool]], mask: torch.Tensor, ends: Sequence[Row]) -> List[Row]:
    """The eval table's rows (``correct`` None: no exact_match column); ``mask`` [n, T]."""
    out = []
    for j, length in enumerate(mask.sum(-1).long().tolist()):
        row: Row = {"step": step, "prompt": prompts[j], "completion": texts[j],
                    "reward": float(rewards[j])}
        if correct is not None:
            row["exact_match"] = float(correct[j])
        row.update({"length": length, **ends[j], "policy_version": step})
        out.append(row)
    return out
