"""A lean sampling loop: the rollout's generation without ``generate``'s per-step
machinery (about 10-15% of a rollout on the tiny model).

It draws exactly what Hugging Face's sampling draws for rlctl's settings (softmax of
logits / temperature, optional top-k, ``torch.multinomial`` on the same RNG, finished
rows padded, one attention-mask column per step), so the same seed gives the same
tokens (tests/models/test_prompt_sharing.py). The behaviour policy is then exactly
softmax(logits / temperature) (top-k applied, outside training): no processor from a checkpoint's
generation config (repetition penalty and the like) changes it behind the learner's back.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from rlctl.errors import UserError
from rlctl.models.kv_share import cache_of, fresh_cache, state_in_modules


def check_training_sampling(top_k: int) -> None:
    """Training samples from exactly the distribution its log-probs are taken from:
    softmax(logits / temperature). Top-k is refused for ``rlctl train`` (eval and rollout
    may use it): the truncated policy's support moves with the weights, so a token the
    behaviour policy sampled can have probability 0 under the learner (a stale async
    rollout, a later epoch, float rounding at the k-th logit), where log-probs, ratios and
    KL estimates stop being finite. Raises UserError (one line, exit 2)."""
    if top_k:
        raise UserError(f"rollout.top_k={top_k} is for rlctl eval and rollout only: training "
                        "samples from the full softmax(logits / rollout.temperature) that its "
                        "log-probs and ratios use; set rollout.top_k=0 for rlctl train")


@torch.no_grad()
def sample(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
           temperature: float, top_k: int, stop_ids: Sequence[int], pad_id: int, key: str,
           cache=None, keep_logprobs: bool = False, max_position: Optional[int] = None
           ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Left-padded prompts [N, P] -> (sequences [N, P+T], behaviour log-probs [N, T] float32
    (float64 for a float64 model: the tokens are drawn from the float32 scores either way)
    or None).

    ``keep_logprobs``: record log softmax(logits / temperature) of each sampled token
    (top-k not applied: training refuses top-k) at its own step; only these [N, T] values
    are kept, never the [N, T, V] rows. ``cache``: a KV cache of every prompt token but the
    last (``kv_share.shared_prefill``); None: the whole prompt is run here. ``key``: the
    forward's cache keyword. T <= max_new_tokens: stops when every row has emitted one of
    ``stop_ids``; finished rows are padded with ``pad_id`` (which may itself be a stop id).
    A model that keeps its recurrent state in its modules (``kv_share.state_in_modules``) returns
    no cache: the loop passes it one of its own for the attention layers, as ``generate``.
    ``max_position``: the model's positions (its context); a token fed past them gets the
    last one. Episodes sample rows of different rooms together (rlctl/rollout/episodes.py):
    the tokens past a row's room are dropped, and a table of absolute positions (GPT-2)
    must not be indexed past its end to make them.
    """
    n = input_ids.shape[0]
    mask = attention_mask.long()
    stops = torch.tensor(list(stop_ids), dtype=torch.long, device=input_ids.device)  # [S]
    pos = (mask.cumsum(-1) - 1).clamp(min=0)                                     # [N, P]
    kept = fresh_cache(model) if state_in_modules(model) else None     # filled, not returned
    if cache is not None:
        out = model(input_ids=input_ids[:, -1:], attention_mask=mask, position_ids=pos[:, -1:],
                    use_cache=True, **{key: cache})
    else:
        out = model(input_ids=input_ids, attention_mask=mask, position_ids=pos, use_cache=True,
                    **({key: kept} if kept is not None else {}))
    pos = pos[:, -1:]                                                              # [N, 1]
    unfinished = torch.ones(n, dtype=torch.long, device=input_ids.device)          # [N]
    tokens, logps = [], []
    for t in range(max_new_tokens):
        logits = out.logits[:, -1]                                                 # [N, V]
        scores = logits.float() / temperature                                      # [N, V]
        nxt = _draw(scores, top_k)                                                 # [N]
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
                    use_cache=True, **{key: cache_of(out) if kept is None else kept})
    old = torch.stack(logps, 1) if keep_logprobs else None                         # [N, T]
    return torch.cat([input_ids, torch.stack(tokens, 1)], 1), old


def _draw(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """One token per row from softmax(scores) [N, V], top-k applied when > 0 -> [N]."""
    if top_k:
        kth = torch.topk(scores, min(top_k, scores.shape[-1]))[0][..., -1, None]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    return torch.multinomial(torch.softmax(scores, -1), 1).squeeze(1)
