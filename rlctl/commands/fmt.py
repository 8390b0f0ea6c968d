"""Formatting helpers shared by the inspect tables."""
from __future__ import annotations

import math
from typing import Any, Dict, Mapping


def flatten(tree: Any, prefix: str = "") -> Dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists stay values."""
    if not isinstance(tree, Mapping):
        return {prefix: tree} if prefix else {}
    out: Dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, name))
        else:
            out[name] = value
    return out


def show(value: Any, digits: int = 4) -> str:
    """A compact cell: ``digits`` significant digits for floats, YAML-like null/true/false."""
    if value is MISSING:
        return "(absent)"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        return f"{value:.{digits}g}"
    return str(value)


class _Missing:
    def __repr__(self) -> str:
        return "(absent)"


MISSING = _Missing()
