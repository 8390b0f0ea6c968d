"""Greedy decoding for evaluation: the same decoding the trainer's eval uses.

``model.generate(do_sample=False)`` on left-padded prompts, stopping at every stop id
(rlctl/models/stop_ids.py); only the completion tokens up to the first stop id are
decoded, with special tokens skipped.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from rlctl.core.logprobs import completion_mask
from rlctl.models.stop_ids import decode_completions, stop_ids


@torch.no_grad()
def greedy_generate(model, tokenizer, prompts: Sequence[str], max_new_tokens: int = 8,
                    batch_size: int = 256) -> Tuple[List[str], List[bool]]:
    """Greedy completions of ``prompts``: (decoded texts, ended_with_a_stop_id flags).
    Generation stops at any id of ``stop_ids(model, tokenizer)``; the text is the
    completion up to its first stop id (that id and the padding after it dropped)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    stops = stop_ids(model, tokenizer)
    texts, ended = [], []
    try:
        for start in range(0, len(prompts), batch_size):
            enc = tokenizer(list(prompts[start:start + batch_size]), return_tensors="pt",
                            padding=True).to(device)
            out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens,
                                 pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=list(stops))  # [b, P+T']
            completion = out[:, enc["input_ids"].shape[1]:]  # [b, T'], T' <= max_new_tokens
            mask, truncated = completion_mask(completion, stops)     # [b, T'], [b]
            ended.extend((~truncated).tolist())
            texts.extend(decode_completions(tokenizer, completion, mask, stops))
    finally:
        model.train(was_training)
    return texts, ended


def greedy_exact_match(model, tokenizer, task, examples, max_new_tokens: int = 8,
                       batch_size: int = 256) -> Tuple[float, float]:
    """(exact-match fraction, format fraction) of greedy completions on ``examples``.

    Format: the completion ended with EOS within ``max_new_tokens`` and, when the task
    defines ``is_well_formed`` (sorting: exactly n single digits), passes it.
    """
    if not examples:
        return 0.0, 0.0
    texts, ended = greedy_generate(model, tokenizer, [ex.prompt for ex in examples],
                                   max_new_tokens=max_new_tokens, batch_size=batch_size)
    well_formed = getattr(task, "is_well_formed", lambda ex, c: True)
    exact = sum(task.is_correct(ex, c) for ex, c in zip(examples, texts))
    fmt = sum(e and well_formed(ex, c) for ex, c, e in zip(examples, texts, ended))
    return exact / len(examples), fmt / len(examples)
