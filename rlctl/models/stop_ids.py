"""The stop ids, computed here only (``resolve_stop_ids``): EOS, generation config, the config's."""
from __future__ import annotations

from typing import Iterable, List, Optional, Sequence, Tuple

import torch

from rlctl.errors import UserError


def _generation_config(model):
    """The generation config behind ``model`` (or a DeepSpeed engine), or None."""
    inner = getattr(model, "module", model)          # a DeepSpeed engine wraps .module
    return getattr(inner, "generation_config", None)


def _as_ids(value) -> Tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (int(value),)
    return tuple(int(v) for v in value)


def _ordered(ids: Iterable[int]) -> Tuple[int, ...]:
    """Distinct ids, first occurrence first (stable order for configs and dumps)."""
    return tuple(dict.fromkeys(int(i) for i in ids))


def stop_ids(model, tokenizer) -> Tuple[int, ...]:
    """The tokenizer's EOS, then the model's generation_config.eos_token_id(s), no repeats."""
    gen = _generation_config(model)
    declared = _as_ids(getattr(gen, "eos_token_id", None)) if gen is not None else ()
    return _ordered(_as_ids(tokenizer.eos_token_id) + declared)


def parse_stop_override(tokenizer, override: Optional[Sequence]) -> Tuple[int, ...]:
    """``rollout.stop_token_ids`` (ids or tokens such as "<|im_end|>") -> ids, else UserError."""
    if override is None:
        return ()
    if isinstance(override, (str, int)):
        override = [override]
    size, vocab = len(tokenizer), tokenizer.get_vocab()
    out = []
    for item in override:
        if isinstance(item, bool) or not isinstance(item, (int, str)):
            raise UserError(f"invalid rollout.stop_token_ids entry {item!r}: each entry is a "
                            "token id (int) or a token string such as '<|im_end|>'")
        if isinstance(item, str) and item not in vocab:
            raise UserError(f"invalid rollout.stop_token_ids entry '{item}': not a token of the "
                            f"model's vocabulary (give a single token, e.g. "
                            f"'{tokenizer.eos_token}', or its id in [0, {size - 1}])")
        tid = vocab[item] if isinstance(item, str) else int(item)
        if not 0 <= tid < size:
            raise UserError(f"invalid rollout.stop_token_ids entry {item}: token ids must be "
                            f"in [0, {size - 1}] (the tokenizer's vocabulary)")
        out.append(tid)
    return _ordered(out)


def resolve_stop_ids(model, tokenizer, override: Optional[Sequence] = None) -> Tuple[int, ...]:
    """``stop_ids`` plus ``override``, written into the model's generation config."""
    ids = _ordered(stop_ids(model, tokenizer) + parse_stop_override(tokenizer, override))
    gen = _generation_config(model)
    if gen is not None and ids:
        gen.eos_token_id = list(ids) if len(ids) > 1 else ids[0]
    return ids


def decode_completions(tokenizer, completion_ids: torch.Tensor, mask: torch.Tensor,
                       stops: Sequence[int] = ()) -> List[str]:
    """Text of each completion's counted tokens without its closing stop id or special tokens."""
    end, texts = set(map(int, stops)), []
    for row, n in zip(completion_ids.tolist(), mask.sum(-1).long().tolist()):
        n = n - 1 if n and row[n - 1] in end else n
        texts.append(tokenizer.decode(row[:n], skip_special_tokens=True).strip())
    return texts
