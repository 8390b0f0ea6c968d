"""The environment interface of multi-turn episodes, and the task that carries one.

An episode starts from a dataset row (an ``Example``) and a seed: ``reset(example, seed)``
gives the first observation (the prompt text). Each ``step(turn)`` takes the model's turn
(``rlctl.types.Turn``: its text and its exact sampled token ids) and answers with a
``rlctl.types.Step``: the next observation or None, a reward, done, and info (which may
set ``stop``, the strings that end the next model turn, and ``success`` for eval).
The framework owns the episode (``rlctl.rollout.episodes``): it keeps the model's token
ids as sampled, tokenizes and appends observations, enforces the budgets and time
limits, and steps the batch's environments concurrently. One environment object serves
one episode; ``EnvTask.make_env()`` builds a fresh one each time.

An ``EnvTask`` is a task (registered in ``rlctl.tasks.TASKS``, so ``task=NAME`` and
``task.name=package.module:factory`` work as for single-turn tasks) whose rows are
played as episodes instead of scored as single completions.
"""
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
    """A task played as episodes: ``train_examples``/``eval_examples`` (disjoint rows)
    and ``make_env()`` (a fresh environment per episode). ``is_correct`` of a single
    completion does not apply; eval reads ``success`` from the episode's last info (or
    its total reward > 0 when the environment never sets it)."""

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
    """``env.close()`` when it has one. A close that raises is logged (once per environment
    class) and ignored: its episode has ended, and the run goes on as after a failed step."""
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
