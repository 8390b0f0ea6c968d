"""The built-in environments, registered as tasks (docs/agents.md)."""
from __future__ import annotations

import random
from itertools import product
from typing import Tuple

from rlctl.envs import calc as calc_module
from rlctl.envs.environment import EnvTask, check_int, check_number, register_env
from rlctl.envs.calc import calc, read_number
from rlctl.envs.tools import Limits, ToolEnv, make_tool
from rlctl.tasks.arithmetic import spaced
from rlctl.tasks.task import disjoint_splits
from rlctl.types import Example, Step, Turn

A_RANGE, B_RANGE = (100, 999), (10, 99)
# the sandbox loads calc from its file: rlctl.envs would import torch (too big there)
CALC_SOURCE = f"{calc_module.__file__}:calc"
SPACE = (A_RANGE[1] - A_RANGE[0] + 1) * (B_RANGE[1] - B_RANGE[0] + 1)
HIGHER, LOWER, ERROR = "higher", "lower", "error"
EVAL_PER_SECRET = 100           # guess_number's num_eval at most this many times max_number


def product_example(a: int, b: int) -> Example:
    return Example(prompt=f"{spaced(a)} * {spaced(b)} =", fields={"a": a, "b": b, "answer": a * b})


def check_answer(ex: Example, text: str) -> float:
    return float(read_number(text) == ex.fields["answer"])


def _draw_pair(rng: random.Random) -> Tuple[int, int]:
    return rng.randint(*A_RANGE), rng.randint(*B_RANGE)


def _all_pairs():
    return ((a, b) for a in range(A_RANGE[0], A_RANGE[1] + 1) for b in range(B_RANGE[0], B_RANGE[1] + 1))


@register_env("calculator")
def calculator(use_tools: bool = True, tool_parser: str = "tag", sandbox: str = "none",
               max_tool_calls: int = 2, tool_timeout_s: float = 5.0, tool_memory_gb: float = 0.5,
               num_eval: int = 256, seed: int = 1234, max_train: int = 20000) -> EnvTask:
    if not isinstance(use_tools, bool):
        raise ValueError(f"task.use_tools must be true or false, got {use_tools!r}")
    check_int("num_eval", num_eval, 0, SPACE - 1)
    check_number("tool_memory_gb", tool_memory_gb, 0.05, "(GB)")
    check_number("tool_timeout_s", tool_timeout_s, 0, "seconds", lo_open=True)
    limits = Limits(timeout_s=float(tool_timeout_s), memory_mb=int(tool_memory_gb * 1024))

    tool = make_tool(calc, source=CALC_SOURCE)

    def make_env() -> ToolEnv:
        return ToolEnv([tool], check_answer, parser=tool_parser, sandbox=sandbox, limits=limits,
                       max_tool_calls=max_tool_calls, format_result=spaced, use_tools=use_tools)

    make_env()   # the options' errors now, not at the first episode
    eval_pairs, train_pairs = disjoint_splits(_draw_pair, random.Random(seed), num_eval, max_train,
                                              SPACE, _all_pairs)
    return EnvTask("calculator", make_env, [product_example(*p) for p in train_pairs],
                   [product_example(*p) for p in eval_pairs])


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


def guess_example(secret: int, max_number: int) -> Example:
    return Example(prompt=f"guess {spaced(max_number)} :",
                   fields={"secret": secret, "max_number": max_number})


@register_env("guess_number")
def guess_number(max_number: int = 16, num_eval: int = 16, seed: int = 1234) -> EnvTask:
    check_int("max_number", max_number, 2)
    check_int("num_eval", num_eval, 0, EVAL_PER_SECRET * max_number)
    secrets = list(range(1, max_number + 1))
    random.Random(seed).shuffle(secrets)
    held = [secrets[j % max_number] for j in range(num_eval)]
    return EnvTask("guess_number", lambda: GuessNumberEnv(max_number),
                   [guess_example(s, max_number) for s in secrets],
                   [guess_example(s, max_number) for s in held])


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
        return Step(f"+ {spaced(nxt)} =", float(right), False, {})


def sum_example(start: int, addends: Tuple[int, ...]) -> Example:
    return Example(prompt=f"sum {spaced(start)} + {spaced(addends[0])} =",
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
    return EnvTask("running_sum", RunningSumEnv, [sum_example(*r) for r in train],
                   [sum_example(*r) for r in held])
