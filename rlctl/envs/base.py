"""The environment interface of multi-turn episodes, and the task that carries one
(docs/agents.md).

``reset(example, seed)`` gives the first observation (the prompt text); ``step(turn)``
takes a ``rlctl.types.Turn`` (text and exact sampled ids) and returns a
``rlctl.types.Step``. The episode loop (``rlctl.rollout.episodes``) owns tokenization,
budgets and time limits. One environment object serves one episode. An ``EnvTask`` is a
task (in ``rlctl.tasks.TASKS``) whose rows are played as episodes."""
from __future__ import annotations

import logging
from typing import Callable, List, Optional, Protocol, Sequence, Set

from rlctl.types import Example, Step, Turn

log = logging.getLogger(__name__)
_CLOSE_FAILED: Set[str] = set()     # environment classes whose close() raised (said once)


class Environment(Protocol):
    def reset(self, example: Example, seed: int) -> str:
        """Start an episode from a dataset row; returns the first observation (prompt)."""

    def step(self, turn: Turn) -> Step:
        """The model's turn -> the next observation (or None), reward, done, info."""

    # Optional: close() -> None, called once the episode has ended (any way).


class EnvTask:
    """A task played as episodes: ``train_examples``/``eval_examples`` (disjoint rows) and
    ``make_env()`` (a fresh environment per episode). Eval reads ``success`` from the last
    info (else total reward > 0)."""

    def __init__(self, name: str, make_env: Callable[[], Environment],
                 train: Sequence[Example], eval: Sequence[Example]):
        self.name = name
        self._make_env, self._train, self._eval = make_env, list(train), list(eval)

    def make_env(self) -> Environment:
        return self._make_env()

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


def close_env(env: Optional[Environment]) -> None:
    """``env.close()`` when it has one; a raise is logged (once per class) and ignored."""
    close = getattr(env, "close", None)
    if not callable(close):
        return
    try:
        close()
    except Exception as exc:  # noqa: BLE001 - user code; the episode is already recorded
        name = type(env).__name__
        if name not in _CLOSE_FAILED:
            _CLOSE_FAILED.add(name)
            log.warning("environment %s: close() raised %s: %s (ignored; said once)", name,
                        type(exc).__name__, " ".join(str(exc).split())[:200])
