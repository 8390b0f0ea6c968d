"""Rollout: B prompts x G sampled completions -> a scored ``RolloutBatch``.

Sampling draws from the full distribution softmax(logits / temperature) (top-p off),
the same distribution the learner's log-probs are computed from (optional top-k for
eval and rollout only: ``rlctl train`` refuses it, rollout/sampler.py says why):
with a KV cache through rlctl's lean loop (rollout/sampler.py, the same tokens as
``generate`` for the same seed), otherwise (ZeRO-3 across ranks: ``synced_gpus``) and
for greedy decoding through the model's ``generate``.
"""
from __future__ import annotations

from typing import Callable, List, Sequence

import torch

from rlctl.core.logprobs import completion_mask, token_logprobs
from rlctl.models.kv_share import cache_keyword, shared_prefill
from rlctl.models.positions import position_ids_from_mask  # noqa: F401 - also imported from here
from rlctl.models.value import PolicyValueModel
from rlctl.rollout.sampler import sample
from rlctl.types import Example, RolloutBatch


@torch.no_grad()
def generate(model, tokenizer, prompts: Sequence[str], max_new_tokens: int,
             do_sample: bool, temperature: float = 1.0, top_k: int = 0,
             return_logits: bool = False, share_prompts: bool = True, **backend_kwargs):
    """Left-padded prompts -> (sequences [N, P+T], prompt attention mask [N, P], P), plus
    the raw (unprocessed: no temperature, no top-k) logits [N, T, V] that scored each
    generated token when ``return_logits``.

    ``backend_kwargs``: e.g. ``synced_gpus=True`` under ZeRO-3 with several ranks.
    ``share_prompts``: prefill each distinct prompt once (rlctl/models/kv_share.py); the
    same samples as without, up to float rounding of the logits (tested).

    T <= max_new_tokens: generation stops early when every row has emitted EOS; rows
    that finished earlier are right-padded with the pad token.
    """
    if isinstance(model, PolicyValueModel):    # sample from the LM alone: no value head per token
        model = model.policy
    device = next(model.parameters()).device
    enc = tokenizer(list(prompts), return_tensors="pt", padding=True)
    input_ids = enc["input_ids"].to(device)            # [N, P]
    prompt_mask = enc["attention_mask"].to(device)     # [N, P]
    kwargs = dict(do_sample=True, temperature=temperature, top_k=top_k or None, top_p=1.0) \
        if do_sample else dict(do_sample=False)
    if return_logits:
        kwargs.update(output_logits=True, return_dict_in_generate=True)
    cache = shared_prefill(model, input_ids, prompt_mask) if share_prompts else None
    key = cache_keyword(model)
    if do_sample and not backend_kwargs and key is not None:     # the lean loop (sampler.py)
        seqs, logits = sample(model, input_ids, prompt_mask, max_new_tokens, temperature, top_k,
                              tokenizer.eos_token_id, tokenizer.pad_token_id, key, cache)
        return (seqs, prompt_mask, input_ids.shape[1]) + ((logits,) if return_logits else ())
    if cache is not None:
        kwargs[key] = cache
    out = model.generate(
        input_ids=input_ids, attention_mask=prompt_mask, max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, **kwargs,
        **backend_kwargs)
    if return_logits:
        return out.sequences, prompt_mask, input_ids.shape[1], torch.stack(out.logits, 1)
    return out, prompt_mask, input_ids.shape[1]       # out: [N, P+T]


def decode_completions(tokenizer, completion_ids: torch.Tensor, mask: torch.Tensor) -> List[str]:
    """Text of each completion's counted tokens (EOS and padding dropped)."""
    lengths = mask.sum(-1).long().tolist()
    rows = completion_ids.tolist()
    return [tokenizer.decode(r[:n], skip_special_tokens=True).strip() for r, n in zip(rows, lengths)]


def rollout(model, tokenizer, examples: Sequence[Example], group_size: int,
            max_new_tokens: int, temperature: float, top_k: int,
            score_batch: Callable[[List[Example], List[str]], List[float]],
            behaviour_logprobs: bool = False, share_prompts: bool = True,
            **backend_kwargs) -> RolloutBatch:
    """Sample G completions for each of the B examples and score them in one batch
    (``score_batch``: e.g. ``RewardScorer.score_batch``, which enforces the time limit).
    ``behaviour_logprobs``: also record log softmax(logits / temperature) of each sampled
    token from generation's own logits (no extra forward) as ``old_logprobs``."""
    prompts = [ex.prompt for ex in examples for _ in range(group_size)]   # N = B*G, grouped
    seqs, prompt_mask, plen, *logits = generate(
        model, tokenizer, prompts, max_new_tokens, do_sample=True, temperature=temperature,
        top_k=top_k, return_logits=behaviour_logprobs, share_prompts=share_prompts, **backend_kwargs)
    completion_ids = seqs[:, plen:]                                          # [N, T]
    old = token_logprobs(logits[0].float() / temperature, completion_ids) if logits else None  # [N, T]
    mask, truncated = completion_mask(completion_ids, tokenizer.eos_token_id, tokenizer.pad_token_id)
    attention_mask = torch.cat([prompt_mask, mask.long()], dim=1)            # [N, P+T]
    completions = decode_completions(tokenizer, completion_ids, mask)
    per_row = [examples[i // group_size] for i in range(len(completions))]
    rewards = torch.tensor(score_batch(per_row, completions), dtype=torch.float32,
                           device=seqs.device)                               # [N]
    group_ids = torch.arange(len(examples), device=seqs.device).repeat_interleave(group_size)
    return RolloutBatch(
        input_ids=seqs, attention_mask=attention_mask, mask=mask, truncated=truncated,
        rewards=rewards, group_ids=group_ids, prompt_len=plen, group_size=group_size,
        prompts=prompts, completions=completions, old_logprobs=old)
