"""Token log-probs and entropy straight from the final hidden states, in chunks of tokens.

`chunked_token_logprobs` fuses the LM head into the log-softmax, so the [N, T, V] logits
(and their gradient) are never held at once: the idea of fused linear cross-entropy
(Liger-Kernel, Hsu et al. 2024, arXiv:2410.10989; Wijmans et al. 2024, "Cut Your Losses
in Large-Vocabulary Language Models", arXiv:2411.09009). The forward takes the flattened
rows of h ([M, H], M = N*T) ``chunk_tokens`` at a time, z = (h_c W^T + b) / temperature
([C, V]), and keeps only [M] vectors (lse, entropy); the backward recomputes each chunk's
logits and folds dL/dz into grad_h, grad_W, grad_b. With p = softmax(z), upstream gL (on
log-prob) and gE (on entropy):
    dL/dz = gL * (onehot(y) - p) - gE * p * (log p + H),  divided once by the temperature.
Exact: equal to the unchunked computation (float64 tests to 1e-12). Not twice
differentiable.

Dtypes: matmuls in the inputs' dtype; softmax, lse and entropy in float32 (float64 for
float64 inputs), which is also the output dtype; gradients in each input's dtype.
Memory beyond inputs and outputs: two reused [C, V] buffers and [M] vectors. Any token id
in [0, V) gives finite values; callers mask afterwards."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ._util import acc_dtype
from .logprobs import CHUNK_ELEMENTS

__all__ = ["chunked_token_logprobs", "default_chunk_tokens"]


def default_chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk so one chunk's logits hold about ``CHUNK_ELEMENTS`` floats, at least 1."""
    return max(1, CHUNK_ELEMENTS // max(int(vocab_size), 1))


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


def _buffers(h, weight, rows, count, acc):
    """`count` reusable [rows, V] buffers in the accumulation dtype."""
    return [h.new_empty((rows, weight.shape[0]), dtype=acc) for _ in range(count)]


class _ChunkedLinearLogprobs(torch.autograd.Function):
    """h [M, H], W [V, H], b [V] | None, tokens [M] -> (logp [M], entropy [M] | [0])."""

    @staticmethod
    def forward(ctx, h, weight, bias, tokens, temperature, chunk, want_entropy):
        acc = acc_dtype(h, weight)
        m = h.shape[0]
        logp = h.new_empty(m, dtype=acc)  # [M]
        lse = h.new_empty(m, dtype=acc)  # [M]
        ent = h.new_empty(m if want_entropy else 0, dtype=acc)  # [M] or [0]
        bufs = _buffers(h, weight, min(chunk, m), 2 if want_entropy else 1, acc)
        for s in range(0, m, chunk):
            e = min(s + chunk, m)
            z = _chunk_logits(h[s:e], weight, bias, temperature, bufs[0][:e - s])  # [C, V]
            lse_c = torch.logsumexp(z, dim=-1)  # [C]
            lse[s:e] = lse_c
            logp[s:e] = z.gather(1, tokens[s:e, None]).squeeze(1) - lse_c
            if want_entropy:
                logq = z.sub_(lse_c[:, None])  # [C, V] log p, in place
                p = torch.exp(logq, out=bufs[1][:e - s])  # [C, V]
                ent[s:e] = -p.mul_(logq).sum(-1)  # [C]  (p = 0 gives 0, not NaN)
        ctx.save_for_backward(h, weight, bias, tokens, lse, ent)
        ctx.temperature, ctx.chunk, ctx.want_entropy = temperature, chunk, want_entropy
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    @once_differentiable
    def backward(ctx, g_logp, g_ent):
        h, weight, bias, tokens, lse, ent = ctx.saved_tensors
        g_ent = g_ent if ctx.want_entropy else None
        if g_logp is None and g_ent is None:
            return None, None, None, None, None, None, None
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        acc, m = lse.dtype, h.shape[0]
        grad_h = torch.zeros_like(h) if need_h else None  # [M, H]
        grad_w = weight.new_zeros(weight.shape, dtype=acc) if need_w else None  # [V, H]
        grad_b = bias.new_zeros(bias.shape, dtype=acc) if need_b else None  # [V]
        bufs = _buffers(h, weight, min(ctx.chunk, m), 2, acc)
        for s in range(0, m, ctx.chunk):
            e = min(s + ctx.chunk, m)
            dz = _chunk_grad(h[s:e], weight, bias, tokens[s:e], lse[s:e],
                             ent[s:e] if g_ent is not None else None,
                             _part(g_logp, s, e, acc), _part(g_ent, s, e, acc),
                             ctx.temperature, [b[:e - s] for b in bufs])  # [C, V]
            if grad_h is not None:
                _matmul_into(grad_h[s:e], dz, weight)  # [C, H] = [C, V] @ [V, H]
            if grad_w is not None:
                _matmul_into(grad_w, dz.t(), h[s:e], accumulate=True)  # [V, H]
            if grad_b is not None:
                grad_b += dz.sum(0)  # [V]
        grad_w = grad_w.to(weight.dtype) if grad_w is not None else None
        grad_b = grad_b.to(bias.dtype) if grad_b is not None else None
        return grad_h, grad_w, grad_b, None, None, None, None


def _matmul_into(out, a, b, accumulate=False):
    """out (+)= a @ b with no fresh output allocation when the dtypes agree; otherwise
    (bf16 inputs, float32 dz) a is cast to b's dtype, multiplied there, and upcast."""
    if a.dtype == b.dtype == out.dtype:
        return out.addmm_(a, b) if accumulate else torch.mm(a, b, out=out)
    prod = (a.to(b.dtype) @ b).to(out.dtype)
    return out.add_(prod) if accumulate else out.copy_(prod)


def _part(g: Optional[torch.Tensor], s: int, e: int, acc) -> Optional[torch.Tensor]:
    return None if g is None else g[s:e].to(acc)


def _chunk_grad(h_c, weight, bias, tok_c, lse_c, ent_c, gl, ge, temperature, bufs):
    """dL/d(raw logits) for one chunk, [C, V] in the accumulation dtype, in the two `bufs`."""
    logq = _chunk_logits(h_c, weight, bias, temperature, bufs[0])
    logq.sub_(lse_c[:, None])  # [C, V] log p
    p = torch.exp(logq, out=bufs[1])  # [C, V]
    if ge is not None:
        dz = logq.add_(ent_c[:, None]).mul_(p).mul_(-ge[:, None])  # [C, V] entropy part
        if gl is not None:
            dz.sub_(p.mul_(gl[:, None]))
    else:
        dz = p.mul_(-gl[:, None])  # [C, V]
    if gl is not None:
        dz.scatter_add_(1, tok_c[:, None], gl[:, None])  # + gl * onehot(y)
    return dz.div_(temperature) if temperature != 1.0 else dz


def _check(hidden, weight, bias, tokens, temperature, chunk_tokens) -> None:
    """One clear ValueError per bad argument (shapes, temperature, chunk, token range)."""
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
    # the id range is read on the CPU only: on an accelerator it would cost a host sync per
    # forward (gather there fails loudly on a bad id anyway)
    if tokens.numel() and tokens.device.type == "cpu":
        lo, hi = torch.aminmax(tokens)
        if int(lo) < 0 or int(hi) >= weight.shape[0]:
            raise ValueError(f"chunked_token_logprobs: token ids must be in [0, {weight.shape[0]}); "
                             f"got min {int(lo)}, max {int(hi)}")


def chunked_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor,
                           bias: Optional[torch.Tensor] = None, temperature: float = 1.0,
                           chunk_tokens: Optional[int] = None, with_entropy: bool = False
                           ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """log softmax((hidden @ weight^T + bias) / temperature) at `tokens`, never holding more
    than `chunk_tokens` rows of logits at once (forward and backward).

    hidden [N, T, H] (any leading shape), weight [V, H] (an LM head or a tied input
    embedding), bias [V] or None, tokens [N, T] long in [0, V) where hidden[n, t] scores
    tokens[n, t] (the caller has shifted). Returns (logp [N, T], entropy [N, T] or None),
    float32 (float64 for float64 inputs); both differentiable w.r.t. hidden, weight, bias.
    chunk_tokens: rows of the flattened N*T per chunk (default `default_chunk_tokens(V)`).
    """
    _check(hidden, weight, bias, tokens, temperature, chunk_tokens)
    chunk = int(chunk_tokens) if chunk_tokens is not None else default_chunk_tokens(weight.shape[0])
    lead = tuple(hidden.shape[:-1])
    h = hidden.reshape(-1, hidden.shape[-1])  # [M, H]
    tok = tokens.reshape(-1).long()  # [M]
    logp, ent = _ChunkedLinearLogprobs.apply(h, weight, bias, tok, float(temperature), chunk,
                                             bool(with_entropy))
    return logp.view(lead), (ent.view(lead) if with_entropy else None)
