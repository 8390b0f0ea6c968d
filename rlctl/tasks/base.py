"""The Task protocol: prompts for training and held-out evaluation, and a reward."""
from __future__ import annotations

from typing import Callable, Dict, List, Protocol

from rlctl.types import Example


class Task(Protocol):
    name: str

    def train_examples(self) -> List[Example]:
        """Training prompts (sampled with replacement by the engine)."""

    def eval_examples(self) -> List[Example]:
        """Held-out prompts, disjoint from the training prompts."""

    def reward(self, example: Example, completion: str) -> float:
        """Score one decoded completion. Must not raise on malformed text (score 0)."""

    def is_correct(self, example: Example, completion: str) -> bool:
        """Exact correctness, for the eval metric ``eval/exact_match``."""


TaskFactory = Callable[..., Task]
TASKS: Dict[str, TaskFactory] = {}


def register_task(name: str):
    def deco(factory: TaskFactory) -> TaskFactory:
        TASKS[name] = factory
        return factory
    return deco


def build_task(name: str, **options) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task '{name}'; valid: {', '.join(sorted(TASKS))}")
    return TASKS[name](**options)
