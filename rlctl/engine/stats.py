"""The metric schema every algorithm shares, and its reduction over data-parallel ranks.

Each name is made where its value is computed (given here as ``where``); values are
detached tensors until one host sync at log time. The schema:

  reward/mean, reward/std            task reward over the step's N rows (stats.py)
  reward/frac_zero_std_groups        groups whose G rewards are all equal (stats.py)
  reward/errors, reward/timeouts     failed reward calls; samples left unscored at the
                                     deadline (cumulative counts, tasks/scoring.py)
  reward/<name>                      each named reward's mean since the last log: the task's
                                     designs (e.g. reward/exact) and each learned reward
                                     model's raw score (reward/reward_model by default)
                                     (tasks/scoring.py; async: engine/async_rollout.py)
  rollout/kept_groups_frac           groups kept by dynamic sampling / groups sampled (stats.py)
  advantage/mean, advantage/std      token mean; std of per-row means (stats.py)
  length/mean, length/min, length/max  counted completion tokens per row (stats.py)
  length/truncated_frac              rows with no stop id within the limit (stats.py)
  policy/loss                        the policy loss, this rank's share summed (engine/update.py)
  policy/entropy                     token-mean entropy of the learner's distribution (update.py)
  policy/clip_frac_low, policy/clip_frac_high, policy/clip_frac   ratio clipped low / high /
                                     either, fraction of counted tokens (core/_policy.py)
  policy/clip_frac_dual              tokens with A < 0 capped by the dual clip (core/_policy.py)
  policy/approx_kl                   k3(pi_old -> pi) token mean (core/_policy.py)
  policy/ratio_std, policy/ratio_max spread of pi / pi_old when pi_old is given (update.py)
  policy/kl_ref                      the training KL estimate to the reference (update.py)
  kl/k1, kl/k3                       both estimates of KL(pi || ref), token means (update.py)
  kl/seq_k1                          per-sequence KL(pi_old || ref), adaptive KL's input (trainer.py);
                                     like reward/mean and length/mean, weighted by rank's sequences
                                     (per-sequence means are weighted by each rank's sequences)
  kl/coef                            the KL coefficient beta (trainer.py)
  value/loss, value/clip_frac, value/explained_var, value/mean   critic (update.py)
  value/return_mean                  token mean of the value targets (trainer.py)
  optim/grad_norm, optim/lr          before clipping; the schedule's (update.py, trainer.py)
  fault/skipped_steps                optimizer steps skipped as non-finite (update.py)
  time/rollout_s, time/update_s, time/generate_s, time/score_s, time/logprob_s,
  time/elapsed_s                     wall seconds (trainer.py)
  time/learner_wait_s, time/actor_wait_s, async/staleness   async mode (async_rollout.py)
  perf/tokens_per_s                  counted tokens / step time (trainer.py)
  eval/exact_match, eval/reward, eval/length_mean, eval/truncated_frac   held-out greedy
                                     evaluation (trainer.py, evaluate.py)
The reward-model command logs its own: train/loss, train/bt_loss, train/accuracy,
train/margin, optim/grad_norm (models/reward_fit.py); eval/pairwise_accuracy, eval/margin,
eval/chosen_mean, eval/rejected_mean (engine/reward_model_train.py).
"""
from __future__ import annotations

from typing import Dict

import torch

from rlctl.core.logprobs import masked_mean
from rlctl.types import RolloutBatch


def rollout_metrics(batch: RolloutBatch, kept_groups_frac: float = 1.0) -> Dict[str, torch.Tensor]:
    """reward/, advantage/, length/ and rollout/kept_groups_frac of one step's batch."""
    r = batch.rewards                                          # [N]
    groups = r.view(-1, batch.group_size)                      # [B, G]
    lengths = batch.mask.sum(-1)                               # [N]
    seq_adv = batch.advantages.sum(-1) / lengths.clamp(min=1)  # [N] (constant per row for outcome advantages)
    zero_std = (groups.max(-1).values == groups.min(-1).values).float()   # [B]
    return {
        "reward/mean": r.mean(),
        "reward/std": r.std() if r.numel() > 1 else torch.zeros(()),
        "reward/frac_zero_std_groups": zero_std.mean(),
        "advantage/mean": masked_mean(batch.advantages, batch.mask),
        "advantage/std": seq_adv.std() if seq_adv.numel() > 1 else torch.zeros(()),
        "length/mean": lengths.mean(),
        "length/min": lengths.min(),
        "length/max": lengths.max(),
        "length/truncated_frac": batch.truncated.float().mean(),
        "rollout/kept_groups_frac": torch.tensor(float(kept_groups_frac)),
    }


# Summed over ranks: counts, and the loss terms (each rank's value is its share of the
# global batch's loss: its numerator over the normaliser summed over every rank).
SUMMED = {"perf/step_tokens", "perf/step_sequences", "policy/loss", "value/loss"}
REDUCE_OP = {"length/min": "min", "length/max": "max", "policy/ratio_max": "max"}
# Per-sequence means, weighted by each rank's sequence count (dynamic sampling leaves
# ranks with different counts, where a plain average over ranks is biased).
PER_SEQUENCE = {"kl/seq_k1", "reward/mean", "length/mean", "length/truncated_frac"}


def reduce_metrics(metrics: Dict[str, torch.Tensor], backend) -> Dict[str, float]:
    """Floats averaged over data-parallel ranks (min/max/sum where the name says so);
    one host sync (and one collective per reduction kind) for the whole dict."""
    keys = sorted(metrics)
    x = torch.stack([torch.as_tensor(metrics[k], dtype=torch.float32).detach().cpu() for k in keys])
    if backend.world_size > 1:
        n = x[keys.index("perf/step_sequences")] if "perf/step_sequences" in metrics else torch.ones(())
        weighted = torch.stack([x[i] * n if k in PER_SEQUENCE else x[i] for i, k in enumerate(keys)])
        total = backend.all_reduce(torch.cat([weighted, n.reshape(1)]), "sum")
        total, n_all = total[:-1], total[-1]
        lo, hi, avg = backend.all_reduce(x, "min"), backend.all_reduce(x, "max"), total / backend.world_size
        pick = {"min": lo, "max": hi}
        x = torch.stack([total[i] if k in SUMMED else total[i] / n_all if k in PER_SEQUENCE
                         else pick.get(REDUCE_OP.get(k), avg)[i] for i, k in enumerate(keys)])
    return dict(zip(keys, x.tolist()))
