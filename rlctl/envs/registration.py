"""The registry of environments, and their registration as tasks.

``@register_env(name)`` puts a factory (``factory(**task options) -> EnvTask``) in
``ENVS`` and ``rlctl.tasks.TASKS``. Your own needs no registration:
``task.name=package.module:factory`` returning an ``EnvTask`` is played as episodes."""
from __future__ import annotations

import math
from typing import Callable

from rlctl.registry import Registry
from rlctl.tasks import register_task

ENVS = Registry("environment")


def register_env(name: str) -> Callable[[Callable], Callable]:
    def deco(factory: Callable) -> Callable:
        ENVS.register(name)(factory)
        register_task(name)(factory)
        return factory
    return deco


def check_int(key: str, value, lo: int, hi: float = math.inf) -> int:
    """``value`` if it is an integer in [lo, hi]; else a one-line ValueError naming task.KEY."""
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        where = f">= {lo}" if hi == math.inf else f"in [{lo}, {hi}]"
        raise ValueError(f"task.{key} must be an integer {where}, got {value!r}")
    return value


def check_bool(key: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"task.{key} must be true or false, got {value!r}")
    return value


def check_number(key: str, value, lo: float, unit: str, lo_open: bool = False) -> float:
    """``value`` if it is a finite number >= lo (> lo with ``lo_open``); else one line."""
    ok = (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
          and (value > lo if lo_open else value >= lo))
    if not ok:
        raise ValueError(f"task.{key} must be {'>' if lo_open else '>='} {lo:g} {unit}, got {value!r}")
    return float(value)
