"""Typed containers passed between rollout, scoring and the learner.

Shape letters (fixed across the code base): B prompts per step, G samples per prompt,
N = B * G sequences, P prompt length (left-padded), T completion length (right-padded),
V vocabulary size.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch


@dataclass
class Example:
    """One prompt of a task: the text fed to the model and what its reward needs."""
    prompt: str
    fields: Dict[str, Any] = field(default_factory=dict)


@dataclass
class RolloutBatch:
    """N = B*G sampled completions and everything the learner needs.

    Shapes:
        input_ids:      [N, P+T] long; prompt left-padded, completion right-padded
        attention_mask: [N, P+T] long; 1 on real prompt and completion tokens
        completion_ids: [N, T]   long; = input_ids[:, P:]
        mask:           [N, T]   float; 1 on completion tokens that count (EOS included,
                                  padding after EOS excluded)
        truncated:      [N]      bool; no EOS within the length limit
        rewards:        [N]      float; task reward of each completion
        group_ids:      [N]      long; index of the prompt (0..B-1); rows of a group are
                                  contiguous, group g is rows g*G .. g*G+G-1
        old_logprobs:   [N, T]   log pi_old(token) at rollout time, or None (single pass:
                                  the learner uses its own detached log-probs)
        ref_logprobs:   [N, T]   log pi_ref(token), or None when no KL term is used
        advantages:     [N, T]   float; filled in by the advantage estimator
        old_values:     [N, T]   critic values V(s_t) at rollout time (critic only), where
                                  s_t is the prompt plus the first t completion tokens
        returns:        [N, T]   value targets (GAE advantages + old values), detached
        behaviour_rows: [N]      bool, or None; set when old_logprobs hold the behaviour
                                  policy's log-probs in some rows only (a step that mixes
                                  stale and on-policy async rollouts): the False rows are
                                  placeholders the learner fills from its pi_old forward.
                                  None: old_logprobs (when present) hold in every row
    """
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    mask: torch.Tensor
    truncated: torch.Tensor
    rewards: torch.Tensor
    group_ids: torch.Tensor
    prompt_len: int
    group_size: int
    prompts: List[str]
    completions: List[str]
    old_logprobs: Optional[torch.Tensor] = None
    ref_logprobs: Optional[torch.Tensor] = None
    advantages: Optional[torch.Tensor] = None
    old_values: Optional[torch.Tensor] = None
    returns: Optional[torch.Tensor] = None
    behaviour_rows: Optional[torch.Tensor] = None

    @property
    def completion_ids(self) -> torch.Tensor:
        return self.input_ids[:, self.prompt_len:]  # [N, T]

    @property
    def num_sequences(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: torch.Tensor) -> "RolloutBatch":
        """A view on some rows (a micro-batch); tensors are indexed, lists filtered."""
        idx = rows.tolist()
        pick = lambda t: None if t is None else t[rows]  # noqa: E731
        return RolloutBatch(
            input_ids=self.input_ids[rows], attention_mask=self.attention_mask[rows],
            mask=self.mask[rows], truncated=self.truncated[rows], rewards=self.rewards[rows],
            group_ids=self.group_ids[rows], prompt_len=self.prompt_len,
            group_size=self.group_size, prompts=[self.prompts[i] for i in idx],
            completions=[self.completions[i] for i in idx],
            old_logprobs=pick(self.old_logprobs), ref_logprobs=pick(self.ref_logprobs),
            advantages=pick(self.advantages), old_values=pick(self.old_values),
            returns=pick(self.returns), behaviour_rows=pick(self.behaviour_rows))
