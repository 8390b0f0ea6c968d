"""The learner's forward pass: token log-probs, entropy and (with a critic) values."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional, Tuple, Union

import torch
from torch.distributed.tensor import DTensor

from rlctl.core.logprobs import chunked_token_logprobs, entropy_from_logits, token_logprobs
from rlctl.models.head_check import VERDICTS as HEAD_VERDICTS, head_matches
from rlctl.models.kv_share import (cache_keyword, cache_of, detach_module_state,
                                   distinct_rows, forward_takes, index_rows, innermost, last_logits,
                                   position_ids_from_mask, regroup, state_in_modules,
                                   unpadded_notice)


@dataclass(frozen=True)
class PromptGroups:
    """Which rows share a prompt: ``labels`` [N] long on the CPU, equal for equal prompts."""
    labels: torch.Tensor

    @classmethod
    def of(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int) -> "PromptGroups":
        P = prompt_len
        return cls(distinct_rows(input_ids[:, :P].cpu(), attention_mask[:, :P].cpu())[1])   # [N]

    def rows(self, rows: torch.Tensor) -> "PromptGroups":
        return PromptGroups(self.labels[rows])                                         # [n]


def prompt_sharing(enabled: bool, backend) -> bool:
    """``trainer.share_prompts`` on this backend: off where forwards are collectives
    (multi-rank ZeRO-3 or FSDP2: every rank must run the same forwards)."""
    return bool(enabled) and not getattr(backend, "lockstep", False)


def fused_head(model, inputs: Optional[dict] = None) -> Optional[Tuple[torch.Tensor, Optional[torch.Tensor]]]:
    """(weight [V, H], bias [V] or None) of an exact plain ``nn.Linear`` LM head, else None."""
    inner = innermost(model)
    if not forward_takes(model, "logits_to_keep"):
        return None
    conf = getattr(inner, "config", None)
    if getattr(conf, "tie_last_hidden_states", True) is False:   # hidden_states[-1] not normed
        return None
    get = getattr(inner, "get_output_embeddings", None)
    lm_head = get() if callable(get) else None
    if type(lm_head) is not torch.nn.Linear or lm_head.weight.dim() != 2 or \
            lm_head.weight.numel() == 0 or isinstance(lm_head.weight, DTensor):
        return None     # a LoRA-wrapped head, or a ZeRO-3 partitioned or FSDP2 sharded weight
    exact = HEAD_VERDICTS.get(inner)           # checked once per model, on its first inputs
    if exact is None and inputs is not None:
        exact = head_matches(model, inner, lm_head.weight, lm_head.bias, inputs)
    return None if exact is False else (lm_head.weight, lm_head.bias)


def enable_gradient_checkpointing(model) -> None:
    """Non-reentrant activation checkpointing on the policy; ValueError if unsupported."""
    inner = innermost(model)
    if not getattr(inner, "supports_gradient_checkpointing", False):
        raise ValueError(f"model.gradient_checkpointing: {type(inner).__name__} does not support "
                         "gradient checkpointing; set model.gradient_checkpointing=false")
    enable = getattr(inner, "activation_checkpointing_enable", None)   # transformers >= 5.x name
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


class Forward(NamedTuple):
    logp: torch.Tensor                 # [N, T] log pi(completion token t)
    entropy: Optional[torch.Tensor]    # [N, T] (no grad unless entropy_grad), when asked for
    values: Optional[torch.Tensor]     # [N, T] V(s_t), when the model has a critic


def learner_forward(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    prompt_len: int, temperature: float = 1.0, with_entropy: bool = False,
                    critic=None, share_prompts: Union[bool, PromptGroups] = False,
                    entropy_grad: bool = False, fused: bool = True) -> Forward:
    """One policy forward: completion token t scored at position P-1+t, values[:, t] =
    V(prompt + first t tokens) from the shared head or ``critic`` (never prompt-shared).
    ``share_prompts``: False, True or the rows' ``PromptGroups`` (not under gradient
    checkpointing; a ``state_in_modules`` model runs unshared and unpadded)."""
    P = prompt_len
    inputs = dict(input_ids=input_ids[:, :-1], attention_mask=attention_mask[:, :-1],
                  position_ids=position_ids_from_mask(attention_mask[:, :-1]))
    head = fused_head(model, inputs) if fused else None
    extra = {} if head is None else {"output_hidden_states": True,
                                     **last_logits(model, none=True, device=input_ids.device)}
    padded = state_in_modules(model)       # no cache to share, and left pads leak (RecurrentGemma)
    inner = innermost(model)
    ckpt = getattr(inner, "is_activation_checkpointing", None)     # transformers >= 5.x name
    ckpt = getattr(inner, "is_gradient_checkpointing", False) if ckpt is None else ckpt
    ckpt = bool(ckpt) and inner.training and torch.is_grad_enabled()
    key = cache_keyword(model) if share_prompts and P > 1 and not padded and not ckpt else None
    if key is not None:
        scores, values = _shared_prompt_forward(model, input_ids, attention_mask, P, key,
                                                share_prompts, extra)
    else:
        def run(**kw):
            out = model(**kw, use_cache=False, **extra)
            return _scores(out, extra), _values(out)           # [n, L, V|H], [n, L] or None
        scores, values = _unpadded(run, inputs, P, model) if padded else \
            tuple(t[:, P - 1:] if t is not None else None for t in run(**inputs))   # [N, T, ...]
    logp, entropy = _logprobs(scores, head, input_ids[:, P:], temperature, with_entropy, entropy_grad)
    if critic is not None:
        backbone = getattr(critic, "backbone", critic)         # SeparateCritic's HF model
        values = _unpadded(lambda **kw: (critic(**kw),), inputs, P, backbone)[0] \
            if state_in_modules(backbone) else critic(**inputs)[:, P - 1:]
    if values is not None:
        values = values.float()                                # [N, T]
    return Forward(logp, entropy, values)


def _scores(out, extra) -> torch.Tensor:
    """The logits [N, L, V], or with ``extra`` (fused) the final hidden states [N, L, H]."""
    if not extra:
        return out.logits
    hidden = getattr(out, "hidden", None)           # PolicyValueOutput
    return hidden if isinstance(hidden, torch.Tensor) else out.hidden_states[-1]


def _logprobs(scores, head, tokens, temperature, with_entropy, entropy_grad):
    """(logp [N, T], entropy [N, T] or None) from logits or, with ``head``, hidden states."""
    if head is not None:
        weight, bias = head
        # the hidden state in the head's dtype (bf16 autocast: an fp32 head, as autocast leaves norms)
        logp, entropy = chunked_token_logprobs(scores.to(weight.dtype), weight, tokens, bias,
                                               temperature, with_entropy=with_entropy)
        return logp, (entropy if entropy is None or entropy_grad else entropy.detach())
    logits = scores / temperature if temperature != 1.0 else scores        # [N, T, V]
    logp = token_logprobs(logits, tokens)                                   # [N, T]
    if not with_entropy:
        return logp, None
    if entropy_grad:
        return logp, entropy_from_logits(logits)
    with torch.no_grad():
        return logp, entropy_from_logits(logits.detach())                  # [N, T]


def _unpadded(run, inputs, P: int, model) -> tuple:
    """``run(**inputs)`` from position P-1 on ([N, T, ...]), one forward per pad width, unpadded."""
    unpadded_notice(model)
    pads = (inputs["attention_mask"].long().cumsum(-1) == 0).sum(-1)                # [N]
    order, parts = [], []
    for k in sorted(set(pads.tolist())):
        rows = (pads == k).nonzero()[:, 0]                                          # [n]
        outs = run(**{name: t[rows, k:] for name, t in inputs.items()})
        parts.append([o[:, P - 1 - k:] if o is not None else None for o in outs])  # [n, T, ...]
        order.append(rows)
    detach_module_state(model)             # no graph left on the modules (deepcopy, memory)
    back = torch.argsort(torch.cat(order))                                         # [N]
    return tuple(torch.cat(col, 0)[back] if col[0] is not None else None for col in zip(*parts))


def _values(out) -> Optional[torch.Tensor]:
    values = getattr(out, "values", None)          # PolicyValueModel's output field
    return values if isinstance(values, torch.Tensor) else None   # (HF outputs: a method)


def _shared_prompt_forward(model, input_ids, attention_mask, P: int, key: str, share_prompts,
                           extra):
    """(scores [N, T, V|H], values [N, T] or None): one forward per distinct prompt, then one
    over the completions on the indexed cache, never of a single token (a hybrid layer's
    one-step path overwrites its state in place): with T = 2 the prompt stops one short."""
    if isinstance(share_prompts, PromptGroups):                                   # [U], [N]
        first, inv = regroup(share_prompts.labels)
        dev = input_ids.device
        first, inv = first.to(dev, non_blocking=True), inv.to(dev, non_blocking=True)
    else:
        first, inv = distinct_rows(input_ids[:, :P], attention_mask[:, :P])
    T = input_ids.shape[1] - P
    cut = P - 1 if T == 2 and P > 1 else P         # prompt columns run once per prompt
    p_mask = attention_mask[first, :cut]                                           # [U, cut]
    out = model(input_ids=input_ids[first, :cut], attention_mask=p_mask,
                position_ids=position_ids_from_mask(p_mask), use_cache=True, **extra)
    scores, values = _scores(out, extra)[inv, P - 1:], _values(out)               # [N, 1|0, V|H]
    values = values[inv, P - 1:] if values is not None else None                   # [N, 0|1]
    if T > 1:                                      # completion tokens 1..T-1 to score
        cache = index_rows(cache_of(out), inv, grad=True)         # [U, ...] -> [N, ...]
        pos = position_ids_from_mask(attention_mask[:, :-1])[:, cut:]              # [N, L-1-cut]
        rest = model(input_ids=input_ids[:, cut:-1], attention_mask=attention_mask[:, :-1],
                     position_ids=pos, use_cache=True, **{key: cache}, **extra)
        scores = torch.cat([scores, _scores(rest, extra)], 1)                      # [N, T, V|H]
        if values is not None:
            values = torch.cat([values, _values(rest)], 1)                         # [N, T]
    return scores, values
