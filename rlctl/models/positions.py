"""Position ids of left-padded inputs, shared by generation and the learner's forward."""
from __future__ import annotations

import torch


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, as ``generate`` assigns them. [N, L] -> [N, L]"""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
