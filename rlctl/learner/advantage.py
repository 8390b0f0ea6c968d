"""From scored rollouts to per-token advantages (and value targets).

One registry (``rlctl.core.ADVANTAGE_ESTIMATORS``), two levels asked of the entry
(``estimator_kind``): outcome estimators map one return per completion [B, G] to one
advantage, broadcast to its tokens; token-level estimators (``gae``) map per-token
rewards and values to advantages and returns.

Rewards: with ``kl.placement=in_reward`` each counted token gets -beta * k and the task
reward goes on the last counted token (Ziegler et al., 2019); an outcome estimator gets
the per-sequence sum. DAPO's overlong penalty is added to the task reward first.
Episodes (``batch.token_rewards``, rlctl/core/turns.py): the token rewards plus the same
shaping; the overlong penalty measures the transcript against
``rollout.episode.max_tokens``; observations have mask 0 (docs/math.md, section 13)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from rlctl.core import (ADVANTAGE_ESTIMATORS, broadcast_to_tokens, kl_shaped_rewards,
                        masked_whiten, overlong_penalty, resolve_kl_estimator)
from rlctl.types import RolloutBatch


def estimator_kind(name: str) -> str:
    """The entry's level: 'token' (needs a critic) or 'outcome'; raises ValueError for
    unknown names (a user import path is loaded)."""
    return ADVANTAGE_ESTIMATORS.entry(name).level


@dataclass
class AdvantageSettings:
    """The advantage step's arguments, derived from the ``algo`` and ``rollout`` sections
    (``from_config``): the KL estimator resolved for its placement, whether KL is shaped
    into the reward, and the overlong limits."""
    estimator: str
    std_eps: float
    baseline: str
    gamma: float
    lam: float
    whiten: bool
    kl_in_reward: bool
    kl_estimator: str
    overlong_buffer: int
    overlong_penalty: float
    max_new_tokens: int
    episode_max_tokens: int = 0        # rollout.episode.max_tokens: an episode's overlong limit

    @classmethod
    def from_config(cls, cfg) -> "AdvantageSettings":
        """From the composed config's ``algo`` and ``rollout`` sections."""
        algo = cfg.algo
        return cls(estimator=algo.advantage, std_eps=algo.std_eps, baseline=algo.baseline,
                   gamma=algo.gamma, lam=algo.lam, whiten=algo.whiten_advantages,
                   kl_in_reward=algo.kl.placement == "in_reward",
                   kl_estimator=resolve_kl_estimator(algo.kl.estimator, algo.kl.placement),
                   overlong_buffer=algo.overlong_buffer, overlong_penalty=algo.overlong_penalty,
                   max_new_tokens=cfg.rollout.max_new_tokens,
                   episode_max_tokens=cfg.rollout.episode.max_tokens)


def shaped_task_rewards(batch: RolloutBatch, s: AdvantageSettings) -> torch.Tensor:
    """Task (or episode) reward plus the DAPO overlong penalty when configured. -> [N]"""
    if s.overlong_buffer <= 0:
        return batch.rewards
    return batch.rewards + overlong(batch, s)


def overlong(batch: RolloutBatch, s: AdvantageSettings) -> torch.Tensor:
    """The DAPO overlong penalty of each row [N] (0 when not configured): counted tokens
    against ``rollout.max_new_tokens``; an episode's transcript against
    ``rollout.episode.max_tokens``."""
    if s.overlong_buffer <= 0:
        return torch.zeros_like(batch.rewards)
    if batch.token_rewards is None:
        return overlong_penalty(batch.mask.sum(-1), s.max_new_tokens, s.overlong_buffer,
                                s.overlong_penalty)
    lengths = batch.attention_mask[:, batch.prompt_len:].sum(-1)          # [N]
    return overlong_penalty(lengths, s.episode_max_tokens, s.overlong_buffer, s.overlong_penalty)


def token_rewards(batch: RolloutBatch, rewards: torch.Tensor, s: AdvantageSettings,
                  kl_coef: float) -> torch.Tensor:
    """Per-token rewards [N, T]: ``rewards`` [N] on the last counted token, KL shaping if any."""
    if s.kl_in_reward and kl_coef > 0:   # the trainer computes old log-probs for this case
        return kl_shaped_rewards(rewards, batch.old_logprobs, batch.ref_logprobs, batch.mask,
                                 kl_coef, s.kl_estimator)
    return kl_shaped_rewards(rewards, torch.zeros_like(batch.mask), torch.zeros_like(batch.mask),
                             batch.mask, 0.0)


def whiten_over_ranks(x: torch.Tensor, mask: torch.Tensor, backend, eps: float = 1e-8) -> torch.Tensor:
    """``masked_whiten`` with the mean and unbiased variance over every rank's tokens, two
    passes in float64 (no ``sum x^2 - n mean^2`` cancellation); two collectives. Returns x's
    dtype, 0 where mask == 0."""
    if backend is None or backend.world_size == 1:
        return masked_whiten(x, mask, eps=eps) * mask
    m = mask.double()                                                   # [N, T]
    xd = torch.where(mask != 0, x.double(), 0.0)     # [N, T]; a NaN/inf not counted cannot leak
    n, s1 = backend.all_reduce_sum(torch.stack([m.sum(), (xd * m).sum()]))
    centred = (xd - s1 / n.clamp(min=1)) * m                            # [N, T]
    var = backend.all_reduce_sum(centred.square().sum()) / (n - 1).clamp(min=1)
    return (centred * torch.rsqrt(var + eps)).to(x.dtype)


def compute_advantages(batch: RolloutBatch, s: AdvantageSettings, kl_coef: float,
                       values: Optional[torch.Tensor], backend=None
                       ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(advantages [N, T], returns [N, T] or None); ``values`` [N, T] for GAE. With several
    ranks, outcome estimators see every rank's groups and whitening is global."""
    if batch.token_rewards is None:
        per_token = token_rewards(batch, shaped_task_rewards(batch, s), s, kl_coef)   # [N, T]
        seq_return = None
    else:       # episodes: the placed turn rewards, plus the shaping (KL, overlong penalty)
        shaping = token_rewards(batch, overlong(batch, s), s, kl_coef)              # [N, T]
        per_token = batch.token_rewards.to(shaping.dtype) + shaping                 # [N, T]
        seq_return = batch.rewards.to(shaping.dtype) + (shaping * batch.mask).sum(-1)   # [N]
    returns = None
    entry = ADVANTAGE_ESTIMATORS.entry(s.estimator)
    if entry.level == "token":
        adv, returns = entry.fn(per_token, values, batch.mask, s.gamma, s.lam)   # [N, T] each
    else:
        if seq_return is None:
            seq_return = (per_token * batch.mask).sum(-1)                         # [N]
        seq_return = seq_return.view(-1, batch.group_size)                        # [B, G]
        first = 0
        if backend is not None and backend.world_size > 1:
            seq_return, first = backend.all_gather_rows(seq_return)              # [B_all, G]
        adv = entry.fn(seq_return, s.std_eps, baseline=s.baseline)               # [B_all, G]
        adv = adv[first: first + batch.num_sequences // batch.group_size]         # [B, G]
        adv = broadcast_to_tokens(adv, batch.mask)                                # [N, T]
    if s.whiten:
        adv = whiten_over_ranks(adv, batch.mask, backend)
    return adv, returns
