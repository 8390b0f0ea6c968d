"""A batch of episodes between processes: what a rollout actor sends beside the tensors.

An episodic rollout's reply (rlctl/rollout/actors.py) carries, after the tensors every
reply has, ``token_rewards`` [N, T] (float32 on the wire, as ``rewards``) and one UTF-8
JSON text: the N ``Episode`` records (spans with their columns, status, counts, turn
rewards), the first observations as the prompts, and the decoded transcripts as the
completions. A few hundred bytes per episode: the tensors dominate the message.
"""
from __future__ import annotations

import dataclasses
import json
from typing import List, Tuple

import torch

from rlctl.types import Episode, RolloutBatch, Span


def episode_text(batch: RolloutBatch) -> torch.Tensor:
    """The batch's episodes, prompts and completions as JSON bytes [E] uint8."""
    blob = json.dumps({"episodes": [dataclasses.asdict(e) for e in batch.episodes],
                       "prompts": list(batch.prompts), "completions": list(batch.completions)})
    return torch.tensor(list(blob.encode("utf-8")), dtype=torch.uint8)


def episodes_of(blob: torch.Tensor) -> Tuple[List[Episode], List[str], List[str]]:
    """Inverse of ``episode_text``: (episodes, prompts, completions)."""
    data = json.loads(blob.numpy().tobytes().decode("utf-8"))
    episodes = [Episode(**{**e, "spans": [Span(**s) for s in e["spans"]]}) for e in data["episodes"]]
    return episodes, data["prompts"], data["completions"]
