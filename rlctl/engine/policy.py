"""The learner's forward pass: token log-probs (and entropy) of a batch's completions."""
from __future__ import annotations

from typing import Tuple

import torch

from rlctl.core.logprobs import entropy_from_logits, token_logprobs
from rlctl.rollout.generate import position_ids_from_mask


def completion_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      prompt_len: int, temperature: float = 1.0) -> torch.Tensor:
    """Logits that score each completion token: [N, P+T] -> [N, T, V].

    The logit at position t predicts token t+1, so the completion's scores are the
    positions P-1 .. P+T-2 (the shift the core functions expect the caller to make).
    """
    out = model(input_ids=input_ids[:, :-1], attention_mask=attention_mask[:, :-1],
                position_ids=position_ids_from_mask(attention_mask[:, :-1]), use_cache=False)
    logits = out.logits[:, prompt_len - 1:]                    # [N, T, V]
    return logits / temperature if temperature != 1.0 else logits


def policy_logprobs(model, input_ids, attention_mask, prompt_len: int, temperature: float = 1.0,
                    with_entropy: bool = False) -> Tuple[torch.Tensor, torch.Tensor | None]:
    """(log pi(token) [N, T], entropy [N, T] or None); one forward pass for both."""
    logits = completion_logits(model, input_ids, attention_mask, prompt_len, temperature)
    completion = input_ids[:, prompt_len:]                     # [N, T]
    logp = token_logprobs(logits, completion)                  # [N, T]
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = entropy_from_logits(logits.detach())     # [N, T]
    return logp, entropy
