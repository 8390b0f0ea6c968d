"""Sample tables: a few rows of a step's rollout, and of a held-out eval, for the sinks.

The draw, the train and eval columns and their meanings: docs/metrics.md, "Sample
tables". The draw's RNG (``random.Random`` seeded with (seed, step)) is its own, so
metrics are the same with samples on or off; only the chosen rows are read back; with
several ranks rank 0 draws from its own share.

A row of a task played as episodes: completion is the whole transcript decoded with its
special tokens, length the model's own tokens, finish_reason the episode's status (done,
turn_limit, token_limit, length_limit), then ``episode_columns``: num_turns, status,
success (null if never set), tool_calls, tool_errors, env_errors, obs_truncated,
tool_task (``offers_tools``) and turns, a list of {role ("model" | "observation"), text,
reward (0 on observations), truncated}."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch

from rlctl.core import counted_width
from rlctl.envs.base import close_env
from rlctl.models.stop_ids import decode_completions
from rlctl.types import Episode, RolloutBatch

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
    """Row indices of a step's table: ceil(n / G) whole groups chosen by ``random.Random``
    seeded with (seed, step), in group order, then the first n of their rows."""
    groups = num_rows // group_size
    k = min(math.ceil(n / group_size), groups)
    chosen = sorted(random.Random(f"rlctl-samples:{seed}:{step}").sample(range(groups), k))
    return [g * group_size + j for g in chosen for j in range(group_size)][:n]


def endings(completion_ids: torch.Tensor, mask: torch.Tensor, truncated: Sequence[bool],
            tokenizer) -> List[Row]:
    """finish_reason, stop_id and stop_token of each row (``completion_ids`` [n, T], ``mask``
    [n, T], ``truncated`` [n]); the stop id is at the row's width - 1."""
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
               tokenizer, stops: Sequence[int], tool_task: bool = False) -> List[Row]:
    """The table of ``rows`` of ``batch`` (after advantages); ``rewards`` [N]: the totals the
    advantage estimator received. Reads back and decodes only those rows."""
    idx = torch.tensor(rows, dtype=torch.long, device=batch.mask.device)
    mask, ids = batch.mask[idx], batch.completion_ids[idx]                   # [n, T] each
    ends = endings(ids, mask, batch.truncated[idx].tolist(), tokenizer)
    if batch.episodes is None:
        texts = decode_completions(tokenizer, ids, mask, stops)
    else:                  # the transcript: a multi-turn row's mask has gaps
        texts = [batch.completions[i] for i in rows]
        for end, i in zip(ends, rows):
            end["finish_reason"] = batch.episodes[i].status
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
        if batch.episodes is not None:
            row.update(episode_columns(batch.episodes[i], tool_task))
        out.append(row)
    return out


def offers_tools(task) -> bool:
    """Whether a task played as episodes gives its model tools (a fresh environment's non-empty
    ``tools`` and ``use_tools`` not False). False for other tasks."""
    make_env = getattr(task, "make_env", None)
    if not callable(make_env):
        return False
    env = make_env()
    try:
        return bool(getattr(env, "tools", None)) and getattr(env, "use_tools", True) is not False
    finally:
        close_env(env)            # a close() that raises is logged, not fatal (as in the loop)


def turn_rows(episode: Episode) -> List[Row]:
    """The episode turn by turn (the module docstring's ``turns``)."""
    return [{"role": s.role, "text": s.text, "reward": float(s.reward), "truncated": bool(s.truncated)}
            for s in episode.spans]


def episode_columns(episode: Episode, tool_task: bool) -> Row:
    """The episode's columns of a sample row (the module docstring), in their order."""
    return {"num_turns": episode.turns, "status": episode.status, "success": episode.success,
            "tool_calls": int(episode.tool_calls), "tool_errors": int(episode.tool_errors),
            "env_errors": int(episode.env_errors),
            "obs_truncated": sum(bool(s.truncated) for s in episode.spans),
            "tool_task": bool(tool_task), "turns": turn_rows(episode)}


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
