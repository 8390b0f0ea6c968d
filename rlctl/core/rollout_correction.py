"""The off-policy correction for a sampler whose probabilities differ from the learner's
(docs/math.md, section 14): detached weights w = pi_old / pi_engine per token or per sequence,
applied as ``truncate``, ``mask`` or ``measure``. [N, T], 0 off the mask."""
from __future__ import annotations

import math
from typing import Dict

import torch

from .logprobs import masked_mean, upcast

CORRECTION_LEVELS = ("token", "sequence")
CORRECTION_MODES = ("truncate", "mask", "measure")


def _log(x: float) -> float:
    return math.log(x) if x > 0 else float("-inf")


def log_importance_weights(old_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor,
                           level: str) -> torch.Tensor:
    """log w [N, T] (detached, 0 off the mask): per token log pi_old - log pi_engine, or at
    sequence level each row's sum of them on every counted token of the row."""
    if level not in CORRECTION_LEVELS:
        raise ValueError(f"rollout correction level must be one of {CORRECTION_LEVELS}; got {level!r}")
    m = mask != 0
    d = torch.where(m, upcast(old_logp.detach()) - upcast(engine_logp.detach()), 0.0)   # [N, T]
    if level == "token":
        return d
    return torch.where(m, d.sum(-1, keepdim=True).expand_as(d), 0.0)                 # [N, T]


def correction_weights(old_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor,
                       level: str, mode: str, upper: float, lower: float = 0.0) -> torch.Tensor:
    """The weight [N, T] that multiplies each token's policy loss (detached; 0 off the
    mask): min(w, upper) (truncate), w * 1[lower <= w <= upper] (mask), 1 (measure).
    Exponentials are taken of log w capped at log(upper), so no weight overflows."""
    if mode not in CORRECTION_MODES:
        raise ValueError(f"rollout correction mode must be one of {CORRECTION_MODES}; got {mode!r}")
    log_w = log_importance_weights(old_logp, engine_logp, mask, level)               # [N, T]
    m = mask != 0
    if mode == "measure":
        return m.to(log_w.dtype)
    capped = torch.exp(log_w.clamp(max=_log(upper)))                                  # [N, T]
    if mode == "mask":
        inside = (log_w >= _log(lower)) & (log_w <= _log(upper))
        capped = torch.where(inside, capped, 0.0)
    return torch.where(m, capped, 0.0)


def mismatch_metrics(old_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor,
                     level: str, mode: str, upper: float, lower: float = 0.0
                     ) -> Dict[str, torch.Tensor]:
    """How far the engine is from the old policy on the counted tokens (docs/metrics.md):
    ``k3`` (KL(pi_engine || pi_old)), ``ppl_gap``, ``ess`` in (0, 1], ``log_w_abs_mean``,
    ``truncated_frac`` or ``masked_frac``, ``weight_mean``; empty mask: 0 (ess 1)."""
    m = mask != 0
    d = log_importance_weights(old_logp, engine_logp, mask, "token")                  # [N, T]
    out = {"k3": masked_mean((torch.expm1(d) - d).clamp(min=0.0), mask)}
    nll_engine = masked_mean(torch.where(m, -upcast(engine_logp.detach()), 0.0), mask)
    nll_old = masked_mean(torch.where(m, -upcast(old_logp.detach()), 0.0), mask)
    out["ppl_gap"] = torch.exp(nll_engine) - torch.exp(nll_old)
    if level not in CORRECTION_LEVELS:
        raise ValueError(f"rollout correction level must be one of {CORRECTION_LEVELS}; got {level!r}")
    lw = d[m] if level == "token" else d.sum(-1)[m.any(-1)]    # [n] log w per unit (host sync)
    n = lw.numel()
    if n == 0:
        zero = d.new_zeros(())
        out.update(ess=d.new_ones(()), log_w_abs_mean=zero, weight_mean=zero)
        out.update({"truncated_frac": zero} if mode == "truncate" else
                   {"masked_frac": zero} if mode == "mask" else {})
        return out
    # (sum w)^2 / (n sum w^2) in log space: 2 logsumexp(lw) - logsumexp(2 lw) - log n
    out["ess"] = torch.exp(2 * torch.logsumexp(lw, 0) - torch.logsumexp(2 * lw, 0) - math.log(n))
    out["log_w_abs_mean"] = lw.abs().mean()
    applied = correction_weights(lw[None], lw.new_zeros(1, n), lw.new_ones(1, n), "token",
                                 mode, upper, lower)[0]                                # [n]
    out["weight_mean"] = applied.mean()
    if mode == "truncate":
        out["truncated_frac"] = (lw > _log(upper)).to(lw.dtype).mean()
    elif mode == "mask":
        out["masked_frac"] = ((lw < _log(lower)) | (lw > _log(upper))).to(lw.dtype).mean()
    return out
