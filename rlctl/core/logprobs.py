"""Token log-probs, entropy, masked statistics and completion masks (docs/math.md,
section 1). `token_logprobs` computes gather(logits) - logsumexp(logits) in chunks of
rows, never a second [N, T, V] tensor. Masked statistics clamp denominators at 1 (empty
gives 0, never NaN) and drop masked positions with `torch.where` (no NaN leaks)."""
from __future__ import annotations

from typing import Sequence

import torch

from ._util import acc_dtype, keep, upcast

__all__ = ["token_logprobs", "entropy_from_logits", "masked_mean", "masked_sum",
           "masked_whiten", "completion_mask", "counted_width"]


CHUNK_ELEMENTS = 1 << 22   # rows per chunk: as many as fit in 4M elements (at least one)


def _rowwise(logits: torch.Tensor, fn) -> torch.Tensor:
    """Apply `fn` ([..., V] -> [...]) to chunks of rows of [N, T, V], each at most
    ``CHUNK_ELEMENTS`` floats (a large-vocabulary row is its own chunk)."""
    dtype = acc_dtype(logits)
    if logits.shape[0] == 0:
        return logits.new_zeros(logits.shape[:-1], dtype=dtype)
    rows = max(1, CHUNK_ELEMENTS // max(logits[0].numel(), 1))
    if rows >= logits.shape[0]:
        return fn(logits.to(dtype))                                    # [N, T]
    return torch.cat([fn(c.to(dtype)) for c in logits.split(rows)])   # [N, T]


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log pi(tokens[n, t]) where logits[n, t] already scores tokens[n, t].

    logits [N, T, V] (any float dtype), tokens [N, T] long -> [N, T] float32
    (float64 for float64 logits). The caller has done the shift by one.
    """
    picked = logits.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)  # [N, T]
    lse = _rowwise(logits, lambda row: torch.logsumexp(row, dim=-1))  # [N, T]
    return upcast(picked, lse.dtype) - lse  # [N, T]


def _entropy_row(row: torch.Tensor) -> torch.Tensor:
    # H = logsumexp(z) - sum_v softmax(z)_v * z_v   (stable: no log of a tiny p)
    p = torch.softmax(row, dim=-1)  # [..., T, V]
    return torch.logsumexp(row, dim=-1) - (p * row).sum(-1)  # [..., T]


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution. logits [N, T, V] -> [N, T] float32."""
    return _rowwise(logits, _entropy_row)


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """sum(x * mask) over `dim` (all dims if None), in float32; ignores NaN where mask==0."""
    dtype = acc_dtype(x, mask)
    w = upcast(mask, dtype)
    xw = torch.where(keep(mask), upcast(x, dtype) * w, torch.zeros((), dtype=dtype,
                                                                 device=x.device))
    return xw.sum() if dim is None else xw.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """sum(x * mask) / max(sum(mask), 1): an empty mask (or row) gives 0, not NaN."""
    dtype = acc_dtype(x, mask)
    count = upcast(mask, dtype)
    count = count.sum() if dim is None else count.sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1.0)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True,
                  eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the masked-in entries (var unbiased, as TRL).

    shift_mean=False adds the mean back (only rescales). Masked-out positions are 0.
    Fewer than 2 masked-in entries: variance taken as 0 (no NaN). Returns x.dtype.
    """
    mean = masked_mean(x, mask)
    centred = upcast(x, mean.dtype) - mean
    n = upcast(mask, mean.dtype).sum()
    var = masked_sum(centred ** 2, mask) / (n - 1).clamp(min=1.0)
    out = centred * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(keep(mask), out, torch.zeros_like(out)).to(x.dtype)


def counted_width(mask: torch.Tensor) -> torch.Tensor:
    """Each row's width: its last counted column + 1 (0 for a row with nothing counted).
    mask [N, T] -> [N] long. Equal to ``mask.sum(-1)`` when a row's counted tokens are
    contiguous from column 0 (single-turn completions); larger when masked gaps
    (multi-turn observations) lie between them."""
    n, t_len = mask.shape
    if t_len == 0:
        return torch.zeros(n, dtype=torch.long, device=mask.device)
    cols = torch.arange(1, t_len + 1, device=mask.device)                # [T]
    return torch.where(keep(mask), cols, 0).max(-1).values               # [N]


def completion_mask(completion_ids: torch.Tensor, eos_id: int | Sequence[int],
                    pad_id: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Which sampled completion tokens count, and which rows hit the length limit.

    completion_ids [N, T] -> (mask [N, T] float32, truncated [N] bool). mask is 1 up to and
    including the first EOS (any id of `eos_id` if a list); a row with no EOS is truncated and
    all T tokens count. Padding never defines the mask (pad_id may equal eos_id); `pad_id`
    is accepted and ignored."""
    ids = completion_ids
    n, t = ids.shape
    many = isinstance(eos_id, (list, tuple, set, frozenset))
    eos_ids = [int(e) for e in eos_id] if many else [int(eos_id)]
    is_eos = torch.isin(ids, torch.tensor(eos_ids, device=ids.device))  # [N, T]
    has_eos = is_eos.any(-1)  # [N]
    last = torch.full((n,), t - 1, dtype=torch.long, device=ids.device)
    first = torch.where(has_eos, is_eos.int().argmax(-1), last)  # [N] argmax: first max
    pos = torch.arange(t, device=ids.device)  # [T]
    mask = pos[None, :] <= first[:, None]  # [N, T]
    return mask.float(), ~has_eos
