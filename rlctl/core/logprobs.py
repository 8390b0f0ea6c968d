"""Token log-probs, entropy, masked statistics and completion masks (docs/math.md, section 1);
empty masks give 0, never NaN. `chunked_token_logprobs`: the LM head fused into the
log-softmax a chunk at a time (Hsu et al. 2024, arXiv:2410.10989; Wijmans et al. 2024,
arXiv:2411.09009), exact, never more than ``KEEP_ELEMENTS`` logits kept for the backward
(the rest recomputed there), never all [N, T, V] at once beyond that."""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

CHUNK_ELEMENTS = 1 << 22   # rows per chunk: as many as fit in 4M elements (at least one)
KEEP_ELEMENTS = 1 << 24    # logits kept from forward to backward (64 MiB in float32)


def acc_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32."""
    for t in tensors:
        if t.dtype == torch.float64:
            return torch.float64
    return torch.float32


def upcast(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`x` in the accumulation dtype (a no-op for float32 / float64 inputs)."""
    return x.to(dtype or acc_dtype(x))


def _rowwise(logits: torch.Tensor, fn) -> torch.Tensor:
    """`fn` ([..., V] -> [...]) over chunks of rows of [N, T, V] of ``CHUNK_ELEMENTS`` floats."""
    dtype = acc_dtype(logits)
    if logits.shape[0] == 0:
        return logits.new_zeros(logits.shape[:-1], dtype=dtype)
    rows = max(1, CHUNK_ELEMENTS // max(logits[0].numel(), 1))
    if rows >= logits.shape[0]:
        return fn(logits.to(dtype))                                    # [N, T]
    return torch.cat([fn(c.to(dtype)) for c in logits.split(rows)])   # [N, T]


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log pi(tokens[n, t]) where logits[n, t] scores it (shifted by the caller). logits
    [N, T, V], tokens [N, T] long -> [N, T] float32 (float64 kept)."""
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
    xw = torch.where(mask != 0, upcast(x, dtype) * w, torch.zeros((), dtype=dtype,
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
    """(x - mean) / sqrt(var + eps) over the masked-in entries (var unbiased, as TRL), 0 off
    the mask, in x.dtype; shift_mean=False adds the mean back."""
    mean = masked_mean(x, mask)
    centred = upcast(x, mean.dtype) - mean
    n = upcast(mask, mean.dtype).sum()
    var = masked_sum(centred ** 2, mask) / (n - 1).clamp(min=1.0)
    out = centred * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask != 0, out, torch.zeros_like(out)).to(x.dtype)


def counted_width(mask: torch.Tensor) -> torch.Tensor:
    """Each row's last counted column + 1 (0 for an empty row). mask [N, T] -> [N] long."""
    n, t_len = mask.shape
    if t_len == 0:
        return torch.zeros(n, dtype=torch.long, device=mask.device)
    cols = torch.arange(1, t_len + 1, device=mask.device)                # [T]
    return torch.where(mask != 0, cols, 0).max(-1).values                # [N]


def completion_mask(completion_ids: torch.Tensor, eos_id: int | Sequence[int],
                    pad_id: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """completion_ids [N, T] -> (mask [N, T] float32: 1 up to the first EOS (any of `eos_id`)
    inclusive, all T without one; truncated [N] bool). `pad_id` is ignored."""
    ids = completion_ids
    n, t = ids.shape
    many = isinstance(eos_id, (list, tuple, set, frozenset))
    eos_ids = list(map(int, eos_id)) if many else [int(eos_id)]
    is_eos = torch.isin(ids, torch.tensor(eos_ids, device=ids.device))  # [N, T]
    has_eos = is_eos.any(-1)  # [N]
    last = torch.full((n,), t - 1, dtype=torch.long, device=ids.device)
    first = torch.where(has_eos, is_eos.int().argmax(-1), last)  # [N] argmax: first max
    pos = torch.arange(t, device=ids.device)  # [T]
    mask = pos[None, :] <= first[:, None]  # [N, T]
    return mask.float(), ~has_eos


def default_chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk so one chunk's logits hold about ``CHUNK_ELEMENTS`` floats, at least 1."""
    return max(1, CHUNK_ELEMENTS // max(int(vocab_size), 1))


def kept_rows(m: int, vocab: int, chunk: int, keep: int) -> int:
    """Rows of the first chunks whose logits [rows, V] fit in ``keep`` elements: all m rows, or
    whole chunks of ``chunk`` rows."""
    rows = keep // max(vocab, 1)
    return m if rows >= m else rows // chunk * chunk


def _chunk_logits(h_c, weight, bias, temperature, out):
    """(h_c [C, H] @ W^T + b) / temperature written into `out` ([C, V], accumulation dtype);
    bf16 inputs are multiplied in bf16, then upcast."""
    if weight.dtype == out.dtype:
        if bias is None:
            torch.mm(h_c, weight.t(), out=out)  # [C, V]
        else:
            torch.addmm(bias, h_c, weight.t(), out=out)  # [C, V], as F.linear
    else:
        out.copy_(F.linear(h_c, weight, bias))  # [C, V] bf16 -> float32
    return out.div_(temperature) if temperature != 1.0 else out


class _ChunkedLinearLogprobs(torch.autograd.Function):
    """h [M, H], W [V, H], b [V] | None, tokens [M] -> (logp [M], entropy [M] | [0]). The
    backward takes each chunk's logits z as the forward kept them or recomputes them; with
    p = softmax(z), upstream gL (log-prob) and gE (entropy):
    dL/dz = gL * (onehot(y) - p) - gE * p * (log p + H), / temperature."""

    @staticmethod
    def forward(ctx, h, weight, bias, tokens, temperature, chunk, want_entropy, keep):
        acc = acc_dtype(h, weight)
        m = h.shape[0]
        logp = h.new_empty(m, dtype=acc)  # [M]
        lse = h.new_empty(m, dtype=acc)  # [M]
        ent = h.new_empty(m if want_entropy else 0, dtype=acc)  # [M] or [0]
        # the first K rows' logits stay for the backward instead of a second head matmul
        kept = h.new_empty((kept_rows(m, weight.shape[0], chunk, keep), weight.shape[0]),
                           dtype=acc)  # [K, V]
        rows = min(chunk, m) if want_entropy or kept.shape[0] < m else 0
        z_buf = h.new_empty((rows, weight.shape[0]), dtype=acc)  # [C, V]
        p_buf = torch.empty_like(z_buf) if want_entropy else None
        for s in range(0, m, chunk):
            e = min(s + chunk, m)
            out = kept[s:e] if e <= kept.shape[0] else z_buf[:e - s]
            z = _chunk_logits(h[s:e], weight, bias, temperature, out)  # [C, V]
            lse_c = torch.logsumexp(z, dim=-1)  # [C]
            lse[s:e] = lse_c
            logp[s:e] = z.gather(1, tokens[s:e, None]).squeeze(1) - lse_c
            if want_entropy:
                logq = torch.sub(z, lse_c[:, None], out=z_buf[:e - s])  # [C, V] log p
                p = torch.exp(logq, out=p_buf[:e - s])  # [C, V]
                ent[s:e] = -p.mul_(logq).sum(-1)  # [C]  (p = 0 gives 0, not NaN)
        ctx.save_for_backward(h, weight, bias, tokens, lse, ent, kept)
        ctx.temperature, ctx.chunk, ctx.want_entropy = temperature, chunk, want_entropy
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    @once_differentiable
    def backward(ctx, g_logp, g_ent):
        h, weight, bias, tokens, lse, ent, kept = ctx.saved_tensors
        g_ent = g_ent if ctx.want_entropy else None
        if g_logp is None and g_ent is None:
            return None, None, None, None, None, None, None, None
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        acc, m = lse.dtype, h.shape[0]
        grad_h = torch.zeros_like(h) if need_h else None  # [M, H]
        grad_w = weight.new_zeros(weight.shape, dtype=acc) if need_w else None  # [V, H]
        grad_b = bias.new_zeros(bias.shape, dtype=acc) if need_b else None  # [V]
        z_buf = h.new_empty((min(ctx.chunk, m), weight.shape[0]), dtype=acc)  # [C, V]
        p_buf = torch.empty_like(z_buf)
        for s in range(0, m, ctx.chunk):
            e = min(s + ctx.chunk, m)
            gl = None if g_logp is None else g_logp[s:e].to(acc)    # [C]
            ge = None if g_ent is None else g_ent[s:e].to(acc)      # [C]
            if e <= kept.shape[0]:
                logq = torch.sub(kept[s:e], lse[s:e, None], out=z_buf[:e - s])  # [C, V] log p
            else:
                logq = _chunk_logits(h[s:e], weight, bias, ctx.temperature, z_buf[:e - s])
                logq.sub_(lse[s:e, None])  # [C, V] log p
            p = torch.exp(logq, out=p_buf[:e - s])  # [C, V]
            if ge is not None:
                dz = logq.add_(ent[s:e, None]).mul_(p).mul_(-ge[:, None])  # [C, V] entropy part
                if gl is not None:
                    dz.sub_(p.mul_(gl[:, None]))
            else:
                dz = p.mul_(-gl[:, None])  # [C, V]
            if gl is not None:
                dz.scatter_add_(1, tokens[s:e, None], gl[:, None])  # + gl * onehot(y)
            if ctx.temperature != 1.0:
                dz.div_(ctx.temperature)            # dL/d(raw logits) [C, V]
            if grad_h is not None:
                _matmul_into(grad_h[s:e], dz, weight)  # [C, H] = [C, V] @ [V, H]
            if grad_w is not None:
                _matmul_into(grad_w, dz.t(), h[s:e], accumulate=True)  # [V, H]
            if grad_b is not None:
                grad_b += dz.sum(0)  # [V]
        grad_w = grad_w.to(weight.dtype) if grad_w is not None else None
        grad_b = grad_b.to(bias.dtype) if grad_b is not None else None
        return grad_h, grad_w, grad_b, None, None, None, None, None


def _matmul_into(out, a, b, accumulate=False):
    """out (+)= a @ b, in place when the dtypes agree, else in b's dtype and upcast."""
    if a.dtype == b.dtype == out.dtype:
        return out.addmm_(a, b) if accumulate else torch.mm(a, b, out=out)
    prod = (a.to(b.dtype) @ b).to(out.dtype)
    return out.add_(prod) if accumulate else out.copy_(prod)


def chunked_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor,
                           bias: Optional[torch.Tensor] = None, temperature: float = 1.0,
                           chunk_tokens: Optional[int] = None, with_entropy: bool = False,
                           keep_elements: int = KEEP_ELEMENTS
                           ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """log softmax((hidden @ weight^T + bias) / temperature) at `tokens`, `chunk_tokens` rows
    of logits at a time (default `default_chunk_tokens(V)`). hidden [N, T, H], weight [V, H],
    bias [V] or None, tokens [N, T] -> (logp [N, T], entropy [N, T] or None), float32. The
    logits of the first whole chunks within ``keep_elements`` are kept for the backward (the
    same values as recomputing them; none without a graph); 0 recomputes every chunk."""
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"chunked_token_logprobs: hidden [..., H] and weight [V, H] must "
                         f"share H; got hidden {tuple(hidden.shape)}, weight "
                         f"{tuple(weight.shape)}")
    if tuple(tokens.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"chunked_token_logprobs: tokens must have shape "
                         f"{tuple(hidden.shape[:-1])} (hidden without H); got {tuple(tokens.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"chunked_token_logprobs: bias must have shape ({weight.shape[0]},); "
                         f"got {tuple(bias.shape)}")
    if not temperature > 0:
        raise ValueError(f"chunked_token_logprobs: temperature must be > 0; got {temperature}")
    if chunk_tokens is not None and int(chunk_tokens) < 1:
        raise ValueError(f"chunked_token_logprobs: chunk_tokens must be >= 1; got {chunk_tokens}")
    if int(keep_elements) < 0:
        raise ValueError(f"chunked_token_logprobs: keep_elements must be >= 0; got {keep_elements}")
    # the id range is read on the CPU only (on an accelerator: a host sync per forward)
    if tokens.numel() and tokens.device.type == "cpu":
        lo, hi = torch.aminmax(tokens)
        if int(lo) < 0 or int(hi) >= weight.shape[0]:
            raise ValueError(f"chunked_token_logprobs: token ids must be in [0, {weight.shape[0]}); "
                             f"got min {int(lo)}, max {int(hi)}")
    chunk = int(chunk_tokens) if chunk_tokens is not None else default_chunk_tokens(weight.shape[0])
    lead = tuple(hidden.shape[:-1])
    h = hidden.reshape(-1, hidden.shape[-1])  # [M, H]
    tok = tokens.reshape(-1).long()  # [M]
    graph = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad or
                                         (bias is not None and bias.requires_grad))
    logp, ent = _ChunkedLinearLogprobs.apply(h, weight, bias, tok, float(temperature), chunk,
                                             bool(with_entropy), int(keep_elements) if graph else 0)
    return logp.view(lead), (ent.view(lead) if with_entropy else None)
