"""An episode's next model turn: ``turn_sampler(model, pad, kv_reuse)`` -> ``(keys, contexts,
max_new, temperature, top_k, stops) -> (ids, behaviour log-probs)``; ``Recompute`` or
``CachedTurns`` (each episode's cache rows kept, gaps masked; docs/agents.md)."""
from __future__ import annotations

from typing import Dict, Hashable, List, Optional, Sequence, Tuple

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from rlctl.errors import TrainingFault, UserError
from rlctl.models.kv_share import (cache_keyword, distinct_rows, forward_takes, index_rows,
                                   innermost, say_once, state_in_modules, unpadded_notice)
from rlctl.rollout.generate import left_padded, length_groups, sample
from rlctl.tasks.prompt_budget import context_length

Sampled = Tuple[List[List[int]], List[List[float]]]
_ATTENTION = ("eager", "sdpa")        # implementations that read a 2-D mask column by column


def gaps_unsupported(model) -> Optional[str]:
    """Why ``model``'s cache cannot hold gaps (a window, a recurrent state...), or None."""
    if state_in_modules(model):
        return "keeps its recurrent state in its modules"
    if not (forward_takes(model, "position_ids") and forward_takes(model, "attention_mask")):
        return "its forward takes no position ids or attention mask"
    config = innermost(model).config
    impl = getattr(config, "_attn_implementation", None)
    if impl not in _ATTENTION:
        return f"its attention implementation {impl} is not one of {', '.join(_ATTENTION)}"
    kinds = sorted({type(layer).__name__ for layer in DynamicCache(config=config).layers
                    if type(layer) is not DynamicLayer})
    if kinds:
        return f"its cache has {', '.join(kinds)} layers (a window or a recurrent state sees gaps)"
    return None


def turn_sampler(model, pad: int, kv_reuse: bool = True):
    """``CachedTurns`` when ``kv_reuse`` and the model allows it, else ``Recompute``."""
    key = cache_keyword(model)
    if key is None:
        raise UserError(f"{type(model).__name__} takes no KV cache in its forward; multi-turn "
                        "episodes sample with the cached loop: use a model whose forward takes one")
    why = gaps_unsupported(model) if kv_reuse else None
    if kv_reuse and why is None:
        return CachedTurns(model, pad, key)
    if why is not None:
        arch = type(innermost(model).config).__name__.removesuffix("Config")
        say_once(f"{arch} {why}: each episode turn recomputes its whole context "
                 "(rollout.episode.kv_reuse cannot apply)")
    return Recompute(model, pad, key)


class Recompute:
    """Each turn runs the whole context (see the module docstring)."""

    def __init__(self, model, pad: int, key: str):
        self.model, self.pad, self.key = model, pad, key
        self.context = context_length(model)  # rows' rooms differ: fed tokens clamped to it

    def __call__(self, keys: Sequence[Hashable], contexts: List[List[int]], max_new: int,
                 temperature: float, top_k: int, stops: Sequence[int]) -> Sampled:
        if state_in_modules(self.model):
            unpadded_notice(self.model)
        device = next(self.model.parameters()).device
        new: List[List[int]] = [[] for _ in contexts]
        logps: List[List[float]] = [[] for _ in contexts]
        for rows in length_groups(self.model, [len(c) for c in contexts]):
            ids, mask = left_padded([contexts[i] for i in rows], self.pad, device)       # [n, L]
            L = ids.shape[1]
            seqs, lp = sample(self.model, ids, mask, max_new, temperature,
                              top_k, stops, self.pad, self.key, None, keep_logprobs=True,
                              max_position=self.context)
            for j, i in enumerate(rows):
                new[i], logps[i] = seqs[j, L:].tolist(), lp[j].tolist()
        return new, logps


class CachedTurns:
    """Each episode's cache carried from turn to turn (see the module docstring)."""

    def __init__(self, model, pad: int, key: str):
        self.model, self.pad, self.key = model, pad, key
        self.context = context_length(model)  # rows' rooms differ: fed tokens clamped to it
        self.config = innermost(model).config
        self.cache = None                     # a DynamicCache of the last turn's rows
        self.mask = torch.zeros(0, 0, dtype=torch.long)   # [rows, S] on the CPU: 1 = a held token
        self.row: Dict[Hashable, int] = {}    # episode -> its row in the cache
        self.held: Dict[Hashable, List[int]] = {}   # episode -> its row's tokens (mask-1 columns)

    def __call__(self, keys: Sequence[Hashable], contexts: List[List[int]], max_new: int,
                 temperature: float, top_k: int, stops: Sequence[int]) -> Sampled:
        device = next(self.model.parameters()).device
        reused = [self._reusable(k, c) for k, c in zip(keys, contexts)]
        held = self._compact(keys, reused, device)                                 # [n, F]
        news = [c[f:] for c, f in zip(contexts, reused)]                           # >= 1 token each
        n, W = len(contexts), max(len(t) for t in news) - 1
        chunk, chunk_mask = left_padded(news, self.pad, "cpu")                     # [n, W+1]
        ids = torch.cat([held, chunk], 1).to(device)                               # [n, F+W+1]
        mask = torch.cat([self.mask, chunk_mask], 1)                               # [n, F+W+1]
        on_device = mask.to(device)
        if W:                           # every new token but the last: the sampler runs that one
            self._extend(ids[:, :-1], on_device[:, :-1], W)
        seqs, lp = sample(self.model, ids, on_device, max_new, temperature, top_k, stops,
                          self.pad, self.key, self.cache, keep_logprobs=True,
                          max_position=self.context)
        S, steps = ids.shape[1], seqs.shape[1] - ids.shape[1]
        if self.cache.get_seq_length() != S + steps - 1:
            raise TrainingFault(f"the episode KV cache holds {self.cache.get_seq_length()} "
                                f"columns after a turn, not {S + steps - 1}: the model's forward "
                                "did not extend the cache it was given; set "
                                "rollout.episode.kv_reuse=false")
        new = seqs[:, S:].tolist()
        self.mask = torch.cat([mask, torch.ones(n, steps - 1, dtype=torch.long)], 1)
        self.row = {k: i for i, k in enumerate(keys)}
        self.held = {k: c + t[:steps - 1] for k, c, t in zip(keys, contexts, new)}
        return new, lp.tolist()

    def _extend(self, ids: torch.Tensor, mask: torch.Tensor, W: int) -> None:
        """Run the last ``W`` columns of ``ids`` [n, F+W] into the cache, once per distinct row."""
        first, inv = distinct_rows(ids, mask)
        shared = len(first) < len(inv)
        if shared:
            ids, mask = ids[first], mask[first]
            index_rows(self.cache, first)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, -W:]                            # [u, W]
        self.model(input_ids=ids[:, -W:], attention_mask=mask, position_ids=pos, use_cache=True,
                   **{self.key: self.cache})
        if shared:
            index_rows(self.cache, inv)

    def _reusable(self, key: Hashable, context: List[int]) -> int:
        """Tokens of ``context`` its row holds: the longest shared prefix, short of the last."""
        held, m = self.held.get(key, []), min(len(self.held.get(key, [])), len(context) - 1)
        if held[:m] == context[:m]:
            return m
        return next(j for j in range(m) if held[j] != context[j])

    def _compact(self, keys: Sequence[Hashable], reused: List[int], device) -> torch.Tensor:
        """The cache cut to ``keys``' rows, their first ``reused`` columns left-padded to
        F = max(reused) (``self.mask`` follows) -> the held ids [n, F]."""
        n, F = len(keys), max(reused)
        ids = torch.full((n, F), self.pad, dtype=torch.long)
        mask = torch.zeros(n, F, dtype=torch.long)
        if F == 0:
            self.cache, self.mask = DynamicCache(config=self.config), mask
            return ids
        rows = torch.tensor([self.row.get(k, 0) for k in keys])    # [n] (a new episode: no columns)
        cols = torch.zeros(n, F, dtype=torch.long)                                  # [n, F]
        for i, (k, f) in enumerate(zip(keys, reused)):
            if f:
                cols[i, F - f:] = self.mask[self.row[k]].nonzero()[:f, 0]
                ids[i, F - f:] = torch.tensor(self.held[k][:f])
                mask[i, F - f:] = 1
        rows, cols = rows.to(device), cols.to(device)
        for layer in self.cache.layers:
            layer.keys, layer.values = _gather(layer.keys, rows, cols), _gather(layer.values, rows, cols)
        self.mask = mask
        return ids


def _gather(states: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """states [B, H, S, D] -> [n, H, F, D]: row ``rows[i]``'s columns ``cols[i]``."""
    picked = states.index_select(0, rows)                                          # [n, H, S, D]
    H, D = picked.shape[1], picked.shape[3]
    return picked.gather(2, cols[:, None, :, None].expand(-1, H, -1, D))
