"""calculator: 3-digit by 2-digit multiplication with a calculator tool (docs/agents.md).
Reward 1 for the exact product on the answering turn; ``use_tools=false`` (the ablation)
parses no calls. ``num_eval`` held-out (a, b) pairs (``random.Random(seed)``), disjoint
from training (``rlctl.tasks.base.disjoint_splits``)."""
from __future__ import annotations

import random
from typing import Tuple

from rlctl.envs.base import EnvTask
from rlctl.envs import calc as calc_module
from rlctl.envs.calc import calc, read_number, spell
from rlctl.envs.registration import check_bool, check_int, check_number, register_env
from rlctl.envs.sandbox import Limits
from rlctl.envs.tool_env import ToolEnv
from rlctl.envs.tools import make_tool
from rlctl.tasks.base import disjoint_splits
from rlctl.types import Example

A_RANGE, B_RANGE = (100, 999), (10, 99)
# The sandboxed interpreter loads calc from its file: importing rlctl.envs would import
# rlctl.tasks and torch there (too big for the sandbox's memory limit, and slow).
CALC_SOURCE = f"{calc_module.__file__}:calc"
SPACE = (A_RANGE[1] - A_RANGE[0] + 1) * (B_RANGE[1] - B_RANGE[0] + 1)


def example(a: int, b: int) -> Example:
    return Example(prompt=f"{spell(a)} * {spell(b)} =", fields={"a": a, "b": b, "answer": a * b})


def check_answer(ex: Example, text: str) -> float:
    return float(read_number(text) == ex.fields["answer"])


def _draw(rng: random.Random) -> Tuple[int, int]:
    return rng.randint(*A_RANGE), rng.randint(*B_RANGE)


def _all():
    return ((a, b) for a in range(A_RANGE[0], A_RANGE[1] + 1) for b in range(B_RANGE[0], B_RANGE[1] + 1))


@register_env("calculator")
def calculator(use_tools: bool = True, tool_parser: str = "tag", sandbox: str = "none",
               max_tool_calls: int = 2, tool_timeout_s: float = 5.0, tool_memory_gb: float = 0.5,
               num_eval: int = 256, seed: int = 1234, max_train: int = 20000) -> EnvTask:
    check_bool("use_tools", use_tools)
    check_int("num_eval", num_eval, 0, SPACE - 1)
    check_number("tool_memory_gb", tool_memory_gb, 0.05, "(GB)")
    check_number("tool_timeout_s", tool_timeout_s, 0, "seconds", lo_open=True)
    limits = Limits(timeout_s=float(tool_timeout_s), memory_mb=int(tool_memory_gb * 1024))

    tool = make_tool(calc, source=CALC_SOURCE)

    def make_env() -> ToolEnv:
        return ToolEnv([tool], check_answer, parser=tool_parser, sandbox=sandbox, limits=limits,
                       max_tool_calls=max_tool_calls, format_result=spell, use_tools=use_tools)

    make_env()   # the options' errors now, not at the first episode
    eval_pairs, train_pairs = disjoint_splits(_draw, random.Random(seed), num_eval, max_train,
                                              SPACE, _all)
    return EnvTask("calculator", make_env, [example(*p) for p in train_pairs],
                   [example(*p) for p in eval_pairs])
