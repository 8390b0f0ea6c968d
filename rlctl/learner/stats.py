"""The metric schema every algorithm shares, and its reduction over data-parallel ranks.

The schema (each name, its meaning and the module that makes it) is docs/metrics.md's
table. Values are detached tensors until one host sync at log time. Token means are exact
over micro-batches (weighted by their tokens) and averaged over optimizer steps and
ranks; spreads (the stds, explained_var) travel as `Moments` pooled over micro-batches,
steps and ranks and finished once at log time, so no split of the batch changes them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Union

import torch

from rlctl.core.logprobs import masked_mean
from rlctl.types import TOKEN_LIMIT, TURN_LIMIT, RolloutBatch


@dataclass
class Moments:
    """Pooled sufficient statistics of k variables over the same n entries, in float64: the
    count ``n`` [], the means ``mean`` [k], the sums of squared deviations ``m2`` [k].
    ``combine`` pools two sets exactly (Chan, Golub & LeVeque, 1983); ``finish`` turns the
    pooled set into the metric (`reduce_metrics` calls it)."""
    n: torch.Tensor
    mean: torch.Tensor
    m2: torch.Tensor
    finish: Callable[["Moments"], torch.Tensor]

    @classmethod
    def of(cls, x: torch.Tensor, mask: torch.Tensor, finish) -> "Moments":
        """x [k, ...] (k variables), mask [...] (entries counted where > 0); entries not counted are
        dropped with ``torch.where`` (no NaN leaks)."""
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
