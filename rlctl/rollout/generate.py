"""Rollout: B prompts x G sampled completions -> a scored ``RolloutBatch``.

Sampling draws from the full distribution softmax(logits / temperature) (top-p off),
the same distribution the learner's log-probs are computed from (optional top-k for
eval and rollout only: ``rlctl train`` refuses it, rollout/sampler.py says why):
with a KV cache through rlctl's lean loop (rollout/sampler.py, the same tokens as
``generate`` for the same seed), otherwise (ZeRO-3 across ranks: ``synced_gpus``) and
for greedy decoding through the model's ``generate``. That fallback runs with the
library's default generation settings in place of the checkpoint's own
(``generation_config.json``: repetition penalty, top-k/top-p, min-p, banned words, ...),
so its only logits processor is the temperature: the tokens are drawn from the same
softmax(logits / temperature) the behaviour and learner log-probs are computed from.
"""
from __future__ import annotations

import contextlib
from typing import Callable, List, Optional, Sequence

import torch
from transformers import GenerationConfig

from rlctl.core.logprobs import completion_mask, token_logprobs
from rlctl.errors import UserError
from rlctl.models.kv_share import (cache_keyword, innermost, shared_prefill, state_in_modules,
                                   unpadded_notice)
from rlctl.models.stop_ids import decode_completions, stop_ids  # noqa: F401 - re-exported
from rlctl.models.kv_share import position_ids_from_mask  # noqa: F401 - also imported from here
from rlctl.models.value import PolicyValueModel
from rlctl.rollout.precision import sampling_precision
from rlctl.rollout.sampler import sample
from rlctl.types import Example, RolloutBatch


@torch.no_grad()
def generate(model, tokenizer, prompts: Sequence[str], max_new_tokens: int,
             do_sample: bool, temperature: float = 1.0, top_k: int = 0,
             return_logprobs: bool = False, share_prompts: bool = True,
             stops: Optional[Sequence[int]] = None, **backend_kwargs):
    """Left-padded prompts -> (sequences [N, P+T], prompt attention mask [N, P], P), plus
    the behaviour log-probs log softmax(logits / temperature) [N, T] of each generated
    token (top-k not applied) when ``return_logprobs``; no [N, T, V] logits are kept.

    ``stops``: the stop ids (default ``stop_ids(model, tokenizer)``: tokenizer EOS and the
    generation config's ids). ``backend_kwargs``: e.g. ``synced_gpus=True`` under ZeRO-3
    with several ranks. ``share_prompts``: prefill each distinct prompt once
    (rlctl/models/kv_share.py); the same samples as without, up to float rounding.

    T <= max_new_tokens: generation stops early when every row has emitted a stop id;
    rows that finished earlier are right-padded with the pad token.
    """
    if isinstance(model, PolicyValueModel):    # sample from the LM alone: no value head per token
        model = model.policy
    stops = tuple(stops) if stops is not None else stop_ids(model, tokenizer)
    device = next(model.parameters()).device
    enc = tokenizer(list(prompts), return_tensors="pt", padding=True)
    input_ids = enc["input_ids"].to(device)            # [N, P]
    prompt_mask = enc["attention_mask"].to(device)     # [N, P]
    if state_in_modules(model) and not bool(prompt_mask.all()):
        if backend_kwargs.get("synced_gpus"):
            raise UserError(f"{type(innermost(model)).__name__} cannot sample under ZeRO-3 on "
                            "several ranks: left padding reaches its recurrent state, so its "
                            "prompts run one length at a time, and synced generation needs the "
                            "same calls on every rank; use hardware.zero_stage<3 or one rank")
        return _per_length(lambda some: generate(
            model, tokenizer, some, max_new_tokens, do_sample, temperature, top_k, return_logprobs,
            share_prompts, stops, **backend_kwargs), prompts, prompt_mask, tokenizer.pad_token_id, model)
    cache = shared_prefill(model, input_ids, prompt_mask) if share_prompts else None
    key = cache_keyword(model)
    if do_sample and not backend_kwargs and key is not None:     # the lean loop (sampler.py)
        seqs, logp = sample(model, input_ids, prompt_mask, max_new_tokens, temperature, top_k,
                            stops, tokenizer.pad_token_id, key, cache, keep_logprobs=return_logprobs)
        return (seqs, prompt_mask, input_ids.shape[1]) + ((logp,) if return_logprobs else ())
    kwargs = dict(do_sample=True, temperature=temperature, top_k=top_k, top_p=1.0) \
        if do_sample else dict(do_sample=False)        # top_k=0: no top-k (HF's default is 50)
    if return_logprobs:
        kwargs.update(output_logits=True, return_dict_in_generate=True)
    if cache is not None:
        kwargs[key] = cache
    with library_generation_defaults(model):
        out = model.generate(
            input_ids=input_ids, attention_mask=prompt_mask, max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=list(stops), **kwargs,
            **backend_kwargs)
    if not return_logprobs:
        return out, prompt_mask, input_ids.shape[1]       # out: [N, P+T]
    new = out.sequences[:, input_ids.shape[1]:]                                    # [N, T]
    logp = torch.stack([token_logprobs(lg[:, None].float() / temperature, new[:, t, None])[:, 0]
                        for t, lg in enumerate(out.logits)], 1)                    # [N, T]
    return out.sequences, prompt_mask, input_ids.shape[1], logp


def _per_length(run, prompts, prompt_mask: torch.Tensor, pad_id: int, model):
    """``generate``'s result for a model whose recurrent layers see left padding
    (RecurrentGemma: the pads' activations enter its convolution; it keeps its state in its
    modules): ``run`` on each group of prompts of one token length, unpadded, then the
    groups left-padded to P and right-padded (pad id, log-prob 0) to the longest T."""
    unpadded_notice(model)
    lengths = prompt_mask.sum(-1)                                                 # [N]
    groups = [(lengths == n).nonzero()[:, 0] for n in sorted(set(lengths.tolist()))]
    outs = [run([prompts[i] for i in rows.tolist()]) for rows in groups]
    N, P = prompt_mask.shape
    T = max(o[0].shape[1] - o[2] for o in outs)
    seqs = prompt_mask.new_full((N, P + T), pad_id)                               # [N, P+T]
    logp = torch.zeros(N, T, device=prompt_mask.device, dtype=outs[0][3].dtype) \
        if len(outs[0]) > 3 else None                      # [N, T], the sampler's dtype (float64 model: float64)
    for rows, (s, m, p, *lp) in zip(groups, outs):
        seqs[rows, P - p:P - p + s.shape[1]] = s
        if logp is not None:
            logp[rows, :lp[0].shape[1]] = lp[0]
    return (seqs, prompt_mask, P) + ((logp,) if logp is not None else ())


@contextlib.contextmanager
def library_generation_defaults(model):
    """Within: every (sub)module's ``generation_config`` is a fresh ``GenerationConfig()``.
    ``generate`` fills each setting the call leaves unset from the model's config, so
    passing a clean config is not enough (a checkpoint's repetition_penalty or min_p
    would still apply); wrappers (PEFT, DeepSpeed) hold the config on an inner module."""
    saved = [(m, m.generation_config) for m in model.modules()
             if isinstance(getattr(m, "generation_config", None), GenerationConfig)]
    try:
        for m, _ in saved:
            m.generation_config = GenerationConfig()
        yield
    finally:
        for m, config in saved:
            m.generation_config = config


def rollout(model, tokenizer, examples: Sequence[Example], group_size: int,
            max_new_tokens: int, temperature: float, top_k: int,
            score_batch: Callable[[List[Example], List[str]], List[float]],
            behaviour_logprobs: bool = False, share_prompts: bool = True,
            stops: Optional[Sequence[int]] = None, engine_logprobs: bool = False,
            sample_dtype: str = "float32", **backend_kwargs) -> RolloutBatch:
    """Sample G completions for each of the B examples and score them in one batch
    (``score_batch``: e.g. ``RewardScorer.score_batch``, which enforces the time limit).
    ``behaviour_logprobs``: also record log softmax(logits / temperature) of each sampled
    token from generation's own logits (no extra forward) as ``old_logprobs``;
    ``engine_logprobs``: record them as ``engine_logprobs`` (set too whenever they are
    recorded). ``sample_dtype``: the sampling forwards' precision (``sampling_precision``).
    ``stops``: the stop ids (default: ``stop_ids(model, tokenizer)``); the mask counts
    each completion up to and including its first stop id."""
    stops = tuple(stops) if stops is not None else stop_ids(model, tokenizer)
    prompts = [ex.prompt for ex in examples for _ in range(group_size)]   # N = B*G, grouped
    with sampling_precision(model, sample_dtype):
        seqs, prompt_mask, plen, *logp = generate(
            model, tokenizer, prompts, max_new_tokens, do_sample=True, temperature=temperature,
            top_k=top_k, return_logprobs=behaviour_logprobs or engine_logprobs,
            share_prompts=share_prompts, stops=stops, **backend_kwargs)
    completion_ids = seqs[:, plen:]                                          # [N, T]
    logp = logp[0] if logp else None                                         # [N, T]
    old = logp if behaviour_logprobs else None                               # [N, T]
    mask, truncated = completion_mask(completion_ids, stops, tokenizer.pad_token_id)
    attention_mask = torch.cat([prompt_mask, mask.long()], dim=1)            # [N, P+T]
    completions = decode_completions(tokenizer, completion_ids, mask, stops)
    per_row = [examples[i // group_size] for i in range(len(completions))]
    rewards = torch.tensor(score_batch(per_row, completions), dtype=torch.float32,
                           device=seqs.device)                               # [N]
    group_ids = torch.arange(len(examples), device=seqs.device).repeat_interleave(group_size)
    return RolloutBatch(
        input_ids=seqs, attention_mask=attention_mask, mask=mask, truncated=truncated,
        rewards=rewards, group_ids=group_ids, prompt_len=plen, group_size=group_size,
        prompts=prompts, completions=completions, old_logprobs=old,
        engine_logprobs=None if logp is None else logp * mask.to(logp.dtype))
