"""Where a step's rollouts come from: ``Source``, ``SyncSource``, ``collect`` (DAPO's dynamic sampling)."""
from __future__ import annotations

import random
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

import torch

from rlctl.config.schema import AlgoConfig, RolloutConfig
from rlctl.core import zero_std_groups
from rlctl.models.stop_ids import resolve_stop_ids
from rlctl.rollout.generate import rollout
from rlctl.tasks.scoring import RewardScorer
from rlctl.types import Example, RolloutBatch

SEED_RANGE = 2 ** 31     # the environments' seeds of an episodic task


class Source(Protocol):
    """What the trainer asks of a rollout source."""
    prompt_rng: random.Random      # draws the rows; its state is checkpointed
    scorer: RewardScorer           # the training rewards and their counters
    player: Optional[Any]          # an episodic task's EpisodePlayer (eval, sample tables), else None

    def sample(self, num_groups: int) -> RolloutBatch:
        """``num_groups`` prompts x G completions (or episodes)."""

    def after_update(self) -> None:
        """The learner's weights moved on (one optimizer step per rollout)."""

    def metrics(self) -> Dict[str, float]:
        """The source's own metrics since the last call (async/*, time/*, engine/*)."""

    def close(self) -> None:
        """Stops what the source started (engines, reward workers)."""


class SyncSource(Source):
    """Rows drawn with replacement by ``prompt_rng``; no metrics; the scorer closed at the end."""
    examples: List[Example]
    player = None

    def draw(self, num_groups: int) -> List[int]:
        return [self.prompt_rng.randrange(len(self.examples)) for _ in range(num_groups)]

    def after_update(self) -> None:
        pass

    def metrics(self) -> Dict[str, float]:
        return {}

    def close(self) -> None:
        self.scorer.close()


class LocalSource(SyncSource):
    """The synchronous loop: B prompts x ``algo.group_size`` completions sampled from ``policy``."""

    def __init__(self, policy, tokenizer, examples: Sequence[Example], scorer,
                 rollout: RolloutConfig, algo: AlgoConfig, share_prompts: bool, seed: int,
                 generate_kwargs: Optional[Dict] = None):
        self.policy, self.tokenizer, self.examples = policy, tokenizer, list(examples)
        self.scorer, self.rollout, self.share_prompts = scorer, rollout, share_prompts
        self.group_size = algo.group_size
        self.engine_logprobs = bool(algo.rollout_correction.enabled)
        self.prompt_rng = random.Random(seed)
        self.generate_kwargs = dict(generate_kwargs or {})
        self.stops = resolve_stop_ids(policy, tokenizer, tuple(rollout.stop_token_ids or ()))

    def sample(self, num_groups: int) -> RolloutBatch:
        ro = self.rollout
        examples = [self.examples[i] for i in self.draw(num_groups)]
        batch = rollout(self.policy, self.tokenizer, examples, self.group_size, ro.max_new_tokens,
                        ro.temperature, ro.top_k, self.scorer.score_batch,
                        share_prompts=self.share_prompts, stops=self.stops,
                        engine_logprobs=self.engine_logprobs, sample_dtype=ro.sample_dtype,
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
