"""The ``Environment`` interface of episodes (docs/agents.md), ``EnvTask`` and the ``ENVS`` registry."""
from __future__ import annotations

import math
import struct
from typing import Callable, List, Protocol, Sequence

from rlctl.registry import Registry
from rlctl.tasks import register_task
from rlctl.types import Episode, Example, Step, Turn

ENVS = Registry("environment")


class Environment(Protocol):
    def reset(self, example: Example, seed: int) -> str:
        """Start an episode from a dataset row; returns the first observation (prompt)."""

    def step(self, turn: Turn) -> Step:
        """The model's turn -> the next observation (or None), reward, done, info."""

    # Optional: close() -> None, called once the episode has ended (any way).


class EnvTask:
    """A task played as episodes, ``make_env()`` a fresh environment for each."""

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


def episode_success(episode: Episode) -> bool:
    """The one success of an episode (training's ``episode/success_rate``, eval, tables):
    the last ``info["success"]`` the environment set, else the sum of its turn rewards > 0."""
    return episode.success if episode.success is not None else sum(episode.turn_rewards) > 0


def step_flag(name: str, value) -> bool:
    """A step's ``done`` or ``info["success"]`` as a Python or numpy bool; else a ValueError naming it."""
    if isinstance(value, bool) or (type(value).__module__ == "numpy"
                                   and type(value).__name__ in ("bool_", "bool")):
        return bool(value)
    raise ValueError(f"step {name} must be a bool, got {type(value).__name__} {value!r:.40}")


def step_reward(value) -> float:
    """A step's reward as a float finite in float32; else a ValueError naming the field."""
    try:
        x = float(value)
        if math.isfinite(struct.unpack("f", struct.pack("f", x))[0]):    # rounded to float32
            return x
    except (TypeError, ValueError, OverflowError):
        pass
    raise ValueError(f"step reward must be a number finite in float32, got {value!r:.40}")


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
