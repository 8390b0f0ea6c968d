"""The one path a reward model scores by (``render``, ``encode``, ``last_token_scores``)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
import yaml
from safetensors import safe_open
from transformers import AutoModelForSequenceClassification


def score_head(model):
    head = getattr(model, "score", None) or getattr(model, "classifier", None)
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"the reward model {type(model).__name__} has no linear score head "
                         "(score or classifier)")
    return head


def checkpoint_keys(path: Path) -> Optional[set]:
    """The tensor names in the directory's safetensors headers; None when unreadable."""
    index = path / "model.safetensors.index.json"
    try:
        if index.is_file():
            return set(json.loads(index.read_text(encoding="utf-8"))["weight_map"])
        keys: set = set()
        for file in sorted(path.glob("*.safetensors")):
            with safe_open(str(file), "pt") as f:
                keys.update(f.keys())
        return keys
    except Exception:  # noqa: BLE001 - a damaged file: reported where the weights load
        return None


def head_names(model_config) -> List[str]:
    """The score head's parameter names in a meta-device classifier ([]: none built)."""
    try:
        with torch.device("meta"):
            return head_params(AutoModelForSequenceClassification.from_config(model_config))
    except Exception:  # noqa: BLE001 - e.g. remote code: the load-time check still runs
        return []


def head_params(model) -> List[str]:
    head = score_head(model)
    prefix = next(n for n, m in model.named_modules() if m is head)
    return [f"{prefix}.{n}" for n, _ in head.named_parameters()]


def untrained_head_problem(names: Sequence[str], present) -> Optional[str]:
    """Why a checkpoint whose tensors are ``present`` has no trained score head, or None."""
    missing = [n for n in names if not any(k == n or k.endswith("." + n) for k in present)]
    if not missing:
        return None
    return (f"has no trained score head ({', '.join(missing)} missing from its weights: a "
            "sequence-classifier config over a causal LM's weights?), so transformers would "
            "score with a randomly initialised head; fit one with rlctl reward-model train")


READ_KEY = "rlctl_score_read"   # written into config.json by rlctl's fits (rm/fit.py)
LAST_NON_PAD = "last_non_pad"   # transformers' pooling: the last token that is not the pad id
LAST_ATTENDED = "last_attended"  # rlctl's fits before READ_KEY: the last token of the text


def score_read(model_config, path: Optional[Path] = None) -> Tuple[str, str]:
    """(where the score is read, why): ``READ_KEY`` when an rlctl fit recorded it; an older rlctl
    fit at the last token; any other model as transformers' pooling, the last non-pad token."""
    read = getattr(model_config, READ_KEY, None)
    if read in (LAST_NON_PAD, LAST_ATTENDED):
        return read, f"{READ_KEY}={read} in its config (fitted by rlctl)"
    if path is not None and _older_rlctl_fit(Path(path)):
        return LAST_ATTENDED, "fitted by an earlier rlctl, which read the last token"
    return LAST_NON_PAD, "transformers' sequence-classification pooling"


def _older_rlctl_fit(path: Path) -> bool:
    if (path / "rlctl_tiny_rm.json").is_file():
        return True
    run = path.parent
    if path.name != "model" or not (run / "summary.json").is_file():
        return False
    try:
        config = yaml.safe_load((run / "config.yaml").read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(config, dict) and isinstance(config.get("rm"), dict)


def pad_id_of(model_config) -> Optional[int]:
    """The pad id transformers' pooling compares with (the text config's)."""
    text = (model_config.get_text_config() if hasattr(model_config, "get_text_config")
            else model_config)
    pad = getattr(text, "pad_token_id", None)
    return int(pad) if isinstance(pad, int) else None


def read_positions(ids: torch.Tensor, mask: torch.Tensor, read: str,
                   pad_id: Optional[int]) -> torch.Tensor:
    """[n, L] ids and mask -> [n] the index the score is read at in each row: the last attended
    position, or (``LAST_NON_PAD``) the last attended one that is not ``pad_id`` (the first
    attended one when all are pad); padding on either side."""
    attended = mask.bool()                                            # [n, L]
    keep = attended
    if read == LAST_NON_PAD and pad_id is not None:
        keep = attended & (ids != pad_id)                             # [n, L]
        first = attended & (attended.long().cumsum(-1) == 1)          # [n, L] first attended
        keep = torch.where(keep.any(-1, keepdim=True), keep, first)
    return keep.shape[1] - 1 - keep.flip(-1).long().argmax(-1)        # [n]


UNSET_LENGTH = 10 ** 12  # a model_max_length this large is unset (transformers writes 1e30)


def render(tokenizer, prompt: Union[str, List[Dict[str, str]]], completion: str) -> str:
    """The chat template over [prompt, assistant: completion], else ``prompt + completion``."""
    if getattr(tokenizer, "chat_template", None):
        msgs = prompt if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
        return tokenizer.apply_chat_template(
            [*msgs, {"role": "assistant", "content": completion}], tokenize=False)
    prompt = str(prompt)
    if prompt and completion and not prompt[-1].isspace() and not completion[0].isspace():
        return prompt + " " + completion
    return prompt + completion


def last_token_scores(model, ids: torch.Tensor, mask: torch.Tensor,
                      read: Optional[str] = None) -> torch.Tensor:
    """[n, L] ids and mask -> [n] float32 scores: the head at ``read_positions`` (``read``,
    default the config's ``score_read``), positions counted over the mask."""
    read = read or score_read(model.config)[0]
    position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)            # [n, L]
    backbone = getattr(model, model.base_model_prefix)              # e.g. LlamaFor...: .model
    out = backbone(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=False)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]  # [n, L, H]
    last = read_positions(ids, mask, read, pad_id_of(model.config))     # [n]
    h = hidden[torch.arange(ids.shape[0], device=ids.device), last]     # [n, H]
    return score_head(model)(h).squeeze(-1).float()                    # [n]


def length_limit(tokenizer, model_config=None) -> Optional[int]:
    """min(tokenizer ``model_max_length``, the backbone's positions); None when neither is known."""
    known = [n for n in (getattr(tokenizer, "model_max_length", None),
                         getattr(model_config, "max_position_embeddings", None),
                         getattr(model_config, "n_positions", None))
             if isinstance(n, int) and 0 < n < UNSET_LENGTH]
    return min(known) if known else None


def keep_end(ids: List[int], limit: Optional[int], bos_id: Optional[int]) -> List[int]:
    """``ids``, or its last ``limit`` tokens with a leading BOS kept first."""
    if limit is None or len(ids) <= limit:
        return list(ids)
    head = ids[:1] if bos_id is not None and ids[0] == bos_id and limit > 1 else []
    return head + ids[len(ids) - (limit - len(head)):]


def token_rows(tokenizer, texts: Sequence[str]) -> List[List[int]]:
    """Each text's token ids, whole (special tokens added unless a chat template has them)."""
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
    """The model's score of each text, [n] float32; ``max_length`` None: ``length_limit``."""
    limit = max_length if max_length is not None else length_limit(tokenizer, model.config)
    ids, mask, _ = encode(tokenizer, texts, limit)                     # [n, L] each
    device = next(model.parameters()).device
    return last_token_scores(model, ids.to(device), mask.to(device))   # [n]
