"""Advantage estimators: outcome (one reward per completion) and token-level GAE.

Sources (seed 002 and Lambert's lecture, seed 000):
- REINFORCE (Williams, 1992): A = R; with a baseline, A = R - b. Here b is the mean over
  the whole batch (B*G), as in the seed's toy code (`baseline = R.mean()`); its bias is
  O(1/N).
- RLOO (Kool et al., 2019; Ahmadian et al., 2024): b_i = mean of the other G-1 rewards of
  the group, which removes that bias. Equal to G/(G-1) * (r - group mean).
- GRPO (Shao et al., 2024): (r - group mean) / (group std + eps), std unbiased (torch's
  default). Dr. GRPO (Liu et al., 2025): no std scaling.
- GAE (Schulman et al., 2015): delta_t = r_t + gamma V_{t+1} - V_t,
  A_t = delta_t + gamma lam A_{t+1}, with V = 0 after the last token (seed 002's loop).

Departures: a group whose rewards are all equal gets exactly 0 (the float mean of equal
values need not equal them, and eps would turn that rounding into a tiny signal); G == 1
gives zeros. GAE skips masked-out positions instead of treating them as episode ends, so
right padding and masked gaps (e.g. tool output) both work; it runs under no_grad (its
outputs are regression targets) and does not whiten. Results are float32 (float64 kept).
"""
from __future__ import annotations

from typing import Callable, Dict

import torch

from ._util import acc_dtype, keep, upcast

__all__ = ["group_advantages", "rloo_advantages", "reinforce_advantages",
           "reinforce_baseline_advantages", "gae", "broadcast_to_tokens",
           "ADVANTAGE_ESTIMATORS", "get_advantage_estimator"]


def _zero_constant_groups(adv: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    constant = (rewards == rewards[:, :1]).all(-1, keepdim=True)  # [B, 1]
    return torch.where(constant, torch.zeros_like(adv), adv)  # [B, G]


def group_advantages(rewards: torch.Tensor, scale_std: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """GRPO group-normalised advantages. rewards [B, G] -> [B, G]."""
    r = upcast(rewards)  # [B, G]
    if r.shape[-1] < 2:
        return torch.zeros_like(r)
    adv = r - r.mean(-1, keepdim=True)  # [B, G]
    if scale_std:
        adv = adv / (r.std(-1, keepdim=True) + eps)  # unbiased std
    return _zero_constant_groups(adv, r)


def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """r_i minus the mean of the other G-1 rewards of its group. [B, G] -> [B, G]."""
    r = upcast(rewards)  # [B, G]
    g = r.shape[-1]
    if g < 2:
        return torch.zeros_like(r)
    loo_mean = (r.sum(-1, keepdim=True) - r) / (g - 1)  # [B, G]
    return _zero_constant_groups(r - loo_mean, r)


def reinforce_advantages(rewards: torch.Tensor, eps: float = 0.0) -> torch.Tensor:
    """Plain REINFORCE: the advantage is the reward. [B, G] -> [B, G]."""
    return upcast(rewards).clone()


def reinforce_baseline_advantages(rewards: torch.Tensor, eps: float = 0.0) -> torch.Tensor:
    """Reward minus the mean over the whole batch (all B*G completions). [B, G] -> [B, G]."""
    r = upcast(rewards)
    return r - r.mean()


# Outcome estimators: uniform signature fn(rewards [B, G], eps) -> [B, G].
ADVANTAGE_ESTIMATORS: Dict[str, Callable[[torch.Tensor, float], torch.Tensor]] = {
    "reinforce": reinforce_advantages,
    "reinforce_baseline": reinforce_baseline_advantages,
    "rloo": lambda rewards, eps=1e-6: rloo_advantages(rewards),
    "grpo": lambda rewards, eps=1e-6: group_advantages(rewards, True, eps),
    "dr_grpo": lambda rewards, eps=1e-6: group_advantages(rewards, False, eps),
}


def get_advantage_estimator(name: str) -> Callable[[torch.Tensor, float], torch.Tensor]:
    """Outcome estimator by config name ("-" and "_" interchangeable); ValueError if unknown."""
    key = name.replace("-", "_")
    if key in ADVANTAGE_ESTIMATORS:
        return ADVANTAGE_ESTIMATORS[key]
    hint = (" 'gae' is token-level (needs values and a mask): call rlctl.core.gae."
            if key == "gae" else "")
    raise ValueError(f"unknown advantage estimator {name!r}; valid outcome estimators: "
                     f"{', '.join(sorted(ADVANTAGE_ESTIMATORS))}.{hint}")


def broadcast_to_tokens(adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Give every counted token its completion's advantage. adv [B, G] or [N], mask [N, T]."""
    flat = upcast(adv).reshape(-1)  # [N]
    if flat.shape[0] != mask.shape[0]:
        raise ValueError(f"advantages hold {flat.shape[0]} values but mask has "
                         f"{mask.shape[0]} rows")
    return flat[:, None] * upcast(mask, flat.dtype)  # [N, T]


@torch.no_grad()
def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation, vectorised over N, backward loop over T.

    rewards, values, mask [N, T] -> (advantages [N, T], returns [N, T]), with
    returns = advantages + values and advantages = 0 where mask == 0. The value after a
    sequence's last counted token is 0.
    """
    dtype = acc_dtype(rewards, values)
    r, v = upcast(rewards, dtype), upcast(values, dtype)  # [N, T]
    m = keep(mask)  # [N, T] bool
    n, t_len = r.shape
    next_value = r.new_zeros(n)  # [N] V of the next counted token (0 past the end)
    running = r.new_zeros(n)  # [N] A of the next counted token
    out = []
    for t in reversed(range(t_len)):
        delta = r[:, t] + gamma * next_value - v[:, t]  # [N]
        running = torch.where(m[:, t], delta + gamma * lam * running, running)
        next_value = torch.where(m[:, t], v[:, t], next_value)
        out.append(torch.where(m[:, t], running, torch.zeros_like(running)))
    adv = torch.stack(out[::-1], dim=-1) if out else r.new_zeros(n, 0)  # [N, T]
    return adv, adv + v
