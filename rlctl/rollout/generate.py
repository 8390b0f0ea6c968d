"""Generation: B prompts x G sampled completions -> a scored ``RolloutBatch``."""
from __future__ import annotations

import contextlib
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from transformers import GenerationConfig

from rlctl.core.logprobs import completion_mask, token_logprobs
from rlctl.errors import TrainingFault, UserError
from rlctl.models.kv_share import (cache_keyword, cache_of, fresh_cache, innermost, last_logits,
                                   preallocated, settle, shared_prefill, state_in_modules,
                                   unpadded_notice)
from rlctl.models.stop_ids import decode_completions, stop_ids
from rlctl.models.value import PolicyValueModel
from rlctl.types import Example, LogProbs, RolloutBatch

SAMPLE_DTYPES = ("float32", "bfloat16")
ROOM = 256     # the sampler's first KV room, in new positions


def check_training_sampling(top_k: int) -> None:
    """UserError (one line) for top-k in ``rlctl train``: the learner's softmax has no top-k."""
    if top_k:
        raise UserError(f"rollout.top_k={top_k} is for rlctl eval and rollout only: training "
                        "samples from the full softmax(logits / rollout.temperature) that its "
                        "log-probs and ratios use; set rollout.top_k=0 for rlctl train")


@contextlib.contextmanager
def sampling_precision(model, dtype: str):
    """Within (no grad): ``model``'s forwards in ``dtype``: float32 as is, bfloat16 under
    autocast, each float32 weight cast once for the whole context: autocast caches the casts
    of leaves that require grad, so frozen ones (a LoRA base) are marked so meanwhile."""
    if dtype not in SAMPLE_DTYPES:
        raise ValueError(f"rollout.sample_dtype must be one of {SAMPLE_DTYPES}; got {dtype!r}")
    if dtype == "float32":
        yield
        return
    device = next(model.parameters()).device.type
    frozen = [p for p in model.parameters() if not p.requires_grad and p.dtype == torch.float32]
    try:
        for p in frozen:
            p.requires_grad_(True)
        with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16):
            yield
    finally:
        for p in frozen:
            p.requires_grad_(False)


def draw(scores: torch.Tensor, u: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One index per row drawn from softmax(scores) [N, V] (a -inf score: never) -> [N], by the
    inverse CDF: the first index whose cumulative weight passes u * total, for uniforms u
    [N, 1] in [0, 1) (float64; drawn from the global generator when None)."""
    top = scores.max(-1, keepdim=True).values                                     # [N, 1]
    w = torch.exp(scores - top)                                                   # [N, V]
    c = torch.cumsum(w, -1, dtype=torch.float64)                                  # [N, V]
    if not bool(torch.isfinite(c[:, -1]).all()):
        raise TrainingFault("the sampler got non-finite logits (NaN or inf) from the model: its "
                            "weights or the sampling precision overflowed (rollout.sample_dtype="
                            "float32 and hardware.precision=fp32 sample in full precision)")
    if u is None:
        u = torch.rand(c.shape[0], 1, dtype=c.dtype, device=c.device)             # [N, 1]
    # u * total < total (u < 1, rounding to nearest), and a zero weight leaves a sequential sum
    # (the CPU's) flat: the first index with c > u * total exists and has weight. A parallel
    # scan (CUDA) may round a flat step up; such a draw takes the row's most likely token.
    idx = torch.searchsorted(c, u * c[:, -1:], right=True)                        # [N, 1]
    if c.device.type != "cpu":
        idx = torch.where(w.gather(-1, idx) > 0, idx, w.argmax(-1, keepdim=True))
    return idx[:, 0]                                                              # [N]


@torch.no_grad()
def sample(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
           temperature: float, top_k: int, stop_ids: Sequence[int], pad_id: int, key: str,
           cache=None, keep_logprobs: bool = False, max_position: Optional[int] = None
           ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The lean loop: left-padded prompts [N, P] -> (sequences [N, P+T], log softmax(logits /
    temperature) of each sampled token [N, T] (before top-k; float64 for a float64 model) or
    None). ``cache``: of every prompt token but the last (``shared_prefill``); T <=
    max_new_tokens, rows padded after their stop id; positions clamped below ``max_position``."""
    mask = attention_mask.long()
    stops = torch.tensor(list(stop_ids), dtype=torch.long, device=input_ids.device)  # [S]
    pos = (mask.cumsum(-1) - 1).clamp(min=0)                                     # [N, P]
    kept = fresh_cache(model) if state_in_modules(model) else None     # filled, not returned
    if cache is not None:
        out = model(input_ids=input_ids[:, -1:], attention_mask=mask, position_ids=pos[:, -1:],
                    use_cache=True, **{key: cache})
    else:
        out = model(input_ids=input_ids, attention_mask=mask, position_ids=pos, use_cache=True,
                    **({key: kept} if kept is not None else {}), **last_logits(model))
    pos = pos[:, -1:]                                                              # [N, 1]
    room = min(max_new_tokens - 1, ROOM)           # a long budget's room grows as it is used
    cache = preallocated(cache_of(out), room, max_new_tokens - 1) if kept is None else kept
    n = input_ids.shape[0]
    try:
        unfinished = torch.ones(n, dtype=torch.long, device=input_ids.device)          # [N]
        tokens, logps = [], []
        for t in range(max_new_tokens):
            logits = out.logits[:, -1]                                                 # [N, V]
            scores = logits.float() if temperature == 1.0 else logits.float() / temperature   # [N, V]
            drawn = scores
            if top_k:
                kth = torch.topk(scores, min(top_k, scores.shape[-1]))[0][..., -1, None]
                drawn = scores.masked_fill(scores < kth, float("-inf"))
            nxt = draw(drawn)                                                          # [N]
            nxt = nxt * unfinished + pad_id * (1 - unfinished)
            tokens.append(nxt)
            if keep_logprobs:        # float32, or float64 for a float64 model (exact checks)
                exact = scores if logits.dtype != torch.float64 else logits / temperature
                logps.append(exact.gather(-1, nxt[:, None])[:, 0] - torch.logsumexp(exact, -1))
            unfinished = unfinished & (~torch.isin(nxt, stops)).long()
            if t == max_new_tokens - 1 or not bool(unfinished.any()):
                break
            mask = torch.cat([mask, mask.new_ones(n, 1)], 1)                           # [N, P+t+1]
            pos = pos + 1 if max_position is None else (pos + 1).clamp(max=max_position - 1)
            out = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos,
                        use_cache=True, **{key: cache})
        old = torch.stack(logps, 1) if keep_logprobs else None                         # [N, T]
        return torch.cat([input_ids, torch.stack(tokens, 1)], 1), old
    finally:
        settle(cache)                  # a caller's cache (multi-turn) leaves as it came


@torch.no_grad()
def generate(model, tokenizer, prompts: Sequence[str], max_new_tokens: int,
             do_sample: bool, temperature: float = 1.0, top_k: int = 0,
             return_logprobs: bool = False, share_prompts: bool = True,
             stops: Optional[Sequence[int]] = None, **backend_kwargs):
    """Prompts -> (sequences [N, P+T], prompt mask [N, P], P), plus ``sample``'s log-probs [N, T]
    when ``return_logprobs``. ``backend_kwargs``: e.g. ``synced_gpus=True`` (ZeRO-3);
    ``share_prompts``: prefill each distinct prompt once (the same samples up to rounding)."""
    if isinstance(model, PolicyValueModel):    # sample from the LM alone: no value head per token
        model = model.policy
    stops = tuple(stops) if stops is not None else stop_ids(model, tokenizer)
    device = next(model.parameters()).device
    enc = tokenizer(list(prompts), return_tensors="pt", padding=True)
    input_ids = enc["input_ids"].to(device)            # [N, P]
    prompt_mask = enc["attention_mask"].to(device)     # [N, P]
    if state_in_modules(model) and not bool(prompt_mask.all()):      # prompts of several lengths
        if backend_kwargs.get("synced_gpus"):
            raise UserError(f"{type(innermost(model)).__name__} cannot sample under ZeRO-3 on "
                            "several ranks: left padding reaches its recurrent state, so its "
                            "prompts run one length at a time, and synced generation needs the "
                            "same calls on every rank; use hardware.zero_stage<3 or one rank")
        unpadded_notice(model)
        groups = length_groups(model, prompt_mask.sum(-1).tolist())
        outs = [generate(model, tokenizer, [prompts[i] for i in rows], max_new_tokens, do_sample,
                         temperature, top_k, return_logprobs, share_prompts, stops,
                         **backend_kwargs) for rows in groups]
        return _padded_back(outs, groups, prompt_mask, tokenizer.pad_token_id)
    cache = shared_prefill(model, input_ids, prompt_mask) if share_prompts else None
    key = cache_keyword(model)
    if do_sample and not backend_kwargs and key is not None:     # the lean loop
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


def length_groups(model, lengths: Sequence[int]) -> List[List[int]]:
    """Rows sampled together: all, or per length (shortest first): ``state_in_modules``."""
    if not state_in_modules(model) or len(set(lengths)) < 2:
        return [list(range(len(lengths)))]
    return [[i for i, n in enumerate(lengths) if n == m] for m in sorted(set(lengths))]


def _padded_back(outs, groups, prompt_mask: torch.Tensor, pad_id: int):
    """``generate``'s results per length group, padded back together in row order."""
    N, P = prompt_mask.shape
    T = max(o[0].shape[1] - o[2] for o in outs)
    seqs = prompt_mask.new_full((N, P + T), pad_id)                               # [N, P+T]
    logp = torch.zeros(N, T, device=prompt_mask.device, dtype=outs[0][3].dtype) \
        if len(outs[0]) > 3 else None                      # [N, T], the sampler's dtype
    for rows, (s, m, p, *lp) in zip(groups, outs):
        seqs[rows, P - p:P - p + s.shape[1]] = s
        if logp is not None:
            logp[rows, :lp[0].shape[1]] = lp[0]
    return (seqs, prompt_mask, P) + ((logp,) if logp is not None else ())


@contextlib.contextmanager
def library_generation_defaults(model):
    """Within: every (sub)module's ``generation_config`` is a fresh ``GenerationConfig()``."""
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
    """G completions for each of the B examples, scored in one batch; the sampled tokens'
    log-probs kept as ``logprobs.old`` (``behaviour_logprobs``) and ``logprobs.engine``."""
    stops = tuple(stops) if stops is not None else stop_ids(model, tokenizer)
    prompts = [ex.prompt for ex in examples for _ in range(group_size)]   # N = B*G, grouped
    with sampling_precision(model, sample_dtype):
        seqs, prompt_mask, plen, *logp = generate(
            model, tokenizer, prompts, max_new_tokens, do_sample=True, temperature=temperature,
            top_k=top_k, return_logprobs=behaviour_logprobs or engine_logprobs,
            share_prompts=share_prompts, stops=stops, **backend_kwargs)
    logp = logp[0] if logp else None                                         # [N, T]
    mask, truncated = completion_mask(seqs[:, plen:], stops, tokenizer.pad_token_id)
    return scored(tokenizer, examples, group_size, seqs, prompt_mask, mask, truncated, stops,
                  score_batch, LogProbs(old=logp if behaviour_logprobs else None,
                                        engine=None if logp is None else logp * mask.to(logp.dtype)))


def scored(tokenizer, examples: Sequence[Example], group_size: int, seqs: torch.Tensor,
           prompt_mask: torch.Tensor, mask: torch.Tensor, truncated: torch.Tensor,
           stops: Sequence[int], score_batch, logprobs: LogProbs) -> RolloutBatch:
    """Sequences [N, P+T] of B examples x G (``mask`` [N, T]) decoded, scored -> a RolloutBatch."""
    plen = prompt_mask.shape[1]
    completions = decode_completions(tokenizer, seqs[:, plen:], mask, stops)
    per_row = [examples[i // group_size] for i in range(len(completions))]
    rewards = torch.tensor(score_batch(per_row, completions), dtype=torch.float32,
                           device=seqs.device)                               # [N]
    group_ids = torch.arange(len(examples), device=seqs.device).repeat_interleave(group_size)
    return RolloutBatch(
        input_ids=seqs, attention_mask=torch.cat([prompt_mask, mask.long()], 1), mask=mask,
        truncated=truncated, rewards=rewards, group_ids=group_ids, prompt_len=plen,
        group_size=group_size, prompts=[ex.prompt for ex in examples for _ in range(group_size)],
        completions=completions, logprobs=logprobs)


def left_padded(prompts, pad_id: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Token id lists -> (ids [N, P] left-padded with ``pad_id``, attention mask [N, P])."""
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), P, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):] = torch.tensor(list(p), dtype=torch.long)
        mask[i, P - len(p):] = 1
    return ids.to(device), mask.to(device)
