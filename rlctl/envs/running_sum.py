"""running_sum: keep a running total, with a reward on every turn (docs/agents.md).

Each turn is the new total (reward 1 if right, on that turn); the next addend follows as
the observation, ``num_additions`` in all, continuing from the true total. Done after the
last; info success (all right) and correct (how many). ``num_eval`` held-out rows
(``random.Random(seed)``), disjoint from training; ``reset``'s seed is unused."""
from __future__ import annotations

import random
from itertools import product
from typing import Tuple

from rlctl.envs.base import EnvTask
from rlctl.envs.calc import read_number, spell
from rlctl.envs.registration import check_int, register_env
from rlctl.tasks.base import disjoint_splits
from rlctl.types import Example, Step, Turn


class RunningSumEnv:
    def __init__(self):
        self.addends: Tuple[int, ...] = ()
        self.total = self.k = self.correct = 0

    def reset(self, example: Example, seed: int) -> str:
        self.addends = tuple(example.fields["addends"])
        self.total, self.k, self.correct = example.fields["start"] + self.addends[0], 1, 0
        return example.prompt

    def step(self, turn: Turn) -> Step:
        right = read_number(turn.text) == self.total
        self.correct += right
        if self.k == len(self.addends):
            return Step(None, float(right), True, {"success": self.correct == self.k,
                                                   "correct": self.correct})
        nxt = self.addends[self.k]
        self.total, self.k = self.total + nxt, self.k + 1
        return Step(f"+ {spell(nxt)} =", float(right), False, {})


def example(start: int, addends: Tuple[int, ...]) -> Example:
    return Example(prompt=f"sum {spell(start)} + {spell(addends[0])} =",
                   fields={"start": start, "addends": list(addends)})


@register_env("running_sum")
def running_sum(num_additions: int = 3, num_eval: int = 256, seed: int = 1234,
                max_train: int = 20000) -> EnvTask:
    check_int("num_additions", num_additions, 1, 12)
    space = 10 * 9 ** num_additions
    check_int("num_eval", num_eval, 0, space - 1)

    def draw(rng: random.Random):
        return rng.randint(0, 9), tuple(rng.randint(1, 9) for _ in range(num_additions))

    def every():
        return ((s, a) for s in range(10) for a in product(range(1, 10), repeat=num_additions))

    held, train = disjoint_splits(draw, random.Random(seed), num_eval, max_train, space, every)
    return EnvTask("running_sum", RunningSumEnv, [example(*r) for r in train],
                   [example(*r) for r in held])
