"""Private helpers shared by the policy losses (`losses.py`, `policy_variants.py`), and
their one metric schema: policy/clip_frac_low, policy/clip_frac_high, policy/clip_frac
(their sum), policy/clip_frac_dual (A < 0 capped by the dual clip), policy/approx_kl
(masked mean of k3(old -> new) = (rho - 1) - log rho)."""
from __future__ import annotations

from typing import Dict, Optional

import torch

from ._util import upcast
from .logprobs import masked_mean

Metrics = Dict[str, torch.Tensor]
LOG_RATIO_CLAMP = 20.0


def token_adv(advantages: torch.Tensor, mask: torch.Tensor, dtype) -> torch.Tensor:
    """Detached advantages as [N, T] ([N] is broadcast along T), 0 where mask == 0 (so
    garbage there cannot turn a zero upstream gradient into NaN)."""
    adv = upcast(advantages, dtype).detach()
    adv = adv[:, None].expand(mask.shape) if adv.dim() == 1 else adv  # [N, T]
    return zero_out(adv, mask != 0)


def zero_out(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """x where m, else 0 (torch.where: a NaN at a dropped position cannot leak)."""
    return torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))


def token_log_ratio(lp: torch.Tensor, old_logp: torch.Tensor, m: torch.Tensor
                    ) -> torch.Tensor:
    """log rho = logp - sg(old_logp), 0 where m is False, clamped to +-20. [N, T]."""
    diff = lp - upcast(old_logp, lp.dtype).detach()  # [N, T]
    return zero_out(diff, m).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def check_clip_ratio_c(clip_ratio_c: Optional[float]) -> None:
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c (dual clip) must be > 1 or None, got {clip_ratio_c!r}")


def dual_clip(loss: torch.Tensor, adv: torch.Tensor, ratio: torch.Tensor,
              clip_ratio_c: Optional[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Dual clip (Ye et al., 2020): for A < 0 the loss is min(loss, -A * c).
    loss, adv, ratio [N, T] -> (loss [N, T], capped [N, T] bool); capped tokens get no
    gradient."""
    if clip_ratio_c is None:
        return loss, torch.zeros_like(loss, dtype=torch.bool)
    check_clip_ratio_c(clip_ratio_c)
    cap = -adv * clip_ratio_c  # [N, T]
    capped = (adv < 0) & (loss > cap)
    return torch.where(adv < 0, torch.minimum(loss, cap), loss), capped.detach()


def clip_metrics(log_ratio: torch.Tensor, mask: torch.Tensor, low: torch.Tensor,
                 high: torch.Tensor, dual: Optional[torch.Tensor] = None) -> Metrics:
    """The shared metric dict (detached). log_ratio [N, T]; low, high, dual [N, T] bool."""
    with torch.no_grad():
        log_ratio = log_ratio.detach()
        dtype = log_ratio.dtype
        frac_low = masked_mean(low.to(dtype), mask)
        frac_high = masked_mean(high.to(dtype), mask)
        frac_dual = (masked_mean(dual.to(dtype), mask) if dual is not None
                     else torch.zeros((), dtype=dtype, device=log_ratio.device))
        approx_kl = masked_mean(torch.expm1(log_ratio) - log_ratio, mask)
    return {"policy/clip_frac_low": frac_low, "policy/clip_frac_high": frac_high,
            "policy/clip_frac": frac_low + frac_high, "policy/clip_frac_dual": frac_dual,
            "policy/approx_kl": approx_kl}
