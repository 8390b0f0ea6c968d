"""Whether a model's logits are its LM head on its final hidden state (once per model, one
row): per logit, u_low / u_acc the unit roundoff of the lowest dtype / accumulator,
    |fused_v - own_v| <= 2 ((2 u_low + H u_acc) (|W||h|)_v + u_low |z_v|),
and a hook checks that the head ran on the final hidden state, its output the logits."""
from __future__ import annotations

import logging
import weakref

import torch

log = logging.getLogger(__name__)

VERDICTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # model -> head exact
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
    """Whether the head ran on the final hidden state and the logits are its output (to a cast)."""
    x, z = seen.get("x"), seen.get("z")
    if not isinstance(x, torch.Tensor) or not isinstance(z, torch.Tensor):
        return False                             # the head module never ran: its weight is used otherwise
    x, z = x[:, -1], z[:, -1]                                                     # [1, H], [1, V]
    if x.shape != hidden.shape or not torch.equal(x, hidden.to(x.dtype)):
        return False
    u = _unit(min((own.dtype, z.dtype), key=lambda d: torch.finfo(d).bits))     # a cast between them
    return bool(((own.float() - z.float()).abs() <= u * z.float().abs()).all())


def _unit(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2 if dtype.is_floating_point else 0.0


@torch.no_grad()
def head_matches(model, key, weight: torch.Tensor, bias, inputs: dict) -> bool:
    """Whether ``model``'s logits are ``hidden @ weight.T + bias`` on ``inputs``' first row."""
    known = VERDICTS.get(key)
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
    VERDICTS[key] = ok
    return ok
