"""Held-out evaluation, the one evaluator of the Trainer's ``eval/*`` and of ``rlctl eval``:
``evaluate`` gives sums, ``means`` divides them by ``count`` after the ranks' reduction."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import torch

from rlctl.core.logprobs import completion_mask
from rlctl.envs.environment import episode_success
from rlctl.train.metrics import (Row, endings, episode_columns, episode_endings, eval_rows,
                                 user_prompts)
from rlctl.models.stop_ids import stop_ids
from rlctl.rollout.generate import decode_completions, generate
from rlctl.types import Example

BATCH = 256            # completions per generate call
EPISODE_BATCH = 64     # episodes played together
# The sums of an episode evaluation (besides count), in the order rlctl eval prints them.
EPISODE_KEYS = ("success_rate", "exact_match", "reward", "turns_mean", "tool_calls_mean",
                "tool_errors_mean", "env_errors_mean", "truncated_frac", "length_mean")
# extra(rows, texts, rewards) -> more sums of the chunk (rlctl eval's reward designs)
Extra = Callable[[List[Example], List[str], List[float]], Dict[str, float]]


@dataclass
class Evaluation:
    sums: Dict[str, float]                 # the eval/* sums and their count
    rows: List[Row] = field(default_factory=list)       # the eval sample table
    correct: List[int] = field(default_factory=list)    # per example: correct samples
    extra: Dict[str, float] = field(default_factory=dict)   # sums of ``extra``, same count


@torch.no_grad()
def evaluate(model, tokenizer, examples: Sequence[Example], *, scorer=None, player=None,
             max_new_tokens: int = 0, greedy: bool = True, samples: int = 1,
             temperature: float = 1.0, top_k: int = 0, seed: int = 0,
             batch_size: Optional[int] = None, keep: int = 0, step: int = 0,
             extra: Optional[Extra] = None, on_chunk: Optional[Callable[[int], None]] = None,
             **backend_kwargs) -> Evaluation:
    """Sums over ``samples`` completions (with ``player``: episodes) of each example, greedy or
    sampled: exact_match, reward (as trained), reward_raw, length_mean, truncated_frac (episodes:
    ``EPISODE_KEYS``); the sample table of the first ``keep`` at ``step``."""
    was_training = model.training
    model.eval()
    try:
        if player is not None:
            return _episodes(model, player, examples, greedy, samples, seed,
                             batch_size or EPISODE_BATCH, keep, step, on_chunk)
        return _completions(model, tokenizer, scorer, examples, max_new_tokens, greedy, samples,
                            temperature, top_k, batch_size or BATCH, keep, step, extra,
                            on_chunk, backend_kwargs)
    finally:
        model.train(was_training)


def means(sums: Dict[str, float], all_reduce_sum=None) -> Dict[str, float]:
    """{key: sum / count} over every rank (``all_reduce_sum``: the backend's), in float32."""
    keys = sorted(sums)
    totals = torch.tensor([float(sums[k]) for k in keys], dtype=torch.float32)
    totals = (all_reduce_sum(totals) if all_reduce_sum is not None else totals).tolist()
    n = max(totals[keys.index("count")], 1.0)
    return {k: v / n for k, v in zip(keys, totals) if k != "count"}


def _completions(model, tokenizer, scorer, examples, max_new_tokens, greedy, samples,
                 temperature, top_k, batch_size, keep, step, extra, on_chunk,
                 backend_kwargs) -> Evaluation:
    ev = Evaluation(dict.fromkeys(("exact_match", "reward", "reward_raw", "length_mean",
                                   "truncated_frac"), 0.0))
    s, stops = ev.sums, stop_ids(model, tokenizer)
    per_chunk = max(1, batch_size // samples)
    for start in range(0, len(examples), per_chunk):
        chunk = [e for e in examples[start:start + per_chunk] for _ in range(samples)]  # grouped
        # greedy prompts rarely repeat; and under multi-rank ZeRO-3 every rank must run
        # the same forwards, which a data-dependent shared prefill would not guarantee
        seqs, _, plen = generate(model, tokenizer, [e.prompt for e in chunk], max_new_tokens,
                                 do_sample=not greedy, temperature=temperature, top_k=top_k,
                                 share_prompts=not greedy, stops=stops, **backend_kwargs)
        mask, trunc = completion_mask(seqs[:, plen:], stops)          # [n, T], [n]
        texts = decode_completions(tokenizer, seqs[:, plen:], mask, stops)
        rewards = scorer.score_batch(chunk, texts)         # user code: under the time limit
        correct = scorer.correct_batch(chunk, texts, rewards)
        s["exact_match"] += float(sum(correct))
        ev.correct += [sum(correct[i:i + samples]) for i in range(0, len(chunk), samples)]
        if len(ev.rows) < keep:            # the table: only its rows are read back
            k = min(keep - len(ev.rows), len(chunk))
            ev.rows += eval_rows(step, [e.prompt for e in chunk[:k]], texts[:k], rewards[:k],
                                 correct[:k] if scorer.has_gold else None, mask[:k],
                                 endings(seqs[:k, plen:], mask[:k], trunc[:k].tolist(), tokenizer),
                                 user_prompts(chunk[:k]))
        s["reward"] += float(sum(rewards))
        s["reward_raw"] += float(sum(scorer.last_raw_totals))
        s["length_mean"] += mask.sum().item()
        s["truncated_frac"] += trunc.float().sum().item()
        for k, v in (extra(chunk, texts, rewards) if extra is not None else {}).items():
            ev.extra[k] = ev.extra.get(k, 0.0) + v
        if on_chunk is not None:
            on_chunk(len(chunk) // samples)
    s["count"] = float(len(examples) * samples)
    if not scorer.shapes:   # reward: as trained (normalised, clipped); reward_raw: as scored
        del s["reward_raw"]
    if not scorer.has_gold:  # reward models alone: no gold reward, nothing is "correct"
        del s["exact_match"]
    return ev


def _episodes(model, player, examples, greedy, samples, seed, batch_size, keep, step,
              on_chunk) -> Evaluation:
    """``EPISODE_KEYS`` sums; table rows: the transcript, status as finish_reason, columns."""
    ev = Evaluation(dict.fromkeys(EPISODE_KEYS, 0.0))
    sums, per_chunk = ev.sums, max(1, batch_size // samples)
    tool_task = player.tool_task if keep > 0 else False
    for start in range(0, len(examples), per_chunk):
        chunk = examples[start:start + per_chunk]
        batch = player.play(model, chunk, seed + start, greedy=greedy, group_size=samples)
        rewards = batch.rewards.tolist()
        eps = batch.episodes.records
        ok = [episode_success(e) for e in eps]
        for e, r, good in zip(eps, rewards, ok):
            for k, v in zip(EPISODE_KEYS, (good, good, r, e.turns, e.tool_calls, e.tool_errors,
                                           e.env_errors)):
                sums[k] += v
        sums["truncated_frac"] += float(batch.truncated.sum())
        sums["length_mean"] += float(batch.mask.sum())
        ev.correct += [sum(ok[i * samples:(i + 1) * samples]) for i in range(len(chunk))]
        if len(ev.rows) < keep:
            k = min(keep - len(ev.rows), batch.num_sequences)
            ends = episode_endings(eps[:k], batch.completion_ids[:k], player.tokenizer,
                                   player.stops)
            rows = eval_rows(step, batch.prompts[:k], batch.completions[:k],
                             batch.rewards[:k].tolist(), ok[:k], batch.mask[:k], ends)
            for row, e in zip(rows, eps[:k]):
                row.update(episode_columns(e, tool_task))
            ev.rows += rows
        if on_chunk is not None:
            on_chunk(len(chunk))
    sums["count"] = float(len(examples) * samples)
    return ev
