"""Text, tokens and score: the one scoring path of a learned reward model, used by
``RewardModel`` (rlctl.reward_models.learned) and the fit (rlctl.reward_models.fit).

- text (``render``): the reward model's chat template over [prompt messages, assistant:
  completion] when it has one, else ``prompt + completion`` (one space added where
  neither side has whitespace at the join). Read by the reward model's own tokenizer.
- tokens (``encode``): no special tokens added over a chat template; a text over
  ``length_limit`` keeps its last tokens and its leading BOS (``keep_end``), since the
  score is read at the end.
- score (``last_token_scores``): positions counted over the attention mask; the head reads
  the final hidden state where the checkpoint's pooling reads it
  (``rlctl.reward_models.checkpoint.score_read``). Left and right padding alike."""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from rlctl.reward_models.checkpoint import pad_id_of, read_positions, score_head, score_read

UNSET_LENGTH = 10 ** 12  # a model_max_length this large is unset (transformers writes 1e30)


def render(tokenizer, prompt: Union[str, List[Dict[str, str]]], completion: str) -> str:
    """The text a reward model scores for ``prompt`` (text, or chat messages) answered by
    ``completion`` (see the module doc)."""
    if getattr(tokenizer, "chat_template", None):
        msgs = prompt if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
        return tokenizer.apply_chat_template(
            [*msgs, {"role": "assistant", "content": completion}], tokenize=False)
    prompt = str(prompt)
    if prompt and completion and not prompt[-1].isspace() and not completion[0].isspace():
        return prompt + " " + completion
    return prompt + completion


def backbone_of(model):
    """The classifier's base model (``LlamaForSequenceClassification.model``, GPT-2's
    ``transformer`` ...): its ``base_model_prefix`` attribute."""
    return getattr(model, model.base_model_prefix)


def last_token_scores(model, ids: torch.Tensor, mask: torch.Tensor,
                      read: Optional[str] = None) -> torch.Tensor:
    """[n, L] ids and mask -> [n] float32 scores: the head at ``read_positions`` (``read``,
    default the config's ``score_read``), positions counted over the mask."""
    read = read or score_read(model.config)[0]
    position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)            # [n, L]
    out = backbone_of(model)(input_ids=ids, attention_mask=mask, position_ids=position_ids,
                             use_cache=False)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]  # [n, L, H]
    last = read_positions(ids, mask, read, pad_id_of(model.config))     # [n]
    h = hidden[torch.arange(ids.shape[0], device=ids.device), last]     # [n, H]
    return score_head(model)(h).squeeze(-1).float()                    # [n]


def length_limit(tokenizer, model_config=None) -> Optional[int]:
    """Tokens a scored text may have: min(tokenizer ``model_max_length``, the backbone's
    position limit); None when neither is known."""
    known = [n for n in (getattr(tokenizer, "model_max_length", None),
                         getattr(model_config, "max_position_embeddings", None),
                         getattr(model_config, "n_positions", None))
             if isinstance(n, int) and 0 < n < UNSET_LENGTH]
    return min(known) if known else None


def keep_end(ids: List[int], limit: Optional[int], bos_id: Optional[int]) -> List[int]:
    """``ids`` when within ``limit``, else its last ``limit`` tokens, the first of them
    replaced by ``ids[0]`` when that is the BOS (kept: models are trained with it there)."""
    if limit is None or len(ids) <= limit:
        return list(ids)
    head = ids[:1] if bos_id is not None and ids[0] == bos_id and limit > 1 else []
    return head + ids[len(ids) - (limit - len(head)):]


def token_rows(tokenizer, texts: Sequence[str]) -> List[List[int]]:
    """Each rendered text's token ids, whole (special tokens added unless a chat template
    rendered it: the template has them)."""
    templated = bool(getattr(tokenizer, "chat_template", None))
    return tokenizer(list(texts), add_special_tokens=not templated, verbose=False)["input_ids"]


def encode(tokenizer, texts: Sequence[str], limit: Optional[int]
           ) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """(ids [n, L], mask [n, L], how many texts were over ``limit``): each text's tokens
    (``keep_end`` of them), padded on the tokenizer's side with its pad id."""
    full = token_rows(tokenizer, texts)
    rows = [keep_end(r, limit, tokenizer.bos_token_id) for r in full]
    width = max((len(r) for r in rows), default=0)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.full((len(rows), width), pad, dtype=torch.long)          # [n, L]
    mask = torch.zeros((len(rows), width), dtype=torch.long)             # [n, L]
    left = tokenizer.padding_side == "left"
    for i, r in enumerate(rows):
        start = width - len(r) if left else 0
        ids[i, start:start + len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, start:start + len(r)] = 1
    return ids, mask, sum(len(r) < len(f) for r, f in zip(rows, full))


def text_scores(model, tokenizer, texts: Sequence[str], max_length: Optional[int] = None
                ) -> torch.Tensor:
    """The model's score of each rendered text, [n] float32 (grad flows when enabled);
    ``max_length`` None: ``length_limit`` of the tokenizer and the model's config."""
    limit = max_length if max_length is not None else length_limit(tokenizer, model.config)
    ids, mask, _ = encode(tokenizer, texts, limit)                     # [n, L] each
    device = next(model.parameters()).device
    return last_token_scores(model, ids.to(device), mask.to(device))   # [n]
