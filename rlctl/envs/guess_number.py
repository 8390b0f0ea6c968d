"""guess_number: find a number in 1..N with higher/lower answers.

Prompt ``guess 1 6 :`` (N = ``max_number``, spelled as digits). Each model turn is a
number (``8``, or ``1 2`` for 12); the observation is ``higher`` (the secret is larger)
or ``lower``; a turn that is not a number is answered ``error``. The correct guess:
reward 1, done, info success. The episode's length is bounded by
``rollout.episode.max_turns``; binary search needs at most ceil(log2 N) turns.

Splits: every secret, in both. The prompt is the same for every secret and there are
only N of them, so a split by secret would hold out numbers that training never rewards
(GRPO then learns never to say them) and would measure memorisation, not the search.
So the training rows are the secrets 1..N, each once (in an order shuffled with
``random.Random(seed)``), and the eval rows go through that same order, ``num_eval`` of
them (row j has the (j mod N)-th secret): ``num_eval = N`` scores the policy once on
every secret, a multiple of N equally often on each, fewer on a seeded subset. Nothing
is held out: eval measures the strategy on every secret, and every secret is also played
in training. An episode is fixed by its row's secret (``reset``'s seed is unused), so a
greedy episode per secret is the whole picture of a greedy policy.
"""
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
