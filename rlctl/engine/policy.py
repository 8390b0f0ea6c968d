"""The learner's forward pass: token log-probs, entropy and (with a critic) values."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from rlctl.core.logprobs import entropy_from_logits, token_logprobs
from rlctl.rollout.generate import position_ids_from_mask


class Forward(NamedTuple):
    logp: torch.Tensor                 # [N, T] log pi(completion token t)
    entropy: Optional[torch.Tensor]    # [N, T] (no grad), when asked for
    values: Optional[torch.Tensor]     # [N, T] V(s_t), when the model has a critic


def learner_forward(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    prompt_len: int, temperature: float = 1.0, with_entropy: bool = False,
                    critic=None) -> Forward:
    """One policy forward for log-probs and entropy (and values, with a shared head).

    The logit at position t predicts token t+1, so completion token t is scored by
    position P-1+t: logits[:, P-1:] of the input without its last token. Values use the
    same positions, so values[:, t] = V(prompt + first t completion tokens).
    ``critic``: a separate value model, run on the same inputs.
    """
    inputs = dict(input_ids=input_ids[:, :-1], attention_mask=attention_mask[:, :-1],
                  position_ids=position_ids_from_mask(attention_mask[:, :-1]))
    out = model(**inputs, use_cache=False)
    logits = out.logits[:, prompt_len - 1:]                    # [N, T, V]
    if temperature != 1.0:
        logits = logits / temperature
    logp = token_logprobs(logits, input_ids[:, prompt_len:])   # [N, T]
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = entropy_from_logits(logits.detach())     # [N, T]
    values = getattr(out, "values", None)          # PolicyValueModel's output field
    if not isinstance(values, torch.Tensor):       # (HF outputs are dicts: .values is a method)
        values = None
    if critic is not None:
        values = critic(**inputs)
    if values is not None:
        values = values[:, prompt_len - 1:].float()            # [N, T]
    return Forward(logp, entropy, values)
