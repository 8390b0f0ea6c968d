"""Sharing a prompt's key/value cache across the rows that repeat it.

The G completions of a group share one prompt. Both the rollout's prefill and the
learner's forward can run each distinct prompt once and index its KV cache out to every
row that uses it. Causal attention makes this exact: a prompt position never sees what
follows it. Models whose forward takes no cache keep the plain path.
"""
from __future__ import annotations

import functools
import inspect
from typing import Optional, Tuple

import torch


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


@torch.no_grad()
def shared_prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """A KV cache [N rows] of every prompt but its last token, computed once per distinct
    prompt; None when nothing repeats, the prompt has one token, or the model takes no
    cache. ``generate`` given this cache runs only the last prompt token and beyond."""
    if cache_keyword(model) is None or input_ids.shape[1] < 2:
        return None
    first, inv = distinct_rows(input_ids, attention_mask)
    if len(first) == len(inv):
        return None
    mask = attention_mask[first, :-1]                                              # [U, P-1]
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=input_ids[first, :-1], attention_mask=mask, position_ids=pos, use_cache=True)
    cache = cache_of(out)
    cache.batch_select_indices(inv)                                                # [N, ...]
    return cache
