"""PPO-family variants that change the importance weight: GSPO and CISPO (docs/math.md,
section 5). Both have the policy-loss signature and `_policy.py`'s metric schema, and are
registered in ``POLICY_LOSSES`` (defined here, the module every policy loss imports).

GSPO (Zheng et al., 2025, "Group Sequence Policy Optimization"), the GSPO-token form:
    s_i     = exp(1/|y_i| * sum_t (logp_t - old_logp_t))   (geometric mean of token ratios)
    s_{i,t} = sg[s_i] * pi(y_{i,t}) / sg[pi(y_{i,t})]       (value s_i, d/d logp_t = s_i)
    J       = 1/G sum_i 1/|y_i| sum_t min(s_{i,t} A_i, clip(s_{i,t}, 1-lo, 1+hi) A_i)
  so the clip acts on whole sequences. seq-mean-token-mean aggregation gives the paper's
  objective. One advantage per sequence: [N] as given, [N, T] by its masked row mean.
  The dual clip caps -A_i * c where A_i < 0 and s_i > c. Clip fractions count every token
  of a clipped sequence. Paper's default clips: (3e-4, 4e-4).

CISPO (MiniMax, 2025, "MiniMax-M1"): clip the importance weight, never the gradient:
    loss_t = -sg[clip(rho_t, 1 - lo, 1 + hi)] * A_t * logp_t,  rho_t = exp(logp_t - old_t)
  Every token keeps a gradient; the paper aggregates with token-mean. clip_ratio_c is
  ignored; clip fractions count tokens whose weight was clipped. approx_kl is always
  token-level k3 of old -> new."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from rlctl.registry import Registry

from ._policy import (Metrics, check_clip_ratio_c, clip_metrics, dual_clip, token_adv,
                      token_log_ratio, zero_out)
from ._util import acc_dtype, keep, upcast
from .logprobs import masked_mean

__all__ = ["gspo_per_token", "cispo_per_token", "POLICY_LOSSES", "register_policy_loss"]

POLICY_LOSSES = Registry("policy loss", dashes=True)
register_policy_loss = POLICY_LOSSES.register


def _row_adv(advantages: torch.Tensor, mask: torch.Tensor, dtype) -> torch.Tensor:
    """One advantage per sequence: [N] as given, [N, T] by its masked row mean. -> [N]."""
    adv = upcast(advantages, dtype).detach()
    return adv if adv.dim() == 1 else masked_mean(adv, mask, dim=-1).to(dtype)


@register_policy_loss("gspo")
def gspo_per_token(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                   mask: torch.Tensor, clip_low: float = 3e-4, clip_high: float = 4e-4,
                   clip_ratio_c: Optional[float] = None) -> Tuple[torch.Tensor, Metrics]:
    """GSPO-token loss per token (see module doc). logp, old_logp, mask [N, T];
    advantages [N] or [N, T] -> (loss_mat [N, T], 0 where mask == 0; metrics)."""
    check_clip_ratio_c(clip_ratio_c)
    dtype = acc_dtype(logp, old_logp, advantages)
    m = keep(mask)
    lp = zero_out(upcast(logp, dtype), m)  # [N, T]
    log_ratio = token_log_ratio(lp, old_logp, m)  # [N, T]
    seq_log_ratio = masked_mean(log_ratio, mask, dim=-1).to(dtype).detach()  # [N] log s_i
    # s_{i,t} = sg[s_i] * exp(logp_t - sg[logp_t]): value s_i, d/d logp_t = s_i
    s_tok = torch.exp(seq_log_ratio[:, None] + (lp - lp.detach()))  # [N, T]
    adv_row = zero_out(_row_adv(advantages, mask, dtype), m.any(-1))  # [N]
    adv = adv_row[:, None].expand(mask.shape)  # [N, T]
    pg_unclipped = -adv * s_tok
    pg_clipped = -adv * s_tok.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss, capped = dual_clip(torch.maximum(pg_unclipped, pg_clipped), adv, s_tok.detach(),
                             clip_ratio_c)  # [N, T]
    s = s_tok.detach()  # [N, T], s_i on every token of row i
    low = (adv < 0) & (s < 1.0 - clip_low)
    high = (adv > 0) & (s > 1.0 + clip_high)
    return zero_out(loss, m), clip_metrics(log_ratio, mask, low, high, capped)


@register_policy_loss("cispo")
def cispo_per_token(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.2,
                    clip_ratio_c: Optional[float] = None) -> Tuple[torch.Tensor, Metrics]:
    """CISPO loss per token: -sg[clip(rho)] * A * logp (see module doc; clip_ratio_c is
    ignored). logp, old_logp, mask [N, T]; advantages [N, T] or [N] -> (loss_mat [N, T],
    0 where mask == 0; metrics)."""
    dtype = acc_dtype(logp, old_logp, advantages)
    m = keep(mask)
    lp = zero_out(upcast(logp, dtype), m)  # [N, T]
    log_ratio = token_log_ratio(lp, old_logp, m)  # [N, T]
    ratio = torch.exp(log_ratio.detach())  # [N, T], no gradient
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # sg[clip(rho)]
    adv = token_adv(advantages, mask, dtype)  # [N, T]
    loss = -weight * adv * lp  # [N, T]
    low, high = ratio < 1.0 - clip_low, ratio > 1.0 + clip_high
    return zero_out(loss, m), clip_metrics(log_ratio, mask, low, high)
