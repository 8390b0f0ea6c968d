"""Sharing a prompt's key/value cache across the rows that repeat it.

The G completions of a group share one prompt. Both the rollout's prefill and the
learner's forward can run each distinct prompt once and index its cache out to every
row that uses it. Causal attention makes this exact: a prompt position never sees what
follows it. Models whose forward takes no cache keep the plain path.

The cache may hold more than attention keys and values: hybrid models (Qwen3-Next,
Qwen3.5, LFM2, Falcon-H1) keep linear-attention / state-space layers whose cache is a
convolution window and a recurrent state per row. ``index_rows`` gathers the rows of
every kind alike. Models that keep their recurrent state inside their own modules
(RecurrentGemma) return no cache, so nothing can be indexed: ``state_in_modules``
tells the callers to keep the plain path for them.
"""
from __future__ import annotations

import functools
import inspect
import logging
import typing
from typing import Optional, Tuple

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache

log = logging.getLogger(__name__)
_said = set()


def distinct_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor
                  ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rows [N, P] -> (first [U]: one row index per distinct row, inv [N]: each row's
    distinct row). Ids and mask both count, so two rows are equal only when identical."""
    rows = torch.cat([input_ids, attention_mask.long()], 1)                        # [N, 2P]
    _, inv = torch.unique(rows, dim=0, return_inverse=True)                        # [N]
    return _first_rows(inv), inv


def regroup(labels: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Group labels of some rows [n] -> (first [U], inv [n]) numbered 0..U-1 for them.
    The learner labels a rollout's rows once on the CPU and regroups each micro-batch
    there, so no forward needs a device-to-host sync for its data-dependent shapes."""
    _, inv = torch.unique(labels, return_inverse=True)                             # [n]
    return _first_rows(inv), inv


def _first_rows(inv: torch.Tensor) -> torch.Tensor:
    n, U = inv.shape[0], int(inv.max()) + 1
    return torch.full((U,), n, dtype=torch.long, device=inv.device).scatter_reduce(
        0, inv, torch.arange(n, device=inv.device), "amin")                       # [U]


def cache_of(out):
    """The KV cache in a model output (``cache`` in transformers 5, else ``past_key_values``)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


def innermost(model):
    """The innermost Hugging Face model under compile / DeepSpeed / PolicyValueModel /
    autocast / peft wrappers (the module whose class defines the forward's keywords)."""
    inner = model
    for _ in range(8):
        if hasattr(inner, "_orig_mod"):
            inner = inner._orig_mod
        elif hasattr(inner, "module") and isinstance(inner.module, torch.nn.Module):
            inner = inner.module
        elif hasattr(inner, "policy") and isinstance(inner.policy, torch.nn.Module):
            inner = inner.policy
        elif hasattr(inner, "get_base_model"):
            inner = inner.get_base_model()
        else:
            break
    return inner


def cache_keyword(model) -> Optional[str]:
    """The keyword under which the innermost Hugging Face model's forward takes a KV
    cache (``cache`` in transformers 5, ``past_key_values`` before), or None."""
    params = _forward_parameters(type(innermost(model)))
    return next((k for k in ("cache", "past_key_values") if k in params), None)


def forward_takes(model, keyword: str) -> bool:
    """Whether the innermost model's forward has a parameter named ``keyword``."""
    return keyword in _forward_parameters(type(innermost(model)))


@functools.lru_cache(maxsize=None)
def _forward_parameters(cls) -> frozenset:
    try:
        return frozenset(inspect.signature(cls.forward).parameters)
    except (TypeError, ValueError):
        return frozenset()


def say_once(message: str) -> None:
    """Log ``message`` (a fallback for one architecture) once per process."""
    if message not in _said:
        _said.add(message)
        log.warning(message)


def unpadded_notice(model) -> None:
    """Say once what runs differently for a model that keeps its recurrent state in its
    modules (``state_in_modules``): the one line the sampler, the learner, the reference
    and a separate critic share. It names the architecture (the config's class without
    ``Config``), not the module class: the critic's backbone is a ``...Model``, the policy
    a ``...ForCausalLM``."""
    config = getattr(innermost(model), "config", None)
    arch = type(config).__name__.removesuffix("Config") if config is not None \
        else type(innermost(model)).__name__
    say_once(f"{arch} keeps its recurrent state in its modules and "
             "lets left padding reach it: it runs without prompt sharing, one prompt length "
             "at a time, unpadded")


def state_in_modules(model) -> bool:
    """Whether the model keeps its recurrent state inside its own modules instead of the
    cache (RecurrentGemma): transformers marks it stateful (``_is_stateful``) and its
    forward's output has no cache field. Nothing to index or share; and (RecurrentGemma)
    left padding reaches its convolution. Qwen3-Next, Falcon-H1, Mamba are stateful too
    but return their states in the cache."""
    inner = innermost(model)
    return bool(getattr(inner, "_is_stateful", False)) and not _returns_cache(type(inner))


def detach_module_state(model) -> None:
    """Detach the tensors a model that keeps its state in its modules (``state_in_modules``)
    left on them. RecurrentGemma's blocks store the last forward's conv window and RG-LRU
    state as plain attributes even with ``use_cache=False``; after a training forward they
    are non-leaf tensors of its graph, so ``copy.deepcopy`` of the model (a LoRA run's
    merged save) fails on them, and they keep the graph's nodes until the next forward.
    The values stay (the next prompt's forward overwrites them); the outputs' graph is
    untouched."""
    for module in innermost(model).modules():
        for name, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                setattr(module, name, value.detach())


@functools.lru_cache(maxsize=None)
def _returns_cache(cls) -> bool:
    """Whether ``cls.forward``'s declared output type has a cache field."""
    try:
        ret = typing.get_type_hints(cls.forward).get("return")
    except Exception:          # unresolvable annotations: assume the usual output with a cache
        return True
    fields = set()
    for t in typing.get_args(ret) or (ret,):
        fields |= set(getattr(t, "__dataclass_fields__", ()))
    return not fields or bool(fields & {"cache", "past_key_values", "cache_params"})


def fresh_cache(model):
    """An empty cache for the attention layers of a model that keeps its recurrent state
    in its modules (its forward makes one but does not return it), as ``generate`` does."""
    return DynamicCache(config=innermost(model).config)


def index_rows(cache, rows: torch.Tensor):
    """The cache with every layer's rows gathered: [U, ...] -> [len(rows), ...], ``rows``
    indexing U. Attention keys/values (sliding windows included) and linear-attention /
    state-space conv and recurrent states alike, through each layer's row gather
    (``reorder_cache``, an ``index_select``: differentiable). ``batch_select_indices``
    would gather the attention part only (a hybrid layer's states kept U rows)."""
    gather = getattr(cache, "reorder_cache", None)
    if gather is None:                 # a cache type without the per-layer row gather
        cache.batch_select_indices(rows)
    else:
        gather(rows)
    return cache


def _has_states(cache) -> bool:
    return any(hasattr(layer, "recurrent_states") for layer in getattr(cache, "layers", ()))


class _ReplacingCache(DynamicCache):
    """A DynamicCache whose linear-attention states are replaced by each update instead of
    copied into in place (transformers keeps them at a static address for CUDA graphs).
    The in-place copy overwrites the state the same forward read and saved for backward,
    so a gradient through a shared prompt's recurrent state needs this."""

    def __init__(self, layers):
        Cache.__init__(self, layers=layers)

    def update_recurrent_state(self, recurrent_states, layer_idx, state_idx=0, **kwargs):
        self.layers[layer_idx].recurrent_states[state_idx] = recurrent_states
        return recurrent_states


def differentiable(cache):
    """``cache`` ready for a forward that autograd differentiates through its states:
    attention caches as they are (updates concatenate); a DynamicCache with
    linear-attention layers has its conv and recurrent states replaced, not overwritten,
    on update (past recording keeps the conv window out of place)."""
    if type(cache) is not DynamicCache or not _has_states(cache):
        return cache
    out = _ReplacingCache(cache.layers)
    out.activate_past_recording()
    return out


@torch.no_grad()
def shared_prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """A cache [N rows] of every prompt but its last token, computed once per distinct
    prompt; None when nothing repeats, the prompt has one token, or the model takes no
    cache (or keeps its state in its modules: ``state_in_modules``). ``generate`` given this
    cache runs only the last prompt token and beyond."""
    if cache_keyword(model) is None or input_ids.shape[1] < 2 or state_in_modules(model):
        return None
    first, inv = distinct_rows(input_ids, attention_mask)
    if len(first) == len(inv):
        return None
    mask = attention_mask[first, :-1]                                              # [U, P-1]
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=input_ids[first, :-1], attention_mask=mask, position_ids=pos, use_cache=True)
    return index_rows(cache_of(out), inv)                                          # [N, ...]
