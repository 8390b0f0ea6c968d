"""Advantage estimators (docs/math.md, sections 3, 6 and 9): REINFORCE (Williams, 1992), RLOO
(Kool et al., 2019), GRPO (Shao et al., 2024), Dr. GRPO (Liu et al., 2025), DAPO's overlong
penalty (Yu et al., 2025), GAE (Schulman et al., 2015). A group of equal rewards gets 0.
``ADVANTAGE_ESTIMATORS`` signatures by ``level``: rlctl.registry's module docstring."""
from __future__ import annotations

import torch

from rlctl.registry import Registry

from .logprobs import acc_dtype, upcast

# ``group``: the estimator compares a completion with the others of its group (G >= 2 needed)
ADVANTAGE_ESTIMATORS = Registry("advantage estimator",
                                attrs={"level": ("outcome", "token"), "group": (False, True)},
                                dashes=True)
register_advantage = ADVANTAGE_ESTIMATORS.register

REINFORCE_BASELINES = ("none", "batch_mean")


def zero_std_groups(rewards: torch.Tensor) -> torch.Tensor:
    """Groups whose rewards are all exactly equal (no learning signal). [B, G] -> [B] bool."""
    return (rewards == rewards[:, :1]).all(-1)  # [B]


def group_advantages(rewards: torch.Tensor, scale_std: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """GRPO group-normalised advantages. rewards [B, G] -> [B, G]."""
    r = upcast(rewards)  # [B, G]
    if r.shape[-1] < 2:
        return torch.zeros_like(r)
    adv = r - r.mean(-1, keepdim=True)  # [B, G]
    if scale_std:
        adv = adv / (r.std(-1, keepdim=True) + eps)  # unbiased std
    constant = (r == r[:, :1]).all(-1, keepdim=True)  # [B, 1] zero_std_groups
    return torch.where(constant, torch.zeros_like(adv), adv)  # [B, G]


@register_advantage("rloo", group=True)
def rloo_advantages(rewards: torch.Tensor, eps: float = 0.0, **ignored) -> torch.Tensor:
    """r_i minus the mean of the other G-1 rewards of its group (eps unused). [B, G] -> [B, G]."""
    r = upcast(rewards)  # [B, G]
    g = r.shape[-1]
    if g < 2:
        return torch.zeros_like(r)
    loo_mean = (r.sum(-1, keepdim=True) - r) / (g - 1)  # [B, G]
    constant = (r == r[:, :1]).all(-1, keepdim=True)  # [B, 1] zero_std_groups
    return torch.where(constant, torch.zeros_like(r), r - loo_mean)  # [B, G]


@register_advantage("grpo", group=True)
def grpo_advantages(rewards: torch.Tensor, eps: float = 1e-6, **ignored) -> torch.Tensor:
    """GRPO: group_advantages with std scaling. [B, G] -> [B, G]."""
    return group_advantages(rewards, True, eps)


@register_advantage("dr_grpo", group=True)
def dr_grpo_advantages(rewards: torch.Tensor, eps: float = 1e-6, **ignored) -> torch.Tensor:
    """Dr. GRPO: r - group mean, no std scaling (eps unused). [B, G] -> [B, G]."""
    return group_advantages(rewards, False, eps)


@register_advantage("reinforce")
def reinforce_advantages(rewards: torch.Tensor, eps: float = 0.0, baseline: str = "none",
                         **ignored) -> torch.Tensor:
    """REINFORCE: A = R ("none") or R - mean of all B*G rewards ("batch_mean").
    [B, G] -> [B, G]; ValueError listing REINFORCE_BASELINES for another baseline."""
    if baseline not in REINFORCE_BASELINES:
        raise ValueError(f"unknown REINFORCE baseline {baseline!r}; valid: "
                         f"{', '.join(sorted(REINFORCE_BASELINES))}")
    r = upcast(rewards)  # [B, G]
    if baseline == "batch_mean":
        return r - r.mean() if r.numel() else r.clone()  # b = mean of all B*G rewards
    return r.clone()


@register_advantage("reinforce_baseline")
def reinforce_baseline_advantages(rewards: torch.Tensor, eps: float = 0.0,
                                  **ignored) -> torch.Tensor:
    """reinforce with baseline="batch_mean" (a `baseline` option is ignored). [B, G] -> [B, G]."""
    return reinforce_advantages(rewards, eps, baseline="batch_mean")


# by config name ("-" and "_" interchangeable) or "package.module:function"; ValueError if unknown
get_advantage_estimator = ADVANTAGE_ESTIMATORS.get


def broadcast_to_tokens(adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Give every counted token its completion's advantage. adv [B, G] or [N], mask [N, T]."""
    flat = upcast(adv).reshape(-1)  # [N]
    if flat.shape[0] != mask.shape[0]:
        raise ValueError(f"advantages hold {flat.shape[0]} values but mask has "
                         f"{mask.shape[0]} rows")
    return flat[:, None] * upcast(mask, flat.dtype)  # [N, T]


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int,
                     penalty: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment, added to the task reward. lengths [N] -> [N]: 0 for
    L <= max_len - buffer, (max_len - buffer - L) / buffer * penalty inside the buffer,
    -penalty beyond max_len (buffer 0: a cliff)."""
    if buffer < 0 or buffer > max_len:
        raise ValueError(f"overlong buffer must be in [0, max_len={max_len}], got {buffer}")
    length = upcast(lengths)  # [N]
    start = float(max_len - buffer)
    ramp = (start - length) / max(buffer, 1) * penalty  # [N]
    out = torch.where(length > start, ramp, torch.zeros_like(length))
    return torch.where(length > max_len, torch.full_like(length, -penalty), out)


@register_advantage("gae", level="token")
@torch.no_grad()
def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE, vectorised over N, backward loop over T. rewards, values, mask [N, T] ->
    (advantages [N, T], returns = advantages + values), advantages 0 off the mask."""
    dtype = acc_dtype(rewards, values)
    r, v = upcast(rewards, dtype), upcast(values, dtype)  # [N, T]
    m = mask != 0  # [N, T] bool
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
