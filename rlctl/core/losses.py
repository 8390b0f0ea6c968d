"""Policy and value losses (docs/math.md, sections 4 and 6). Each returns a per-token loss
[N, T] plus detached metrics; the `*_loss` wrappers aggregate it with
`aggregation.aggregate`.

- PPO clipped surrogate (Schulman et al., 2017), per token
  -min(rho * A, clip(rho, 1 - clip_low, 1 + clip_high) * A), rho = exp(logp - old_logp);
  asymmetric clips as DAPO's clip-higher (Yu et al., 2025).
- Dual clip (Ye et al., 2020; verl's `clip_ratio_c`): c > 1 caps a token with A < 0 at
  -A * c.
- Vanilla policy gradient (Williams, 1992): -A * logp; PPO's gradient at rho == 1.
- Value loss: 0.5 * (V - R)^2, optionally PPO2's value clipping (as CleanRL's ppo.py).
- GSPO and CISPO: `policy_variants.py`.

``POLICY_LOSSES`` entries (``@register_policy_loss(name)``) are fn(logp, old_logp,
advantages, mask, clip_low, clip_high, clip_ratio_c=None) -> (loss_mat [N, T], metrics);
``get_policy_loss`` also takes "package.module:function". Metrics: the schema of
`_policy.py`; for PPO low = A < 0 and rho < 1 - clip_low, high = A > 0 and
rho > 1 + clip_high, dual = A < 0 and rho > c. The value loss gives value/clip_frac.

Departures: the log-ratio is zeroed off the mask and clamped to [-20, 20] before exp (no
inf/NaN from padding). Advantages, old log-probs, old values and returns are detached
here."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ._policy import (Metrics, check_clip_ratio_c, clip_metrics, dual_clip, token_adv,
                      token_log_ratio, zero_out)
from ._util import acc_dtype, keep, upcast
from .aggregation import aggregate
from .logprobs import masked_mean
from .policy_variants import POLICY_LOSSES, register_policy_loss

__all__ = ["ppo_clip_per_token", "vanilla_pg_per_token", "ppo_clip_loss", "vanilla_pg_loss",
           "POLICY_LOSSES", "register_policy_loss", "get_policy_loss", "value_loss_per_token",
           "value_loss", "explained_variance"]


@register_policy_loss("ppo_clip")
def ppo_clip_per_token(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                       mask: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.2,
                       clip_ratio_c: Optional[float] = None) -> Tuple[torch.Tensor, Metrics]:
    """PPO clipped surrogate per token, with an optional dual clip (c = clip_ratio_c > 1:
    tokens with A < 0 have their loss capped at c * |A|, zero gradient there).

    logp, old_logp, mask [N, T]; advantages [N, T] or [N] -> (loss_mat [N, T], 0 where
    mask == 0; metrics)."""
    check_clip_ratio_c(clip_ratio_c)
    dtype = acc_dtype(logp, old_logp, advantages)
    m = keep(mask)
    adv = token_adv(advantages, mask, dtype)  # [N, T]
    log_ratio = token_log_ratio(upcast(logp, dtype), old_logp, m)  # [N, T]
    ratio = torch.exp(log_ratio)  # [N, T]
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss, capped = dual_clip(torch.maximum(pg_unclipped, pg_clipped), adv, ratio,
                             clip_ratio_c)  # [N, T]
    low = (adv < 0) & (ratio < 1.0 - clip_low)  # [N, T] clipped branch active
    high = (adv > 0) & (ratio > 1.0 + clip_high)
    return zero_out(loss, m), clip_metrics(log_ratio, mask, low, high, capped)


@register_policy_loss("vanilla_pg")
def vanilla_pg_per_token(logp: torch.Tensor, old_logp: Optional[torch.Tensor],
                         advantages: torch.Tensor, mask: torch.Tensor,
                         clip_low: float = 0.2, clip_high: float = 0.2,
                         clip_ratio_c: Optional[float] = None, **ignored
                         ) -> Tuple[torch.Tensor, Metrics]:
    """REINFORCE per token: -A * logp (clip arguments ignored; clip fractions are 0).
    approx_kl is still reported against old_logp when given."""
    dtype = acc_dtype(logp, advantages)
    m = keep(mask)
    lp = upcast(logp, dtype)
    adv = token_adv(advantages, mask, dtype)  # [N, T]
    loss_mat = zero_out(-adv * lp, m)  # [N, T]
    log_ratio = (torch.zeros_like(lp) if old_logp is None
                 else token_log_ratio(lp, old_logp, m))  # [N, T]
    never = torch.zeros_like(m)
    return loss_mat, clip_metrics(log_ratio, mask, never, never)


def get_policy_loss(name: str):
    """Per-token policy loss by config name ("-" and "_" interchangeable) or import path
    "package.module:function"; ValueError listing the valid names if unknown."""
    return POLICY_LOSSES.get(name)


def ppo_clip_loss(logp, old_logp, advantages, mask, clip_low: float = 0.2,
                  clip_high: float = 0.2, agg_mode: str = "token-mean",
                  norm_len: int | None = None, clip_ratio_c: Optional[float] = None
                  ) -> Tuple[torch.Tensor, Metrics]:
    """Aggregated PPO clipped loss (optionally dual-clipped) -> (scalar loss, metrics)."""
    loss_mat, metrics = ppo_clip_per_token(logp, old_logp, advantages, mask, clip_low,
                                           clip_high, clip_ratio_c)
    return aggregate(loss_mat, mask, agg_mode, norm_len), metrics


def vanilla_pg_loss(logp, old_logp, advantages, mask, agg_mode: str = "token-mean",
                    norm_len: int | None = None, **ignored) -> Tuple[torch.Tensor, Metrics]:
    """Aggregated REINFORCE loss -> (scalar loss, metrics)."""
    loss_mat, metrics = vanilla_pg_per_token(logp, old_logp, advantages, mask)
    return aggregate(loss_mat, mask, agg_mode, norm_len), metrics


def value_loss_per_token(values: torch.Tensor, old_values: Optional[torch.Tensor],
                         returns: torch.Tensor, mask: torch.Tensor,
                         clip: float | None = None) -> Tuple[torch.Tensor, Metrics]:
    """0.5 * (V - R)^2 per token, or with clipping 0.5 * max((V - R)^2, (V_clip - R)^2),
    V_clip = old_V + clip(V - old_V, -clip, clip). values, old_values, returns, mask
    [N, T] -> (loss_mat [N, T], {"value/clip_frac"}: fraction of counted tokens where
    the clipped error is the larger one; 0 without clipping)."""
    dtype = acc_dtype(values, returns)
    m = keep(mask)
    v = upcast(values, dtype)
    ret = upcast(returns, dtype).detach()
    err = (v - ret) ** 2  # [N, T]
    if clip is None:
        loss_mat = 0.5 * err
        clip_frac = torch.zeros((), dtype=dtype, device=v.device)
    else:
        old = upcast(old_values, dtype).detach()
        v_clipped = old + (v - old).clamp(-clip, clip)  # [N, T]
        err_clipped = (v_clipped - ret) ** 2
        loss_mat = 0.5 * torch.maximum(err, err_clipped)
        # the clipped branch is taken only where the clamp moved V (old + (V - old) can
        # differ from V by rounding, which must not count as clipping)
        taken = ((v - old).abs() > clip) & (err_clipped > err)  # [N, T]
        clip_frac = masked_mean(taken.to(dtype), mask).detach()
    return zero_out(loss_mat, m), {"value/clip_frac": clip_frac}


def value_loss(values, old_values, returns, mask, clip: float | None = None,
               agg_mode: str = "token-mean", norm_len: int | None = None
               ) -> Tuple[torch.Tensor, Metrics]:
    """Aggregated value loss -> (scalar loss, {"value/clip_frac"})."""
    loss_mat, metrics = value_loss_per_token(values, old_values, returns, mask, clip)
    return aggregate(loss_mat, mask, agg_mode, norm_len), metrics


@torch.no_grad()
def explained_variance(values: torch.Tensor, returns: torch.Tensor,
                       mask: torch.Tensor) -> torch.Tensor:
    """1 - Var[R - V] / Var[R] over counted tokens (CleanRL's metric); 0 if Var[R] == 0."""
    dtype = acc_dtype(values, returns)
    v, ret = upcast(values, dtype), upcast(returns, dtype)
    var_r = masked_mean((ret - masked_mean(ret, mask)) ** 2, mask)
    res = ret - v
    var_res = masked_mean((res - masked_mean(res, mask)) ** 2, mask)
    return torch.where(var_r > 0, 1.0 - var_res / var_r.clamp(min=1e-30),
                       torch.zeros_like(var_r))
