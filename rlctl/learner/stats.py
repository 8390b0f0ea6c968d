"""The metric schema every algorithm shares, and its reduction over data-parallel ranks.

Each name is made where its value is computed (given here as ``where``); values are
detached tensors until one host sync at log time. The schema:

  reward/mean, reward/std            task reward over the step's rows of every rank (stats.py)
  reward/frac_zero_std_groups        groups whose G rewards are all equal (stats.py)
  reward/errors, reward/timeouts     failed reward calls; samples left unscored at the
                                     deadline (cumulative counts, tasks/scoring.py)
  reward/<name>                      each named reward's mean since the last log: the task's
                                     designs (e.g. reward/exact) and each learned reward
                                     model's raw score (reward/reward_model by default)
                                     (tasks/scoring.py)
  rollout/kept_groups_frac           groups kept by dynamic sampling / groups sampled (stats.py)
  advantage/mean, advantage/std      token mean; std of per-row means over every rank's rows (stats.py)
  length/mean, length/min, length/max  counted completion tokens per row (stats.py): the
                                     model's own tokens; a multi-turn row's observations
                                     are not counted (episode/obs_tokens_mean)
  length/truncated_frac              rows with no stop id within the limit; episodes: not
                                     ended by the environment (done) (stats.py)
  episode/turns_mean, episode/obs_tokens_mean, episode/tool_calls_mean,
  episode/tool_errors_mean           per episode: model turns, observation tokens (the
                                     completion's attention tokens minus the counted ones),
                                     tool calls, failed tool calls (stats.py; episodes only)
  episode/env_errors, episode/obs_truncated  environment steps that raised or passed their
                                     time limit; observations cut to max_obs_tokens (sums)
  episode/turn_limit_frac, episode/token_limit_frac  episodes ended by the turn / token budget
  episode/success_rate               success over the episodes that report it (0 if none)
  policy/loss                        the policy loss, this rank's share summed (learner/update.py)
  policy/entropy                     token-mean entropy of the learner's distribution (update.py)
  policy/clip_frac_low, policy/clip_frac_high, policy/clip_frac   ratio clipped low / high /
                                     either, fraction of counted tokens (core/_policy.py)
  policy/clip_frac_dual              tokens with A < 0 capped by the dual clip (core/_policy.py)
  policy/approx_kl                   k3(pi_old -> pi) token mean (core/_policy.py)
  policy/ratio_std, policy/ratio_max spread of pi / pi_old when pi_old is given: population std
                                     and max over every counted token of the update (all its
                                     optimizer steps, micro-batches and ranks) (update.py)
  policy/kl_ref                      the training KL estimate to the reference (update.py)
  kl/k1, kl/k3                       both estimates of KL(pi || ref), token means (update.py)
  kl/seq_k1                          per-sequence KL(pi_old || ref), adaptive KL's input (trainer.py);
                                     like reward/mean and length/mean, weighted by rank's sequences
                                     (per-sequence means are weighted by each rank's sequences)
  kl/coef                            the KL coefficient beta (trainer.py)
  value/loss, value/clip_frac, value/explained_var, value/mean   critic (update.py);
                                     explained_var = 1 - Var[R - V] / Var[R] over every counted
                                     token of the update (all steps, micro-batches and ranks)
  value/return_mean                  token mean of the value targets (trainer.py)
  optim/grad_norm, optim/lr          before clipping; the schedule's (update.py, trainer.py)
  fault/skipped_steps                optimizer steps skipped as non-finite (update.py)
  time/rollout_s, time/update_s, time/generate_s, time/score_s, time/logprob_s,
  time/elapsed_s                     wall seconds (trainer.py)
  time/learner_wait_s, time/engine_generate_s, async/staleness   async mode (engine_source.py)
  perf/tokens_per_s                  counted tokens / step time (trainer.py); the model's
                                     tokens only: observations are forwarded, not counted
  eval/exact_match, eval/reward, eval/length_mean, eval/truncated_frac   held-out greedy
                                     evaluation (trainer.py, evaluate.py)
The reward-model command logs its own: train/loss, train/bt_loss, train/accuracy,
train/margin, optim/grad_norm (reward_models/fit.py); eval/pairwise_accuracy, eval/margin,
eval/chosen_mean, eval/rejected_mean (reward_models/train.py).

Token means are exact over micro-batches (weighted by their tokens) and averaged over
optimizer steps and ranks. Spreads (the stds, explained_var) are not means of per-token
values, so they travel as `Moments` (count, means, sums of squared deviations, float64)
pooled over micro-batches, steps and ranks and finished once at log time: they do not
depend on micro_batch_size, micro_batch_tokens, minibatches or the number of ranks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Union

import torch

from rlctl.core.logprobs import masked_mean
from rlctl.types import TOKEN_LIMIT, TURN_LIMIT, RolloutBatch


@dataclass
class Moments:
    """Pooled sufficient statistics of k variables over the same n entries, in float64:
    the count ``n`` [], the means ``mean`` [k] and the sums of squared deviations from
    them ``m2`` [k]. ``combine`` pools two sets exactly (Chan, Golub & LeVeque, 1983), with
    no ``sum x^2 - n mean^2`` cancellation; ``finish`` turns the pooled set into the
    metric. A metric whose value is a ``Moments`` is a statistic of every entry it saw,
    over micro-batches, optimizer steps and ranks alike (`reduce_metrics` finishes it)."""
    n: torch.Tensor
    mean: torch.Tensor
    m2: torch.Tensor
    finish: Callable[["Moments"], torch.Tensor]

    @classmethod
    def of(cls, x: torch.Tensor, mask: torch.Tensor, finish) -> "Moments":
        """x [k, ...] (k variables), mask [...] (entries counted where > 0). Entries not
        counted are dropped with ``torch.where``, so a NaN/inf there cannot leak (as in
        `rlctl.core.masked_mean`)."""
        counted = mask.detach() > 0                                         # [...]
        x = torch.where(counted, x.detach().double(), 0.0)                  # [k, ...]
        m = counted.double()
        n = m.sum()
        dims = tuple(range(1, x.dim()))
        mean = x.sum(dims) / n.clamp(min=1)                                 # [k]
        dev = (x - mean.view((-1,) + (1,) * len(dims))) * m                 # [k, ...]
        return cls(n, mean, dev.square().sum(dims), finish)

    def combine(self, other: "Moments") -> "Moments":
        n = self.n + other.n
        d = other.mean - self.mean                                          # [k]
        w = other.n / n.clamp(min=1)
        return Moments(n, self.mean + d * w, self.m2 + other.m2 + d.square() * self.n * w, self.finish)

    def flat(self) -> torch.Tensor:
        """[1 + 2k] float64 on the CPU: n, means, m2."""
        return torch.cat([self.n.reshape(1), self.mean, self.m2]).detach().double().cpu()

    def like(self, flat: torch.Tensor) -> "Moments":
        k = self.mean.numel()
        return Moments(flat[0], flat[1:1 + k], flat[1 + k:], self.finish)


def pool(parts: List[Moments]) -> Moments:
    out = parts[0]
    for p in parts[1:]:
        out = out.combine(p)
    return out


def population_std(m: Moments) -> torch.Tensor:
    """sqrt(M2 / n) of the first variable (0 without entries)."""
    return (m.m2[0] / m.n.clamp(min=1)).sqrt()


def sample_std(m: Moments) -> torch.Tensor:
    """sqrt(M2 / (n - 1)) of the first variable, as ``torch.std`` (0 below 2 entries)."""
    return torch.where(m.n > 1, m.m2[0] / (m.n - 1).clamp(min=1), torch.zeros_like(m.n)).sqrt()


def explained_variance_of(m: Moments) -> torch.Tensor:
    """1 - Var[R - V] / Var[R] from moments of (R, R - V); 0 where Var[R] == 0."""
    return torch.where(m.m2[0] > 0, 1.0 - m.m2[1] / m.m2[0].clamp(min=1e-300), torch.zeros_like(m.n))


Metric = Union[torch.Tensor, Moments]


def rollout_metrics(batch: RolloutBatch, kept_groups_frac: float = 1.0) -> Dict[str, Metric]:
    """reward/, advantage/, length/ and rollout/kept_groups_frac of one step's batch (the
    two stds as `Moments`: over every rank's rows once reduced)."""
    r = batch.rewards                                          # [N]
    groups = r.view(-1, batch.group_size)                      # [B, G]
    lengths = batch.mask.sum(-1)                               # [N]
    seq_adv = batch.advantages.sum(-1) / lengths.clamp(min=1)  # [N] (constant per row for outcome advantages)
    zero_std = (groups.max(-1).values == groups.min(-1).values).float()   # [B]
    out: Dict[str, Metric] = episode_metrics(batch) if batch.episodes is not None else {}
    return {
        **out,
        "reward/mean": r.mean(),
        "reward/std": Moments.of(r[None], torch.ones_like(r), sample_std),
        "reward/frac_zero_std_groups": zero_std.mean(),
        "advantage/mean": masked_mean(batch.advantages, batch.mask),
        "advantage/std": Moments.of(seq_adv[None], torch.ones_like(seq_adv), sample_std),
        "length/mean": lengths.mean(),
        "length/min": lengths.min(),
        "length/max": lengths.max(),
        "length/truncated_frac": batch.truncated.float().mean(),
        "rollout/kept_groups_frac": torch.tensor(float(kept_groups_frac)),
    }


def episode_metrics(batch: RolloutBatch) -> Dict[str, Metric]:
    """episode/* of a batch of episodes (``batch.episodes`` set): per-episode means, the
    two sums, and the success rate as `Moments` over the episodes that report one."""
    eps = batch.episodes
    P = batch.prompt_len

    def mean(values) -> torch.Tensor:
        return torch.tensor([float(v) for v in values], dtype=torch.float64).mean()

    obs = batch.attention_mask[:, P:].sum(-1).double() - batch.mask.sum(-1).double()   # [N]
    known = torch.tensor([float(e.success) for e in eps if e.success is not None],
                         dtype=torch.float64)                                          # [n known]
    return {
        "episode/turns_mean": mean(e.turns for e in eps),
        "episode/obs_tokens_mean": obs.mean(),
        "episode/tool_calls_mean": mean(e.tool_calls for e in eps),
        "episode/tool_errors_mean": mean(e.tool_errors for e in eps),
        "episode/env_errors": torch.tensor(float(sum(e.env_errors for e in eps))),
        "episode/obs_truncated": torch.tensor(float(sum(sp.truncated for e in eps for sp in e.spans))),
        "episode/turn_limit_frac": mean(e.status == TURN_LIMIT for e in eps),
        "episode/token_limit_frac": mean(e.status == TOKEN_LIMIT for e in eps),
        "episode/success_rate": Moments.of(known[None], torch.ones_like(known), _mean_of),
    }


def _mean_of(m: Moments) -> torch.Tensor:
    return m.mean[0]


# Summed over ranks: counts, and the loss terms (each rank's value is its share of the
# global batch's loss: its numerator over the normaliser summed over every rank).
SUMMED = {"perf/step_tokens", "perf/step_sequences", "policy/loss", "value/loss",
          "episode/env_errors", "episode/obs_truncated"}
REDUCE_OP = {"length/min": "min", "length/max": "max", "policy/ratio_max": "max"}
# Per-sequence means, weighted by each rank's sequence count (dynamic sampling leaves
# ranks with different counts, where a plain average over ranks is biased).
PER_SEQUENCE = {"kl/seq_k1", "reward/mean", "length/mean", "length/truncated_frac",
                "episode/turns_mean", "episode/obs_tokens_mean", "episode/tool_calls_mean",
                "episode/tool_errors_mean", "episode/turn_limit_frac", "episode/token_limit_frac"}


def reduce_metrics(metrics: Dict[str, Metric], backend) -> Dict[str, float]:
    """Floats averaged over data-parallel ranks (min/max/sum where the name says so;
    `Moments` pooled over every rank's entries, then finished); one host sync, and one
    collective per reduction kind, for the whole dict."""
    keys = sorted(k for k in metrics if not isinstance(metrics[k], Moments))
    pooled = sorted(k for k in metrics if isinstance(metrics[k], Moments))
    x = torch.stack([torch.as_tensor(metrics[k], dtype=torch.float64).detach().cpu() for k in keys]
                    or [torch.zeros(0, dtype=torch.float64)]).flatten()   # [len(keys)]
    flat = torch.cat([metrics[k].flat() for k in pooled] or [torch.zeros(0, dtype=torch.float64)])
    rows = flat[None]                                              # [ranks, moments of every pooled metric]
    if backend.world_size > 1:
        n = x[keys.index("perf/step_sequences")] if "perf/step_sequences" in metrics else torch.ones(())
        weighted = torch.where(torch.tensor([k in PER_SEQUENCE for k in keys], dtype=torch.bool), x * n, x)
        rows = torch.zeros(backend.world_size, flat.numel(), dtype=torch.float64)
        if pooled:                  # an all-gather as a sum: each rank fills its own row
            rows[backend.rank] = flat
        total = backend.all_reduce(torch.cat([weighted, n.reshape(1).double(), rows.flatten()]), "sum")
        total, n_all, rows = total[:len(keys)], total[len(keys)], total[len(keys) + 1:].view(rows.shape)
        lo, hi, avg = backend.all_reduce(x, "min"), backend.all_reduce(x, "max"), total / backend.world_size
        pick = {"min": lo, "max": hi}
        x = torch.stack([total[i] if k in SUMMED else total[i] / n_all if k in PER_SEQUENCE
                         else pick.get(REDUCE_OP.get(k), avg)[i] for i, k in enumerate(keys)]) if keys else x
    out = dict(zip(keys, x.tolist()))
    at = 0
    for k in pooled:               # each pooled over the ranks' rows, then finished
        m = metrics[k]
        size = 1 + 2 * m.mean.numel()                               # n, means, m2 (Moments.flat)
        whole = pool([m.like(r[at:at + size]) for r in rows])
        out[k], at = float(whole.finish(whole)), at + size
    return out
