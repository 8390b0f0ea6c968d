"""The rollout source of episodic tasks: ``EpisodeSource``, LocalSource's multi-turn twin.

``sample(num_groups)`` draws B rows of the task's training split with its prompt
``sampler`` (a ``random.Random``, checkpointed by the Trainer) and plays G episodes of
each with the learner's own policy module (``EpisodePlayer``); the environments' seed is
drawn from the same sampler, so a resumed run replays the same episodes' seeds. The
rewards come from the environments' steps, so the ``scorer`` (the Trainer reads its
counters and named sums) never scores anything here. ``player`` is what the Trainer's
held-out eval plays episodes with (``rlctl.learner.evaluate.evaluate``).
With local engine processes (rlctl/rollout/engine_source.py) the learner draws the rows
and the seed in the same order and the engines play them with their own ``player``.
"""
from __future__ import annotations

import random

from rlctl.models.stop_ids import resolve_stop_ids
from rlctl.rollout.episodes import EpisodePlayer, EpisodeSettings
from rlctl.rollout.source import SyncSource
from rlctl.types import RolloutBatch

SEED_RANGE = 2 ** 31


class EpisodeSource(SyncSource):
    """B rows x G episodes per ``sample`` of ``prepared``'s training rows
    (``rlctl.tasks.prompt_budget.Prepared``), with ``policy`` (the module the backend trains).
    The stop ids are resolved here once (``resolve_stop_ids``, as LocalSource does) and
    written into the policy's generation config."""

    def __init__(self, policy, tokenizer, prepared, settings: EpisodeSettings, seed: int):
        self.policy, self.tokenizer, self.task, self.settings = policy, tokenizer, prepared.task, settings
        self.examples = list(prepared.train)
        self.prompt_rng = random.Random(seed)
        self.stops = resolve_stop_ids(policy, tokenizer, settings.stop_token_ids)
        self.player = EpisodePlayer(tokenizer, prepared.task, settings, self.stops)
        self.scorer = prepared.scorer(timeout_s=0)     # counters only: rewards are the env's

    def draw_seed(self) -> int:
        """The environments' seed of the next batch (drawn after its rows)."""
        return self.prompt_rng.randrange(SEED_RANGE)

    def sample(self, num_groups: int) -> RolloutBatch:
        examples = [self.examples[i] for i in self.draw(num_groups)]
        return self.player.play(self.policy, examples, self.draw_seed())
