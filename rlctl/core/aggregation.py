"""Loss aggregation: how a per-token loss matrix [N, T] becomes one scalar.

Sources (formulas in docs/math.md): DAPO (Yu et al., 2025) for
token-mean; GRPO (Shao et al., 2024) for seq-mean-token-mean; Dr. GRPO (Liu et al., 2025)
for the constant length normaliser. Names follow verl's `loss_agg_mode`.

    token-mean              sum(mask * loss) / sum(mask)
    seq-mean-token-mean     mean over rows with >= 1 token of each row's masked mean
    seq-mean-token-sum      mean over rows with >= 1 token of each row's masked sum
    seq-mean-token-sum-norm seq-mean-token-sum / norm_len   (norm_len default: T)

Departures: rows with no counted token are left out of the seq-mean modes (papers average
over all B*G rows; an empty row would otherwise dilute the batch), and every denominator
is clamped at 1 so an all-zero mask gives 0, not NaN.

Exact gradient accumulation: aggregate = aggregate_sum / agg_denominator for every
mode, and aggregate_sum is a sum over rows. So with micro-batches of the rows,
    sum_k aggregate_sum(loss_k, mask_k, mode) / agg_denominator(full_mask, mode)
equals the full-batch aggregate (and so does its gradient). Compute the denominator once
on the whole (mini-)batch mask; pass the same norm_len (default T) to both.
"""
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
    """Numerator of `aggregate`: a sum over rows, so it splits across micro-batches.

    loss_mat, mask [N, T] -> scalar (float32, float64 kept). `norm_len` is accepted for a
    uniform call; it only enters the denominator.
    """
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
