"""The environment interface of multi-turn episodes (docs/agents.md), ``EnvTask`` (a task
whose rows are played as episodes) and the registry ``ENVS``: ``reset(example, seed)``
gives the first observation, ``step(turn)`` a ``rlctl.types.Step``; one environment per
episode. The episode loop (``rlctl.rollout.episodes.loop``) owns tokens and time limits."""
from __future__ import annotations

import math
from typing import Callable, List, Protocol, Sequence

from rlctl.registry import Registry
from rlctl.tasks import register_task
from rlctl.types import Example, Step, Turn

ENVS = Registry("environment")


class Environment(Protocol):
    def reset(self, example: Example, seed: int) -> str:
        """Start an episode from a dataset row; returns the first observation (prompt)."""

    def step(self, turn: Turn) -> Step:
        """The model's turn -> the next observation (or None), reward, done, info."""

    # Optional: close() -> None, called once the episode has ended (any way).


class EnvTask:
    """A task played as episodes, ``make_env()`` a fresh environment for each; eval reads
    ``success`` from the last info (else total reward > 0)."""

    def __init__(self, name: str, make_env: Callable[[], Environment],
                 train: Sequence[Example], eval: Sequence[Example]):
        self.name, self.make_env = name, make_env
        self._train, self._eval = list(train), list(eval)

    def train_examples(self) -> List[Example]:
        return list(self._train)

    def eval_examples(self) -> List[Example]:
        return list(self._eval)

    def reward(self, example: Example, completion: str) -> float:   # Task protocol: unused
        raise TypeError(f"task '{self.name}' is played as episodes: its rewards come from "
                        "its environment's steps, not from one completion")

    is_correct = reward


def is_episodic(task) -> bool:
    """True for a task whose rows are played as multi-turn episodes."""
    return callable(getattr(task, "make_env", None))


def register_env(name: str) -> Callable[[Callable], Callable]:
    """Decorator: ``factory(**task options) -> EnvTask`` registered in ``ENVS`` and ``TASKS``."""
    def deco(factory: Callable) -> Callable:
        return register_task(name)(ENVS.register(name)(factory))
    return deco


def check_int(key: str, value, lo: int, hi: float = math.inf) -> int:
    """``value`` if it is an integer in [lo, hi]; else a one-line ValueError naming task.KEY."""
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        where = f">= {lo}" if hi == math.inf else f"in [{lo}, {hi}]"
        raise ValueError(f"task.{key} must be an integer {where}, got {value!r}")
    return value


def check_number(key: str, value, lo: float, unit: str, lo_open: bool = False) -> float:
    """``value`` if it is a finite number >= lo (> lo with ``lo_open``); else one line."""
    ok = (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
          and (value > lo if lo_open else value >= lo))
    if not ok:
        raise ValueError(f"task.{key} must be {'>' if lo_open else '>='} {lo:g} {unit}, got {value!r}")
    return float(value)
