"""Where a training step's rollouts come from, and how a step collects them.

A source has ``sample(num_groups) -> RolloutBatch``, ``after_update()``, ``metrics()``,
``close()``, a ``prompt_rng`` (a ``random.Random`` the checkpoint saves) and the training
``scorer``. ``LocalSource`` samples with the learner's own policy module (the newest weights);
``collect`` makes one step's batch, with DAPO's dynamic sampling: groups whose G rewards are
all equal are dropped and more prompts sampled, up to ``max_rounds`` rollouts.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from rlctl.core import zero_std_groups
from rlctl.models.stop_ids import resolve_stop_ids
from rlctl.rollout.generate import rollout
from rlctl.types import Example, RolloutBatch

SEED_RANGE = 2 ** 31     # the environments' seeds of an episodic task


@dataclass(frozen=True)
class SamplingSettings:
    """How completions are sampled for training (``rollout`` and ``algo``), with the prompt
    sharing the learner's backend allows."""
    group_size: int                 # G
    max_new_tokens: int             # T at most
    temperature: float
    top_k: int = 0                  # 0: the full distribution (train refuses > 0)
    share_prompts: bool = True      # prefill each distinct prompt once
    stop_token_ids: Tuple = ()      # extra stop ids or token strings (rollout.stop_token_ids)
    engine_logprobs: bool = False   # record the sampler's log-probs (algo.rollout_correction.enabled)
    sample_dtype: str = "float32"   # the sampling forwards' precision (rollout.sample_dtype)

    @classmethod
    def from_config(cls, cfg, share_prompts: bool) -> "SamplingSettings":
        ro = cfg.rollout
        return cls(group_size=cfg.algo.group_size, max_new_tokens=ro.max_new_tokens,
                   temperature=ro.temperature, top_k=ro.top_k, share_prompts=share_prompts,
                   stop_token_ids=tuple(ro.get("stop_token_ids", None) or ()),
                   engine_logprobs=bool(cfg.algo.rollout_correction.enabled),
                   sample_dtype=ro.sample_dtype)


class SyncSource:
    """What the synchronous sources share: rows drawn with replacement from ``examples``
    by ``prompt_rng``, no work after an update, no metrics, the scorer closed at the end."""
    examples: List[Example]
    prompt_rng: random.Random
    scorer: object
    player = None       # a source playing episodes: its EpisodePlayer (eval, sample tables)

    def draw(self, num_groups: int) -> List[int]:
        """Indices of the next ``num_groups`` prompts (with replacement)."""
        return [self.prompt_rng.randrange(len(self.examples)) for _ in range(num_groups)]

    def after_update(self) -> None:
        pass

    def metrics(self) -> Dict[str, float]:
        return {}

    def close(self) -> None:
        self.scorer.close()


class LocalSource(SyncSource):
    """The synchronous loop: B prompts from ``examples``, G completions each from ``policy``,
    scored by ``scorer``. ``generate_kwargs``: the backend's (e.g. ``synced_gpus``). The stop
    ids are resolved once (``resolve_stop_ids``) and written into the policy's generation config."""

    def __init__(self, policy, tokenizer, examples: Sequence[Example], scorer,
                 settings: SamplingSettings, seed: int, generate_kwargs: Optional[Dict] = None):
        self.policy, self.tokenizer, self.examples = policy, tokenizer, list(examples)
        self.scorer, self.settings = scorer, settings
        self.prompt_rng = random.Random(seed)
        self.generate_kwargs = dict(generate_kwargs or {})
        self.stops = resolve_stop_ids(policy, tokenizer, settings.stop_token_ids)

    def sample(self, num_groups: int) -> RolloutBatch:
        s = self.settings
        examples = [self.examples[self.prompt_rng.randrange(len(self.examples))]   # as ``draw``
                    for _ in range(num_groups)]
        batch = rollout(self.policy, self.tokenizer, examples, s.group_size, s.max_new_tokens,
                        s.temperature, s.top_k, self.scorer.score_batch,
                        share_prompts=s.share_prompts, stops=self.stops,
                        engine_logprobs=s.engine_logprobs, sample_dtype=s.sample_dtype,
                        **self.generate_kwargs)
        return batch.replace(reward_parts=self.scorer.last_components)   # this batch's, per row


def keep_informative_groups(batch: RolloutBatch) -> RolloutBatch:
    """Rows of the groups whose rewards are not all equal."""
    keep = ~zero_std_groups(batch.rewards.view(-1, batch.group_size))        # [B]
    rows = keep.repeat_interleave(batch.group_size).nonzero().squeeze(-1)  # [N_kept]
    # renumber groups 0..kept-1 so rows of group g stay at g*G .. g*G+G-1
    return batch.select(rows).replace(group_ids=_group_ids(int(keep.sum()), batch.group_size, rows.device))


def _group_ids(num_groups: int, G: int, device) -> torch.Tensor:
    return torch.arange(num_groups, device=device).repeat_interleave(G)        # [B*G]


def collect(sample: Callable[[int], RolloutBatch], num_groups: int, dynamic: bool,
            max_rounds: int, pad_id: int) -> Tuple[RolloutBatch, float]:
    """One step's batch and the fraction of sampled groups kept (1.0 without filtering)."""
    if not dynamic:
        return sample(num_groups), 1.0
    kept: List[RolloutBatch] = []
    have, sampled = 0, 0
    for _ in range(max_rounds):
        batch = sample(num_groups)
        sampled += num_groups
        good = keep_informative_groups(batch)
        n_good = good.num_sequences // batch.group_size
        if n_good:
            take = min(n_good, num_groups - have)
            kept.append(good.select(torch.arange(take * batch.group_size, device=good.mask.device)))
            have += take
        if have >= num_groups:
            break
    if not kept:              # every group constant: train on the last batch (zero advantages)
        return batch, 0.0
    # one batch kept: no re-padding copy; several: stale and fresh old log-probs kept as a pair
    out = kept[0] if len(kept) == 1 else RolloutBatch.concat(kept, pad_id)
    return out.replace(group_ids=_group_ids(have, out.group_size, out.mask.device)), have / sampled
