"""Forwards on left-padded rows: positions, and each distinct prompt's cache (keys/values,
hybrid conv and recurrent states) computed once and indexed out to the rows that repeat it
(exact under causal attention); models without a cache (RecurrentGemma) stay plain."""
from __future__ import annotations

import functools
import inspect
import logging
import typing
from itertools import repeat
from typing import Optional, Tuple

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

log = logging.getLogger(__name__)
_said = set()


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, as ``generate`` assigns them. [N, L] -> [N, L]"""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def regroup(labels: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Group labels [n] -> (first [U]: each group's first row, inv [n]: each row's group)."""
    _, inv = torch.unique(labels, return_inverse=True)                             # [n]
    n, U = inv.shape[0], int(inv.max()) + 1
    return torch.full((U,), n, dtype=torch.long, device=inv.device).scatter_reduce(
        0, inv, torch.arange(n, device=inv.device), "amin"), inv                   # [U], [n]


def distinct_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor
                  ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rows [N, P] -> ``regroup``'s (first [U], inv [N]); equal rows: equal ids and mask."""
    rows = torch.cat([input_ids, attention_mask.long()], 1)                        # [N, 2P]
    return regroup(torch.unique(rows, dim=0, return_inverse=True)[1])


def cache_of(out):
    """The KV cache in a model output (``cache`` in transformers 5, else ``past_key_values``)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


def innermost(model):
    """The Hugging Face model under compile / DeepSpeed / PolicyValueModel / peft wrappers."""
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
    """The innermost forward's KV-cache keyword (``cache`` or ``past_key_values``), or None."""
    params = _forward_parameters(type(innermost(model)))
    return "cache" if "cache" in params else "past_key_values" if "past_key_values" in params \
        else None


def forward_takes(model, keyword: str) -> bool:
    """Whether the innermost model's forward has a parameter named ``keyword``."""
    return keyword in _forward_parameters(type(innermost(model)))


def last_logits(model, none: bool = False, device=None) -> dict:
    """The forward keyword that keeps only the last position's logits (``none``: no position's,
    an empty index on ``device``: the LM head projects nothing), where it exists."""
    if not forward_takes(model, "logits_to_keep"):
        return {}
    return {"logits_to_keep": torch.empty(0, dtype=torch.long, device=device) if none else 1}


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
    """Say once, naming the architecture, that a ``state_in_modules`` model runs unshared."""
    config = getattr(innermost(model), "config", None)
    arch = type(config).__name__.removesuffix("Config") if config is not None \
        else type(innermost(model)).__name__
    say_once(f"{arch} keeps its recurrent state in its modules and "
             "lets left padding reach it: it runs without prompt sharing, one prompt length "
             "at a time, unpadded")


def state_in_modules(model) -> bool:
    """Whether the model keeps its state in its modules, not a cache (RecurrentGemma)."""
    inner = innermost(model)
    return bool(getattr(inner, "_is_stateful", False)) and not _returns_cache(type(inner))


def detach_module_state(model) -> None:
    """Detach the graph tensors a ``state_in_modules`` forward left on the modules."""
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
    """An empty attention cache for a ``state_in_modules`` model, as ``generate`` makes."""
    return DynamicCache(config=innermost(model).config)


class _ReplacingCache(DynamicCache):
    """A DynamicCache that replaces linear-attention states (an in-place copy breaks backward)."""

    def __init__(self, layers):
        Cache.__init__(self, layers=layers)

    def update_recurrent_state(self, recurrent_states, layer_idx, state_idx=0, **kwargs):
        self.layers[layer_idx].recurrent_states[state_idx] = recurrent_states
        return recurrent_states


class _InPlaceLayer(DynamicLayer):
    """A DynamicLayer whose keys/values [N, H, L, D] are views of buffers with room for more
    positions: ``update`` writes the new ones in place (no copy of the whole cache per token)."""

    def update(self, key_states, value_states, *args, **kwargs):
        moved = not self.is_initialized or self.keys is None or any(   # replaced since (a gather)
            t.data_ptr() != room.data_ptr() or t.shape[:2] != room.shape[:2] or t.stride() != room.stride()
            for t, room in ((self.keys, self.room_k), (self.values, self.room_v)))
        if moved:
            settle(self)                                   # a DynamicLayer from here on
            return self.update(key_states, value_states, *args, **kwargs)
        L, q = self.keys.shape[-2], key_states.shape[-2]
        if L + q > self.room_k.shape[-2]:      # full: twice the room (amortised O(1)), at most cap
            _make_room(self, min(max(2 * self.room_k.shape[-2], L + q), max(self.cap, L + q)) - L)
        self.room_k[..., L:L + q, :] = key_states
        self.room_v[..., L:L + q, :] = value_states
        self.keys, self.values = self.room_k[..., :L + q, :], self.room_v[..., :L + q, :]
        return self.keys, self.values


def settle(cache_or_layer):
    """Every in-place layer back to a plain DynamicLayer (its room dropped: the next update
    concatenates), so a cache handed on (multi-turn episodes gather and compact its rows)
    is never written through a stale room."""
    layers = getattr(cache_or_layer, "layers", None)
    for layer in layers if layers is not None else (cache_or_layer,):
        if type(layer) is _InPlaceLayer:
            del layer.room_k, layer.room_v, layer.cap
            layer.__class__ = DynamicLayer


def preallocated(cache, room: int, most: Optional[int] = None):
    """``cache`` with each plain DynamicLayer given buffers for ``room`` more positions (doubled
    when full, up to ``most`` more in all), written
    in place by later forwards (the same values as concatenation); other layers (sliding,
    linear attention, other cache types) as they are. The cache, changed in place."""
    for layer in getattr(cache, "layers", ()) if type(cache) is DynamicCache else ():
        if type(layer) is not DynamicLayer or not layer.is_initialized or layer.keys.dim() != 4:
            continue
        layer.cap = layer.keys.shape[-2] + max(room, most or 0)   # positions growth stops at
        _make_room(layer, room)
        layer.__class__ = _InPlaceLayer
    return cache


def _make_room(layer, room: int) -> None:
    """The layer's keys/values [N, H, L, D] copied into new buffers of L + room positions."""
    N, H, L, D = layer.keys.shape
    layer.room_k = layer.keys.new_empty(N, H, L + room, D)                        # [N, H, L+room, D]
    layer.room_v = layer.values.new_empty(N, layer.values.shape[1], L + room, layer.values.shape[-1])
    layer.room_k[..., :L, :] = layer.keys
    layer.room_v[..., :L, :] = layer.values
    layer.keys, layer.values = layer.room_k[..., :L, :], layer.room_v[..., :L, :]


def index_rows(cache, rows: torch.Tensor, grad: bool = False):
    """The cache's rows (hybrid states too) gathered; ``grad``: for a differentiated forward."""
    gather = getattr(cache, "reorder_cache", None)
    if gather is None:                 # a cache type without the per-layer row gather
        cache.batch_select_indices(rows)
    else:
        gather(rows)
    if not grad or type(cache) is not DynamicCache or not any(
            map(hasattr, cache.layers, repeat("recurrent_states"))):
        return cache
    out = _ReplacingCache(cache.layers)
    out.activate_past_recording()
    return out


@torch.no_grad()
def shared_prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """A cache [N rows] of every prompt but its last token, once per distinct prompt, or None."""
    if cache_keyword(model) is None or input_ids.shape[1] < 2 or state_in_modules(model):
        return None
    first, inv = distinct_rows(input_ids, attention_mask)
    if len(first) == len(inv):
        return None
    mask = attention_mask[first, :-1]                                              # [U, P-1]
    out = model(input_ids=input_ids[first, :-1], attention_mask=mask,                # the cache
                position_ids=position_ids_from_mask(mask), use_cache=True,
                **last_logits(model, none=True, device=input_ids.device))
    return index_rows(cache_of(out), inv)                                          # [N, ...]
