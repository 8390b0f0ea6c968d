"""guess_number: find a number in 1..N with higher/lower answers (docs/agents.md).

Reward 1 on the correct guess; done, success; a non-number turn is answered ``error``.
Nothing is held out (the prompt is the same for every secret, so a split by secret would
measure memorisation): training plays secrets 1..N once each in a ``random.Random(seed)``
order, eval row j plays the (j mod N)-th of that order. ``reset``'s seed is unused."""
from __future__ import annotations

import random

from rlctl.envs.base import EnvTask
from rlctl.envs.calc import read_number, spell
from rlctl.envs.registration import check_int, register_env
from rlctl.types import Example, Step, Turn

HIGHER, LOWER, ERROR = "higher", "lower", "error"
EVAL_PER_SECRET = 100           # num_eval at most this many times max_number


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
def guess_number(max_number: int = 16, num_eval: int = 16, seed: int = 1234) -> EnvTask:
    check_int("max_number", max_number, 2)
    check_int("num_eval", num_eval, 0, EVAL_PER_SECRET * max_number)
    secrets = list(range(1, max_number + 1))
    random.Random(seed).shuffle(secrets)
    held = [secrets[j % max_number] for j in range(num_eval)]
    return EnvTask("guess_number", lambda: GuessNumberEnv(max_number),
                   [example(s, max_number) for s in secrets], [example(s, max_number) for s in held])
