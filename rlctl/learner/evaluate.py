"""Held-out evaluation: greedy completions on the task's eval split, or for a task played
as episodes (``rlctl.envs.base.is_episodic``) episodes on its eval rows
(``evaluate_episodes``)."""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

from rlctl.core.logprobs import completion_mask
from rlctl.learner.samples import Row, endings, episode_columns, eval_rows, offers_tools
from rlctl.models.stop_ids import stop_ids
from rlctl.rollout.generate import decode_completions, generate
from rlctl.types import Episode, Example, RolloutBatch

# The sums evaluate_episodes gives (besides count), in the order rlctl eval prints them.
EPISODE_KEYS = ("success_rate", "exact_match", "reward", "turns_mean", "tool_calls_mean",
                "tool_errors_mean", "env_errors_mean", "truncated_frac", "length_mean")


@torch.no_grad()
def evaluate(model, tokenizer, scorer, examples: Sequence[Example], max_new_tokens: int,
             batch_size: int = 256, keep: int = 0, step: int = 0, **backend_kwargs
             ) -> Tuple[Dict[str, float], List[Row]]:
    """Greedy completions scored by ``scorer`` (a ``RewardScorer``): (SUMS over the examples,
    the eval sample table of the first ``keep`` examples at ``step``, rlctl.learner.samples).
    The caller divides the sums by ``count``, after adding up the ranks' sums: exact_match,
    reward (the training reward: with task.reward_norm/reward_clip, the reward models'
    scores normalised with the training statistics, which held-out scoring never
    updates, and clipped), length_mean, truncated_frac, and reward_raw (the same total
    from the raw scores) when normalisation or clipping applies. No exact_match for a task without a reward of its
    own (``scorer.has_gold``: a data task scored by reward models alone).
    Completions end at the first stop id of ``stop_ids(model, tokenizer)``."""
    was_training = model.training
    model.eval()
    exact, reward, raw, length, truncated = 0.0, 0.0, 0.0, 0.0, 0.0
    rows: List[Row] = []
    stops = stop_ids(model, tokenizer)
    for start in range(0, len(examples), batch_size):
        chunk = examples[start:start + batch_size]
        # greedy prompts rarely repeat; and under multi-rank ZeRO-3 every rank must run
        # the same forwards, which a data-dependent shared prefill would not guarantee
        seqs, _, plen = generate(model, tokenizer, [e.prompt for e in chunk], max_new_tokens,
                                 do_sample=False, share_prompts=False, stops=stops,
                                 **backend_kwargs)
        mask, trunc = completion_mask(seqs[:, plen:], stops)          # [n, T], [n]
        texts = decode_completions(tokenizer, seqs[:, plen:], mask, stops)
        rewards = scorer.score_batch(chunk, texts)         # user code: under the time limit
        correct = scorer.correct_batch(chunk, texts, rewards)
        exact += float(sum(correct))
        if len(rows) < keep:            # the table: only its rows are read back
            k = min(keep - len(rows), len(chunk))
            rows += eval_rows(step, [e.prompt for e in chunk[:k]], texts[:k], rewards[:k],
                              correct[:k] if scorer.has_gold else None, mask[:k],
                              endings(seqs[:k, plen:], mask[:k], trunc[:k].tolist(), tokenizer))
        reward += float(sum(rewards))
        raw += float(sum(scorer.last_raw_totals))
        length += mask.sum().item()
        truncated += trunc.float().sum().item()
    model.train(was_training)
    out = {"exact_match": exact, "reward": reward, "length_mean": length,
           "truncated_frac": truncated, "count": float(len(examples))}
    if scorer.shapes:       # reward: as trained (normalised, clipped); reward_raw: as scored
        out["reward_raw"] = raw
    if not scorer.has_gold:  # reward models alone: no gold reward, nothing is "correct"
        del out["exact_match"]
    return out, rows


def episode_success(episode: Episode, reward: float) -> bool:
    """The environment's ``success`` (the last step's info that set it), else reward > 0."""
    return bool(episode.success) if episode.success is not None else reward > 0


@torch.no_grad()
def evaluate_episodes(model, player, examples: Sequence[Example], greedy: bool = True,
                      samples: int = 1, seed: int = 0, batch_size: int = 64, keep: int = 0,
                      step: int = 0) -> Tuple[Dict[str, float], List[Row], List[int]]:
    """``samples`` episodes of each example played by ``player`` (an
    ``rlctl.rollout.episodes.EpisodePlayer``) with ``model``, greedy (the most likely
    token each time) or sampled at the player's temperature: (SUMS over the episodes, the
    eval table of the first ``keep`` episodes, each example's count of successes).

    The caller divides the sums by ``count`` (``eval/<key>``): success_rate (the
    environment's info["success"] where it reports one, else total reward > 0),
    exact_match (= success_rate, so that dashboards and comparisons made for single-turn
    tasks read the same column), reward (the episode reward by the turn-reward rule),
    turns_mean (model turns per episode), tool_calls_mean and tool_errors_mean (the
    environments' info counts per episode), env_errors_mean (steps that raised or timed
    out), truncated_frac (episodes ended by a budget) and length_mean (model tokens)."""
    was_training = model.training
    model.eval()
    sums = dict.fromkeys(EPISODE_KEYS, 0.0)
    rows: List[Row] = []
    counts: List[int] = []
    per_chunk = max(1, batch_size // samples)
    tool_task = offers_tools(player.task) if keep > 0 else False
    for start in range(0, len(examples), per_chunk):
        chunk = examples[start:start + per_chunk]
        batch = player.play(model, chunk, seed + start, greedy=greedy, group_size=samples)
        ok = _add_episodes(sums, batch)
        counts += [sum(ok[i * samples:(i + 1) * samples]) for i in range(len(chunk))]
        if len(rows) < keep:
            rows += _episode_rows(batch, ok, keep - len(rows), step, tool_task)
    model.train(was_training)
    sums["count"] = float(len(examples) * samples)
    return sums, rows, counts


def _add_episodes(sums: Dict[str, float], batch: RolloutBatch) -> List[bool]:
    rewards = batch.rewards.tolist()
    ok = [episode_success(e, r) for e, r in zip(batch.episodes, rewards)]
    for e, r, good in zip(batch.episodes, rewards, ok):
        sums["success_rate"] += good
        sums["exact_match"] += good
        sums["reward"] += r
        sums["turns_mean"] += e.turns
        sums["tool_calls_mean"] += e.tool_calls
        sums["tool_errors_mean"] += e.tool_errors
        sums["env_errors_mean"] += e.env_errors
    sums["truncated_frac"] += float(batch.truncated.sum())
    sums["length_mean"] += float(batch.mask.sum())
    return ok


def _episode_rows(batch: RolloutBatch, ok: List[bool], n: int, step: int, tool_task: bool) -> List[Row]:
    """The eval table's rows of the batch's first ``n`` episodes: the transcript as the
    completion, the episode's end as its finish_reason (its status), then the episode's
    columns turn by turn (``rlctl.learner.samples.episode_columns``)."""
    k = min(n, batch.num_sequences)
    ends = [{"finish_reason": e.status, "stop_id": None, "stop_token": None}
            for e in batch.episodes[:k]]
    rows = eval_rows(step, batch.prompts[:k], batch.completions[:k], batch.rewards[:k].tolist(),
                     ok[:k], batch.mask[:k], ends)
    for row, e in zip(rows, batch.episodes[:k]):
        row.update(episode_columns(e, tool_task))
    return rows
