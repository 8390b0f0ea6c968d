"""Loss aggregation: a per-token loss [N, T] to one scalar (docs/math.md, section 8). DAPO
(Yu et al., 2025): token-mean; GRPO (Shao et al., 2024): seq-mean-token-mean; Dr. GRPO
(Liu et al., 2025): the constant normaliser. Names follow verl's `loss_agg_mode`.

    token-mean              sum(mask * loss) / sum(mask)
    seq-mean-token-mean     mean over non-empty rows of each row's masked mean
    seq-mean-token-sum      mean over non-empty rows of each row's masked sum
    seq-mean-token-sum-norm seq-mean-token-sum / norm_len   (norm_len default: T)

Empty rows are left out of the seq-mean modes; denominators are clamped at 1 (an all-zero
mask gives 0). aggregate = aggregate_sum / agg_denominator, and aggregate_sum sums over
rows, so micro-batch sums over the full batch's denominator equal the full aggregate
exactly (pass the same norm_len to both)."""
from __future__ import annotations

import torch

from ._util import acc_dtype, upcast
from .logprobs import masked_sum

__all__ = ["AGG_MODES", "AGG_ALIASES", "resolve_agg_mode", "aggregate", "aggregate_sum",
           "agg_denominator"]

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
             "seq-mean-token-sum-norm")

# Peers spell the modes with underscores (e.g. "seq_mean_token_mean").
AGG_ALIASES = {m.replace("-", "_"): m for m in AGG_MODES}


def resolve_agg_mode(mode: str) -> str:
    """Canonical mode name for `mode` or an alias; ValueError listing valid names."""
    canon = AGG_ALIASES.get(mode, mode)
    if canon not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; valid: {', '.join(AGG_MODES)}"
                         f" (underscore spellings accepted)")
    return canon


def _rows_with_tokens(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (upcast(mask, dtype).sum(-1) > 0).to(dtype).sum()  # scalar


def aggregate_sum(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str,
                  norm_len: int | None = None) -> torch.Tensor:
    """Numerator of `aggregate`, a sum over rows. loss_mat, mask [N, T] -> scalar (float32,
    float64 kept); `norm_len` only enters the denominator."""
    mode = resolve_agg_mode(mode)
    if mode == "seq-mean-token-mean":
        dtype = acc_dtype(loss_mat, mask)
        row_len = upcast(mask, dtype).sum(-1).clamp(min=1.0)  # [N]
        return (masked_sum(loss_mat, mask, dim=-1) / row_len).sum()
    # token-mean, seq-mean-token-sum(-norm): the plain masked sum
    return masked_sum(loss_mat, mask)


def agg_denominator(mask: torch.Tensor, mode: str, norm_len: int | None = None
                    ) -> torch.Tensor:
    """Denominator of `aggregate` (detached scalar, >= 1 or norm_len), from the mask only."""
    mode = resolve_agg_mode(mode)
    dtype = acc_dtype(mask)
    if mode == "token-mean":
        den = upcast(mask, dtype).sum()
    else:
        den = _rows_with_tokens(mask, dtype)
    den = den.clamp(min=1.0)
    if mode == "seq-mean-token-sum-norm":
        den = den * float(mask.shape[-1] if norm_len is None else norm_len)
    return den.detach()


def aggregate(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean",
              norm_len: int | None = None) -> torch.Tensor:
    """Aggregate a per-token loss [N, T] with `mask` [N, T] into a scalar (see module doc)."""
    return aggregate_sum(loss_mat, mask, mode, norm_len) / agg_denominator(mask, mode,
                                                                           norm_len)
