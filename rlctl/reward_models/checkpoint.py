"""What a reward-model checkpoint says before its weights load: its tensor names
(safetensors headers), whether its score head was trained (not initialised at random by
transformers), and where its score is read (``score_read``)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

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
    """The tensor names in the directory's safetensors weights (headers only, nothing
    loaded); None when they cannot be read (the loader then says why)."""
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
    """The score head's parameter names in a classifier built from ``model_config`` (on the
    meta device: no memory); [] when the skeleton cannot be built."""
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


# ---- where the score is read ---------------------------------------------------------------
READ_KEY = "rlctl_score_read"   # written into config.json by rlctl's fits (reward_models/fit.py)
LAST_NON_PAD = "last_non_pad"   # transformers' pooling: the last token that is not the pad id
LAST_ATTENDED = "last_attended"  # rlctl's fits before READ_KEY: the last token of the text


def score_read(model_config, path: Optional[Path] = None) -> Tuple[str, str]:
    """(where the score is read, why) for the reward model saved in ``path``: rlctl's fits
    record it (``READ_KEY``); an older rlctl fit (no ``READ_KEY``) is read at the last token;
    any other model where transformers' ``*ForSequenceClassification`` reads it, the last
    token that is not ``model_config.pad_token_id``."""
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
