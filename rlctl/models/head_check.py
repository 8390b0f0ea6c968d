"""Whether a model's logits are its LM head applied to its final hidden state, checked
at run time (``rlctl.learner.forward.fused_head``'s verification).

The learner's fused log-probs score ``lm_head(hidden_states[-1])``; the sampler draws
from the model's own logits. Models that transform the logits after the head
(RecurrentGemma's ``logits_soft_cap``, Gemma-2/3's final soft-capping, Falcon-H1's
``lm_head_multiplier``, Cohere's logit scale, transforms in nested text configs or in
code no config key names) would make the two differ. Instead of guessing from config
names, ``head_matches`` runs the model once on one row of the first batch with
``output_hidden_states=True, logits_to_keep=1`` and compares the head applied to the
last position's final hidden state with the logits the model returns for it. The
verdict is kept per model object (a weak reference), so it costs one one-row forward
per model, once.

Tolerance, per logit: both sides compute the same dot products over H from the same
inputs, differing in the rounding of the inputs (bf16 autocast rounds the hidden state
and the weight to bf16 for the model's own head; the fused path keeps them in the
weight's dtype), in summation order, and in the final rounding. With u_low the unit
roundoff of the lowest dtype involved, u_acc that of the accumulator (float32 for 16-bit
inputs, whose matmuls accumulate in float32; else the dtype itself) and (|W||h|)_v =
sum_i |w_vi h_i| (+ |b_v|): rounded inputs move each product by at most 2 u_low of it,
H roundings of the partial sums by at most H u_acc (|W||h|)_v, the result's rounding by
u_low |z_v|. So |fused_v - own_v| <= 2 ((2 u_low + H u_acc) (|W||h|)_v + u_low |z_v|)
(both sides). A soft-cap or a multiplier moves a logit by much more (Falcon-H1's 0.03x,
a 30-cap on a logit of 20: 2.5), but under bf16 at H = 4096 that worst case reaches ~|z| on
random weights, so a mild multiplier (0.8) fitted inside it. The same forward therefore
also watches the head module (a forward hook): it must run on the final hidden state, and
the logits must be its output up to a cast; that is the model's own arithmetic, so no
rounding allowance is needed and any transform before or after the head shows. The check runs the module the learner calls (its
autocast included; a compiled module's original, so nothing is compiled for it).
"""
from __future__ import annotations

import logging
import weakref

import torch

log = logging.getLogger(__name__)

_VERDICTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # model -> bool
_SAID: set = set()       # architectures already named in the log (the policy and its copies)


def _run_seeing_head(model, key, row: dict):
    """The check's forward, with what the LM head module received and returned in it."""
    seen: dict = {}
    handle = key.get_output_embeddings().register_forward_hook(
        lambda mod, args, res: seen.update(x=args[0] if args else None, z=res))
    try:
        out = getattr(model, "_orig_mod", model)(**row, use_cache=False, output_hidden_states=True,
                                                  logits_to_keep=1)
    finally:
        handle.remove()
    return out, seen


def _head_is_last(seen: dict, hidden: torch.Tensor, own: torch.Tensor) -> bool:
    """Whether the head module ran on the final hidden state and the logits are its output
    (to the rounding of a cast to the logits' dtype): the same arithmetic as the model's
    own, so any transform before or after the head shows, however small against the
    dot products' rounding (which the bound above must admit, e.g. under bf16 autocast)."""
    x, z = seen.get("x"), seen.get("z")
    if not isinstance(x, torch.Tensor) or not isinstance(z, torch.Tensor):
        return False                             # the head module never ran: its weight is used otherwise
    x, z = x[:, -1], z[:, -1]                                                     # [1, H], [1, V]
    if x.shape != hidden.shape or not torch.equal(x, hidden.to(x.dtype)):
        return False
    u = _unit(min((own.dtype, z.dtype), key=lambda d: torch.finfo(d).bits))     # a cast between them
    return bool(((own.float() - z.float()).abs() <= u * z.float().abs()).all())


def verdict(model):
    """The cached verdict for ``model`` (True: fused head exact, False: not), None if unchecked."""
    return _VERDICTS.get(model)


def _unit(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2 if dtype.is_floating_point else 0.0


@torch.no_grad()
def head_matches(model, key, weight: torch.Tensor, bias, inputs: dict) -> bool:
    """Check (once per ``key``, the innermost Hugging Face module) that ``model``'s logits
    are ``hidden @ weight.T + bias`` at the last position of the first row of ``inputs``
    (the learner's forward keywords, [N, L] tensors); when they are not, logs one line
    per architecture (the reference, a frozen copy of the policy, is checked on its own)."""
    known = _VERDICTS.get(key)
    if known is not None:
        return known
    row = {k: v[:1] for k, v in inputs.items()}                                   # [1, L]
    out, seen = _run_seeing_head(model, key, row)
    hidden = getattr(out, "hidden", None)                   # PolicyValueOutput, else HF's
    hidden = (hidden if isinstance(hidden, torch.Tensor) else out.hidden_states[-1])[:, -1]  # [1, H]
    own = out.logits[:, -1]                                                       # [1, V]
    fused = torch.nn.functional.linear(hidden.to(weight.dtype), weight, bias)    # [1, V]
    low = min((own.dtype, hidden.dtype, weight.dtype), key=lambda d: torch.finfo(d).bits)
    u_low = _unit(low)
    u_acc = _unit(torch.float32) if torch.finfo(low).bits < 32 else u_low
    scale = hidden.abs().float() @ weight.abs().float().T                         # [1, V] (|W||h|)
    scale = scale + bias.abs().float() if bias is not None else scale
    tol = 2 * ((2 * u_low + hidden.shape[-1] * u_acc) * scale + u_low * own.abs().float())
    gap = (fused.float() - own.float()).abs()                                    # [1, V]
    ok = bool((gap <= tol).all()) and _head_is_last(seen, hidden, own)
    if not ok and type(key).__name__ not in _SAID:
        _SAID.add(type(key).__name__)
        log.warning(f"{type(key).__name__}: its logits are not its LM head applied to the final "
                    f"hidden state (max difference {gap.max().item():.3g}: a soft-cap, scale or other "
                    "transform after the head); the learner uses the full logits for it")
    _VERDICTS[key] = ok
    return ok
