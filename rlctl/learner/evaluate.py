"""Held-out evaluation: greedy completions on the task's eval split."""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

from rlctl.core.logprobs import completion_mask
from rlctl.learner.samples import Row, endings, eval_rows
from rlctl.models.stop_ids import stop_ids
from rlctl.rollout.generate import decode_completions, generate
from rlctl.types import Example


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
