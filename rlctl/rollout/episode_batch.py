"""The played episodes as the learner's batch (the contract in ``rlctl.types.RolloutBatch``).

Row i: the first observation left-padded to P, then the transcript (model turns and
observations, in order) right-padded to T with the pad id. ``attention_mask`` is 1 on
every real token, observations included; ``mask`` 1 on the model's own tokens only;
``old_logprobs`` the behaviour log-probs on model tokens, 0 elsewhere (``engine_logprobs``
the same values, kept apart for the rollout correction); ``truncated`` every
episode that did not end with ``done``; ``rewards`` [N] and ``token_rewards`` [N, T] from
the turn rewards by ``rollout.episode.turn_reward`` (``rlctl.core.turns``: w_k r_k on the
last token of model turn k); ``completions`` the transcript decoded with its special
tokens (the turn markers the model saw); ``prompts`` the first observation as given.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from rlctl.core.turns import place_turn_rewards
from rlctl.rollout.env_steps import Outcome
from rlctl.types import DONE, MODEL, Episode, RolloutBatch


@dataclass
class EpisodeRun:
    """One episode in play."""
    env: Any
    prompt: str
    prompt_ids: List[int]
    messages: List[Dict[str, str]]
    ids: List[int] = field(default_factory=list)        # the transcript (completion columns)
    logps: List[float] = field(default_factory=list)    # per transcript column (0 on observations)
    episode: Episode = field(default_factory=Episode)
    stop_strings: Tuple[str, ...] = ()
    ended: bool = False
    last: Optional[Outcome] = None                      # the last env call (busy if abandoned)

    def end(self, status: str) -> None:
        self.episode.status, self.ended = status, True


def episode_batch(runs: List[EpisodeRun], tokenizer, turn_reward: str, turn_discount: float,
                  G: int, stops: Sequence[int], device, logp_dtype: torch.dtype = torch.float32
                  ) -> RolloutBatch:
    """The played episodes as a RolloutBatch (see the module docstring);
    ``logp_dtype``: the behaviour log-probs' (float64 for a float64 model)."""
    N, pad = len(runs), tokenizer.pad_token_id if tokenizer.pad_token_id is not None else int(stops[0])
    P = max(len(r.prompt_ids) for r in runs)
    T = max(1, max(len(r.ids) for r in runs))           # at least one column
    input_ids = torch.full((N, P + T), pad, dtype=torch.long)                      # [N, P+T]
    attention = torch.zeros(N, P + T, dtype=torch.long)                            # [N, P+T]
    mask = torch.zeros(N, T)                                                       # [N, T]
    old = torch.zeros(N, T, dtype=torch.float64)                                   # [N, T]
    for i, r in enumerate(runs):
        p, t = len(r.prompt_ids), len(r.ids)
        input_ids[i, P - p:P] = torch.tensor(r.prompt_ids, dtype=torch.long)
        input_ids[i, P:P + t] = torch.tensor(r.ids, dtype=torch.long)
        attention[i, P - p:P + t] = 1
        old[i, :t] = torch.tensor(r.logps, dtype=torch.float64)
        for s in r.episode.spans:
            if s.role == MODEL:
                mask[i, s.start:s.end] = 1.0
    ends = [[s.end - 1 for s in r.episode.spans if s.role == MODEL] for r in runs]
    behaviour = (old * mask.double()).to(device, logp_dtype)                         # [N, T]
    rewards, token_rewards = place_turn_rewards([r.episode.turn_rewards for r in runs], ends, T,
                                                turn_reward, turn_discount)
    return RolloutBatch(
        input_ids=input_ids.to(device), attention_mask=attention.to(device), mask=mask.to(device),
        truncated=torch.tensor([r.episode.status != DONE for r in runs], device=device),
        rewards=rewards.to(device), group_ids=torch.arange(N, device=device) // G,
        prompt_len=P, group_size=G, prompts=[r.prompt for r in runs],
        completions=[tokenizer.decode(r.ids, skip_special_tokens=False) for r in runs],
        old_logprobs=behaviour, engine_logprobs=behaviour,
        token_rewards=token_rewards.to(device), episodes=[r.episode for r in runs])

