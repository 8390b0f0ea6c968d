"""The learner's forward pass: token log-probs, entropy and (with a critic) values.

Prompt sharing (``share_prompts``, rlctl/models/kv_share.py): the prompt's forward
runs once per distinct prompt, its key/value cache is indexed out to every row that
uses it, and the completions run on top of that cache. Gradients flow through the
shared cache into the prompt positions, summed over the rows that share them, as in the
full forward. On the default sorting config it removes about half of the learner's
tokens. Models whose forward takes no cache fall back to the full forward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional, Tuple, Union

import torch

from rlctl.core.logprobs import entropy_from_logits, token_logprobs
from rlctl.models.kv_share import cache_keyword, cache_of, distinct_rows, regroup
from rlctl.models.positions import position_ids_from_mask


@dataclass(frozen=True)
class PromptGroups:
    """Which rows share a prompt: ``labels`` [N] long on the CPU, equal for rows whose
    prompt (ids and mask) is equal. Found once per rollout and narrowed to each
    micro-batch's rows on the CPU, so no forward needs a device-to-host sync for its
    data-dependent shapes."""
    labels: torch.Tensor

    @classmethod
    def of(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int) -> "PromptGroups":
        P = prompt_len
        return cls(distinct_rows(input_ids[:, :P].cpu(), attention_mask[:, :P].cpu())[1])   # [N]

    def rows(self, rows: torch.Tensor) -> "PromptGroups":
        return PromptGroups(self.labels[rows])                                         # [n]

    def on(self, device) -> Tuple[torch.Tensor, torch.Tensor]:
        """(first [U], inv [n]) as ``kv_share.regroup`` gives them, on ``device``."""
        return tuple(t.to(device, non_blocking=True) for t in regroup(self.labels))


def prompt_sharing(enabled: bool, backend) -> bool:
    """``trainer.share_prompts`` as it applies on this backend: prompt sharing changes how
    many forwards a rank runs when its completions are all one token long, and
    multi-rank ZeRO-3 needs every rank to run the same ones (off there)."""
    zero3 = getattr(backend, "zero_stage", 0) == 3 and getattr(backend, "world_size", 1) > 1
    return bool(enabled) and not zero3


class Forward(NamedTuple):
    logp: torch.Tensor                 # [N, T] log pi(completion token t)
    entropy: Optional[torch.Tensor]    # [N, T] (no grad), when asked for
    values: Optional[torch.Tensor]     # [N, T] V(s_t), when the model has a critic


def learner_forward(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    prompt_len: int, temperature: float = 1.0, with_entropy: bool = False,
                    critic=None, share_prompts: Union[bool, PromptGroups] = False) -> Forward:
    """One policy forward for log-probs and entropy (and values, with a shared head).

    The logit at position t predicts token t+1, so completion token t is scored by
    position P-1+t: logits[:, P-1:] of the input without its last token. Values use the
    same positions, so values[:, t] = V(prompt + first t completion tokens).
    ``critic``: a separate value model, run on the same inputs (never prompt-shared).
    ``share_prompts``: False, True (rows sharing a prompt found here: a device sync on
    accelerators) or the rows' ``PromptGroups`` (found on the CPU beforehand).
    """
    inputs = dict(input_ids=input_ids[:, :-1], attention_mask=attention_mask[:, :-1],
                  position_ids=position_ids_from_mask(attention_mask[:, :-1]))
    key = cache_keyword(model) if share_prompts else None
    if key is not None:
        groups = share_prompts.on(input_ids.device) if isinstance(share_prompts, PromptGroups) else None
        logits, values = _shared_prompt_forward(model, input_ids, attention_mask, prompt_len, key,
                                                groups)
    else:
        out = model(**inputs, use_cache=False)
        logits = out.logits[:, prompt_len - 1:]                # [N, T, V]
        values = _values(out)
        values = values[:, prompt_len - 1:] if values is not None else None
    if temperature != 1.0:
        logits = logits / temperature
    logp = token_logprobs(logits, input_ids[:, prompt_len:])   # [N, T]
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = entropy_from_logits(logits.detach())     # [N, T]
    if critic is not None:
        values = critic(**inputs)[:, prompt_len - 1:]
    if values is not None:
        values = values.float()                                # [N, T]
    return Forward(logp, entropy, values)


def _values(out) -> Optional[torch.Tensor]:
    values = getattr(out, "values", None)          # PolicyValueModel's output field
    return values if isinstance(values, torch.Tensor) else None   # (HF outputs: a method)


def _shared_prompt_forward(model, input_ids, attention_mask, P: int, key: str, groups=None):
    """(logits [N, T, V], values [N, T] or None) from one prompt forward per distinct
    prompt plus one completion forward over the indexed cache."""
    first, inv = groups if groups is not None else \
        distinct_rows(input_ids[:, :P], attention_mask[:, :P])                    # [U], [N]
    p_mask = attention_mask[first, :P]                                             # [U, P]
    out = model(input_ids=input_ids[first, :P], attention_mask=p_mask,
                position_ids=position_ids_from_mask(p_mask), use_cache=True)
    logits, values = out.logits[inv, -1:], _values(out)                            # [N, 1, V]
    values = values[inv, -1:] if values is not None else None                      # [N, 1]
    if input_ids.shape[1] - P > 1:                 # completion tokens 1..T-1 to score
        cache = cache_of(out)
        cache.batch_select_indices(inv)            # [U, ...] -> [N, ...], differentiable
        pos = position_ids_from_mask(attention_mask[:, :-1])[:, P:]                # [N, T-1]
        rest = model(input_ids=input_ids[:, P:-1], attention_mask=attention_mask[:, :-1],
                     position_ids=pos, use_cache=True, **{key: cache})
        logits = torch.cat([logits, rest.logits], 1)                               # [N, T, V]
        if values is not None:
            values = torch.cat([values, _values(rest)], 1)                         # [N, T]
    return logits, values
