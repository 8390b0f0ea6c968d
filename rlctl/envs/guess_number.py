"""guess_number: find a number in 1..N with higher/lower answers.

Prompt ``guess 1 6 :`` (N = ``max_number``, spelled as digits). Each model turn is a
number (``8``, or ``1 2`` for 12); the observation is ``higher`` (the secret is larger)
or ``lower``; a turn that is not a number is answered ``error``. The correct guess:
reward 1, done, info success. The episode's length is bounded by
``rollout.episode.max_turns``; binary search needs at most ceil(log2 N) turns.

Splits: the secret numbers 1..N, ``num_eval`` of them (drawn with ``random.Random(seed)``)
held out, the others for training; they never overlap. ``reset``'s seed is unused: an
episode is fixed by its row.
"""
from __future__ import annotations

import random

from rlctl.envs.base import EnvTask
from rlctl.envs.calc import read_number, spell
from rlctl.envs.registration import check_int, register_env
from rlctl.tasks.base import disjoint_splits
from rlctl.types import Example, Step, Turn

HIGHER, LOWER, ERROR = "higher", "lower", "error"


class GuessNumberEnv:
    def __init__(self, max_number: int):
        self.max_number = max_number
        self.secret = 0

    def reset(self, example: Example, seed: int) -> str:
        self.secret = example.fields["secret"]
        return example.prompt

    def step(self, turn: Turn) -> Step:
        guess = read_number(turn.text)
        if guess is None:
            return Step(ERROR, 0.0, False, {"valid": False})
        if guess == self.secret:
            return Step(None, 1.0, True, {"success": True})
        return Step(HIGHER if guess < self.secret else LOWER, 0.0, False, {})


def example(secret: int, max_number: int) -> Example:
    return Example(prompt=f"guess {spell(max_number)} :",
                   fields={"secret": secret, "max_number": max_number})


@register_env("guess_number")
def guess_number(max_number: int = 16, num_eval: int = 4, seed: int = 1234) -> EnvTask:
    check_int("max_number", max_number, 2)
    check_int("num_eval", num_eval, 0, max_number - 1)
    held, train = disjoint_splits(lambda rng: rng.randint(1, max_number), random.Random(seed),
                                  num_eval, max_number, max_number, lambda: range(1, max_number + 1))
    return EnvTask("guess_number", lambda: GuessNumberEnv(max_number),
                   [example(s, max_number) for s in train], [example(s, max_number) for s in held])
