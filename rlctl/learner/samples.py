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
                    asynchronous engines (the async/staleness metric is its step maximum)

An eval row (``table="eval"``, at every held-out eval while samples are on: rank 0's first n
examples of the eval split, the same prompts each time): step, prompt, completion,
reward, exact_match (absent for a task scored by reward models alone), length,
finish_reason, stop_id, stop_token, policy_version (the step: eval follows its update).

A row of a task played as episodes (``batch.episodes`` set; train and eval tables alike):
completion is the whole transcript decoded with its special tokens (model turns and
observations, as the model saw them), length the model's own tokens, finish_reason the
episode's status (done, turn_limit, token_limit, length_limit), and after
policy_version (``episode_columns``):
    num_turns       model turns
    status          how the episode ended (= finish_reason)
    success         the environment's info["success"] (null when it never set one)
    tool_calls, tool_errors, env_errors   the episode's counts
    obs_truncated   observations cut to rollout.episode.max_obs_tokens
    tool_task       the task's environment offers tools (``offers_tools``)
    turns           the episode turn by turn: a list of {role ("model" | "observation"),
                    text (a model turn without its stop id; an observation as the
                    environment wrote it), reward (the turn's; 0 on observations),
                    truncated}; sinks that show one line per cell write it as
                    ``rlctl.sinks.base.cell_text`` does
"""
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
               tokenizer, stops: Sequence[int], tool_task: bool = False) -> List[Row]:
    """The table of ``rows`` of ``batch`` (after advantages); ``rewards`` [N]: the totals
    the advantage estimator received. Reads back and decodes only those rows. Episodes:
    the transcript and ``episode_columns`` (``tool_task``: ``offers_tools`` of the task)."""
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
    """Whether a task played as episodes gives its model tools: a fresh environment of it
    has a non-empty ``tools`` and ``use_tools`` not False (``rlctl.envs.tool_env.ToolEnv``;
    the calculator's no-tool ablation has none). False for other tasks."""
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
