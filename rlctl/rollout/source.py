"""Where a training step's rollouts come from: the synchronous local source.

A source has ``sample(num_groups) -> RolloutBatch``, ``after_update()`` (the learner
stepped), ``metrics()``, ``close()``, a prompt ``sampler`` (a ``random.Random`` whose
state the checkpoint saves) and the training ``scorer``; nothing else is read by the
Trainer (it decides its own prompt sharing from its backend). ``LocalSource`` samples with
the learner's own policy module: the very object the backend trains, so each rollout
is made with the newest weights. The asynchronous source (local engine processes)
is ``rlctl.rollout.engine_source.EngineSource``; the caller picks one and hands it to
the Trainer.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from rlctl.models.stop_ids import resolve_stop_ids
from rlctl.rollout.generate import rollout
from rlctl.types import Example, RolloutBatch


@dataclass(frozen=True)
class SamplingSettings:
    """How completions are sampled for training, derived from the ``rollout`` and ``algo``
    sections: the prompt sharing the learner's backend allows, whether the sampler's
    log-probs are recorded (``algo.rollout_correction.enabled``)."""
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
    by ``sampler`` (checkpointed by the Trainer), nothing to do after an update, no
    metrics of their own, and the scorer closed at the end."""
    examples: List[Example]
    sampler: random.Random
    scorer: object

    def draw(self, num_groups: int) -> List[int]:
        """Indices of the next ``num_groups`` prompts (with replacement)."""
        return [self.sampler.randrange(len(self.examples)) for _ in range(num_groups)]

    def after_update(self) -> None:
        pass

    def metrics(self) -> Dict[str, float]:
        return {}

    def close(self) -> None:
        self.scorer.close()


class LocalSource(SyncSource):
    """The synchronous loop: B prompts drawn from ``examples`` with ``sampler``, G
    completions each from ``policy``, scored by ``scorer`` (a ``RewardScorer``).
    ``generate_kwargs``: the backend's (e.g. ``synced_gpus`` under multi-rank ZeRO-3).
    The stop ids are resolved here once (``resolve_stop_ids``: tokenizer EOS, the model's
    generation config and ``settings.stop_token_ids``, validated) and written into the
    policy's generation config, so eval and the saved model use the same set."""

    def __init__(self, policy, tokenizer, examples: Sequence[Example], scorer,
                 settings: SamplingSettings, seed: int, generate_kwargs: Optional[Dict] = None):
        self.policy, self.tokenizer, self.examples = policy, tokenizer, list(examples)
        self.scorer, self.settings = scorer, settings
        self.sampler = random.Random(seed)
        self.generate_kwargs = dict(generate_kwargs or {})
        self.stops = resolve_stop_ids(policy, tokenizer, settings.stop_token_ids)

    def sample(self, num_groups: int) -> RolloutBatch:
        s = self.settings
        examples = [self.examples[i] for i in self.draw(num_groups)]
        batch = rollout(self.policy, self.tokenizer, examples, s.group_size, s.max_new_tokens,
                        s.temperature, s.top_k, self.scorer.score_batch,
                        share_prompts=s.share_prompts, stops=self.stops,
                        engine_logprobs=s.engine_logprobs, sample_dtype=s.sample_dtype,
                        **self.generate_kwargs)
        return batch.replace(reward_parts=self.scorer.last_components)   # this batch's, per row
