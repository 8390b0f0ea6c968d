"""What a reward-model checkpoint says about itself before its weights load: the names
of its tensors (safetensors headers only) and whether its score head was trained, i.e.
saved with the weights rather than initialised at random by transformers (a
sequence-classifier config over a causal LM's weights)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional, Sequence

import torch
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


def head_names(config) -> List[str]:
    """The score head's parameter names in a classifier built from ``config`` (on the
    meta device: no memory); [] when the skeleton cannot be built."""
    try:
        with torch.device("meta"):
            return head_params(AutoModelForSequenceClassification.from_config(config))
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
