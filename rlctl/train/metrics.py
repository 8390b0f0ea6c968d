"""The metric schema every algorithm shares (docs/metrics.md), its reduction over ranks (one
host sync at log time; `Moments` pooled exactly), and the sample tables handed to the sinks."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch

from rlctl.core import counted_width, masked_mean
from rlctl.envs.environment import episode_success
from rlctl.models.stop_ids import decode_completions
from rlctl.tasks.task import RAW_PROMPT
from rlctl.types import MODEL, TOKEN_LIMIT, TURN_LIMIT, Episode, RolloutBatch

Row = Dict[str, Any]


@dataclass
class Moments:
    """Pooled float64 statistics of k variables over n entries: ``n`` [], ``mean`` [k], ``m2``
    [k] (sums of squared deviations); ``combine`` pools exactly (Chan, Golub & LeVeque,
    1983); ``finish`` turns the pooled set into the metric."""
    n: torch.Tensor
    mean: torch.Tensor
    m2: torch.Tensor
    finish: Callable[["Moments"], torch.Tensor]

    @classmethod
    def of(cls, x: torch.Tensor, mask: torch.Tensor, finish) -> "Moments":
        """x [k, ...] (k variables), mask [...] (entries counted where > 0)."""
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


def population_std(m: Moments) -> torch.Tensor:
    """sqrt(M2 / n) of the first variable (0 without entries)."""
    return (m.m2[0] / m.n.clamp(min=1)).sqrt()


def sample_std(m: Moments) -> torch.Tensor:
    """sqrt(M2 / (n - 1)) of the first variable, as ``torch.std`` (0 below 2 entries)."""
    return torch.where(m.n > 1, m.m2[0] / (m.n - 1).clamp(min=1), torch.zeros_like(m.n)).sqrt()


def explained_variance_of(m: Moments) -> torch.Tensor:
    """1 - Var[R - V] / Var[R] from moments of (R, R - V); 0 where Var[R] == 0."""
    return torch.where(m.m2[0] > 0, 1.0 - m.m2[1] / m.m2[0].clamp(min=1e-300), torch.zeros_like(m.n))


def mean_of(m: Moments) -> torch.Tensor:
    return m.mean[0]


Metric = Union[torch.Tensor, Moments]


def rollout_metrics(batch: RolloutBatch, kept_groups_frac: float = 1.0,
                    pairs: bool = False) -> Dict[str, Metric]:
    """reward/, advantage/, length/, rollout/, value/return_mean, kl/seq_k1 and perf/step_*;
    ``pairs`` (a preference batch: labels, not rewards): no reward/ or advantage/."""
    r = batch.rewards                                          # [N]
    groups = r.view(-1, batch.group_size)                      # [B, G]
    lengths = batch.mask.sum(-1)                               # [N]
    seq_adv = batch.advantages.sum(-1) / lengths.clamp(min=1)  # [N] (constant per row for outcome advantages)
    zero_std = (groups.max(-1).values == groups.min(-1).values).float()   # [B]
    out: Dict[str, Metric] = episode_metrics(batch) if batch.episodes is not None else {}
    out.update({
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
        "perf/step_tokens": batch.mask.sum(),
        "perf/step_sequences": torch.tensor(float(batch.num_sequences)),
    })
    if pairs:                          # chosen 1 / rejected 0 by construction: nothing to read
        out = {k: v for k, v in out.items() if not k.startswith(("reward/", "advantage/"))}
    if batch.returns is not None:
        out["value/return_mean"] = masked_mean(batch.returns, batch.mask)
    lp = batch.logprobs
    if lp.ref is not None and lp.old is not None:
        out["kl/seq_k1"] = ((lp.old - lp.ref) * batch.mask).sum(-1).mean()
    return out


def episode_metrics(batch: RolloutBatch) -> Dict[str, Metric]:
    """episode/*: per-episode means (success: ``episode_success``) and two sums."""
    eps = batch.episodes.records
    P = batch.prompt_len

    def mean(values) -> torch.Tensor:
        return torch.tensor([float(v) for v in values], dtype=torch.float64).mean()

    obs = batch.attention_mask[:, P:].sum(-1).double() - batch.mask.sum(-1).double()   # [N]
    return {
        "episode/turns_mean": mean(e.turns for e in eps),
        "episode/obs_tokens_mean": obs.mean(),
        "episode/tool_calls_mean": mean(e.tool_calls for e in eps),
        "episode/tool_errors_mean": mean(e.tool_errors for e in eps),
        "episode/env_errors": torch.tensor(float(sum(e.env_errors for e in eps))),
        "episode/obs_truncated": torch.tensor(float(sum(sp.truncated for e in eps for sp in e.spans))),
        "episode/turn_limit_frac": mean(e.status == TURN_LIMIT for e in eps),
        "episode/token_limit_frac": mean(e.status == TOKEN_LIMIT for e in eps),
        "episode/success_rate": mean(episode_success(e) for e in eps),
    }


def named_reward_metrics(sums: Dict[str, float], count: int, backend) -> Dict[str, Moments]:
    """reward/<name>: each named reward's mean over every rank's samples since the last step;
    the names are the union over the ranks (one gather), a missing name counting 0."""
    names = sorted(sums)
    if backend.world_size > 1:
        blob = torch.tensor(list("".join(f"{k}\n" for k in names).encode() + b"\n"),
                            dtype=torch.uint8)                          # [bytes]
        rows, _ = backend.all_gather_rows(blob)                         # [every rank's bytes]
        names = sorted({k for k in bytes(rows.tolist()).decode().split("\n") if k})
    n = torch.tensor(float(count), dtype=torch.float64)
    out: Dict[str, Moments] = {}
    for k in names:
        mean = torch.tensor([sums.get(k, 0.0) / max(count, 1)], dtype=torch.float64)
        out[f"reward/{k}"] = Moments(n, mean, torch.zeros(1, dtype=torch.float64), mean_of)
    return out


# Summed over ranks: counts, and the loss terms (each rank's value is its share of the
# global batch's loss: its numerator over the normaliser summed over every rank).
# a preference update's means over pairs (docs/metrics.md), each rank holding its share
PAIR_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracy",
                "logps/chosen", "logps/rejected")
SUMMED = {"perf/step_tokens", "perf/step_sequences", "policy/loss", "value/loss",
          "episode/env_errors", "episode/obs_truncated", *PAIR_METRICS}
REDUCE_OP = {"length/min": "min", "length/max": "max", "policy/ratio_max": "max"}
# Per-sequence means, weighted by each rank's sequence count (dynamic sampling leaves
# ranks with different counts, where a plain average over ranks is biased).
PER_SEQUENCE = {"kl/seq_k1", "reward/mean", "length/mean", "length/truncated_frac",
                "episode/turns_mean", "episode/obs_tokens_mean", "episode/tool_calls_mean",
                "episode/tool_errors_mean", "episode/turn_limit_frac", "episode/token_limit_frac",
                "episode/success_rate", "rollout/masked_frac"}


def reduce_metrics(metrics: Dict[str, Metric], backend) -> Dict[str, float]:
    """Floats averaged (min/max/sum by name, `Moments` pooled) over ranks; one sync per kind."""
    keys: List[str] = []
    pooled: List[str] = []
    for k in sorted(metrics):
        (pooled if isinstance(metrics[k], Moments) else keys).append(k)
    x = torch.zeros(len(keys), dtype=torch.float64)                    # [len(keys)]
    for i, k in enumerate(keys):
        x[i] = torch.as_tensor(metrics[k], dtype=torch.float64).detach().cpu()
    flat = torch.zeros(0, dtype=torch.float64)           # n, means, m2 of each pooled metric
    for k in pooled:
        m = metrics[k]
        flat = torch.cat([flat, m.n.reshape(1).detach().double().cpu(),
                          m.mean.detach().double().cpu(), m.m2.detach().double().cpu()])
    rows = flat[None]                                              # [ranks, moments]
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
        size = 1 + 2 * m.mean.numel()
        whole = None
        for r in rows:
            part = Moments(r[at], r[at + 1:at + 1 + m.mean.numel()], r[at + 1 + m.mean.numel():at + size],
                           m.finish)
            whole = part if whole is None else whole.combine(part)
        out[k], at = float(whole.finish(whole)), at + size
    return out


# ---- sample tables ------------------------------------------------------------------------
def draw_rows(num_rows: int, group_size: int, n: int, seed: int, step: int) -> List[int]:
    """A step's table rows: ceil(n / G) whole groups drawn by an RNG seeded with (seed, step),
    in group order, then the first n rows."""
    groups = num_rows // group_size
    k = min(math.ceil(n / group_size), groups)
    chosen = sorted(random.Random(f"rlctl-samples:{seed}:{step}").sample(range(groups), k))
    return [g * group_size + j for g in chosen for j in range(group_size)][:n]


def endings(completion_ids: torch.Tensor, mask: torch.Tensor, truncated: Sequence[bool],
            tokenizer) -> List[Row]:
    """finish_reason, stop_id, stop_token of each row (``completion_ids``, ``mask``: [n, T])."""
    widths = counted_width(mask).tolist()
    ids = completion_ids.tolist()
    out = []
    for row, n, cut in zip(ids, widths, truncated):
        stop = None if cut or n == 0 else int(row[n - 1])
        out.append({"finish_reason": "length" if stop is None else "stop", "stop_id": stop,
                    "stop_token": None if stop is None else tokenizer.convert_ids_to_tokens(stop)})
    return out


def episode_endings(episodes: Sequence[Episode], completion_ids: torch.Tensor, tokenizer,
                    stops: Sequence[int]) -> List[Row]:
    """finish_reason, stop_id, stop_token of each episode (``completion_ids`` [n, T]): the stop id
    that ended its last model turn, None when a length limit or a stop string did."""
    stop_set, out = {int(s) for s in stops}, []
    for e, row in zip(episodes, completion_ids.tolist()):
        last = [s.end - 1 for s in e.spans if s.role == MODEL and s.end > s.start][-1:]
        stop = int(row[last[0]]) if last and int(row[last[0]]) in stop_set else None
        out.append({"finish_reason": e.status, "stop_id": stop,
                    "stop_token": None if stop is None else tokenizer.convert_ids_to_tokens(stop)})
    return out


def sequence_advantages(advantages: torch.Tensor, mask: torch.Tensor) -> List[float]:
    """Each row's mean advantage over its counted tokens, in float64 ([n, T] or [n, 1])."""
    m = mask.double()
    total = (advantages.double().expand_as(m) * m).sum(-1)
    return (total / m.sum(-1).clamp(min=1)).tolist()


def user_prompts(examples) -> Dict[str, str]:
    """{rendered prompt: the user's text} of the examples the chat template (or truncation)
    changed: the prompt as written, of a message list its last user message."""
    out = {}
    for ex in examples:
        raw = ex.fields.get(RAW_PROMPT, ex.prompt)
        if isinstance(raw, list):
            raw = next((m.get("content") for m in reversed(raw) if m.get("role") == "user"),
                       " ".join(str(m.get("content", "")) for m in raw))
        if raw != ex.prompt:
            out[ex.prompt] = str(raw)
    return out


def train_rows(batch: RolloutBatch, rows: List[int], step: int, rewards: torch.Tensor,
               tokenizer, stops: Sequence[int], tool_task: bool = False,
               counted: Optional[torch.Tensor] = None, users: Optional[Dict[str, str]] = None
               ) -> List[Row]:
    """The table of ``rows`` of ``batch``; ``rewards`` [N]: what the advantages received;
    ``counted`` [N, T]: the update's mask (None: ``batch.mask``), a row it left out shows 0."""
    idx = torch.tensor(rows, dtype=torch.long, device=batch.mask.device)
    mask, ids = batch.mask[idx], batch.completion_ids[idx]                   # [n, T] each
    if batch.episodes is None:
        ends = endings(ids, mask, batch.truncated[idx].tolist(), tokenizer)
        texts = decode_completions(tokenizer, ids, mask, stops)
    else:                  # the transcript: a multi-turn row's mask has gaps
        ends = episode_endings([batch.episodes.records[i] for i in rows], ids, tokenizer, stops)
        texts = [batch.completions[i] for i in rows]
    used = mask if counted is None else counted[idx]                         # [n, T]
    advantages = sequence_advantages(batch.advantages[idx], used) \
        if batch.advantages is not None else [None] * len(rows)
    staleness = batch.logprobs.staleness
    stale = staleness[idx].tolist() if staleness is not None else [0] * len(rows)
    parts = batch.reward_parts or {}
    out = []
    for j, (i, groups, reward, length) in enumerate(zip(
            rows, batch.group_ids[idx].tolist(), rewards[idx].tolist(),
            mask.sum(-1).long().tolist())):
        row: Row = {"step": step, "group": groups, "prompt": batch.prompts[i],
                    **_user(batch.prompts[i], users), "completion": texts[j]}
        row.update({f"reward/{k}": float(parts[k][i]) for k in sorted(parts)})
        row.update({"reward": reward, "advantage": advantages[j], "length": length, **ends[j],
                    "policy_version": step - 1 - int(stale[j])})
        if batch.episodes is not None:
            row.update(episode_columns(batch.episodes.records[i], tool_task))
        out.append(row)
    return out


def episode_columns(episode: Episode, tool_task: bool) -> Row:
    """An episode's columns of a sample row (docs/metrics.md)."""
    return {"num_turns": episode.turns, "status": episode.status, "success": episode_success(episode),
            "tool_calls": int(episode.tool_calls), "tool_errors": int(episode.tool_errors),
            "env_errors": int(episode.env_errors),
            "obs_truncated": sum(bool(s.truncated) for s in episode.spans),
            "tool_task": bool(tool_task),
            "turns": [{"role": s.role, "text": s.text, "reward": float(s.reward),
                       "truncated": bool(s.truncated)} for s in episode.spans]}


def _user(prompt: str, users: Optional[Dict[str, str]]) -> Row:
    """The user_prompt column (the console shows it in the prompt column), when it differs."""
    return {"user_prompt": users[prompt]} if users and prompt in users else {}


def eval_rows(step: int, prompts: Sequence[str], texts: Sequence[str], rewards: Sequence[float],
              correct: Optional[Sequence[bool]], mask: torch.Tensor, ends: Sequence[Row],
              users: Optional[Dict[str, str]] = None) -> List[Row]:
    """The eval table's rows (``correct`` None: no exact_match column); ``mask`` [n, T]."""
    out = []
    for j, length in enumerate(mask.sum(-1).long().tolist()):
        row: Row = {"step": step, "prompt": prompts[j], **_user(prompts[j], users),
                    "completion": texts[j], "reward": float(rewards[j])}
        if correct is not None:
            row["exact_match"] = float(correct[j])
        row.update({"length": length, **ends[j], "policy_version": step})
        out.append(row)
    return out
