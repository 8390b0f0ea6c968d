"""Hydra's and OmegaConf's composition failures as one line naming the key and what is
valid: an unknown group option or key, a value of the wrong type, an unparsable override."""
from __future__ import annotations

import re
from typing import List, Sequence

from omegaconf import DictConfig, OmegaConf

from rlctl.config import example_value
from rlctl.errors import one_line
from rlctl.overrides import GRAMMAR_ERRORS, grammar_message
from rlctl.schema import GROUPS, RLConfig, group_options, schema_fields


def explain(exc: Exception, overrides: Sequence[str]) -> str:
    """Turn Hydra/OmegaConf exceptions into one line naming the key and valid values."""
    parts, seen = [], exc
    while seen is not None and len(parts) < 5:
        parts.append(one_line(seen))
        seen = seen.__cause__ or seen.__context__
    msg = " | ".join(parts)
    m = re.search(r"Could not (?:find|load) '(\w+)/([^']*)'", msg)  # load: in a list
    if m and m.group(1) in GROUPS:
        group, bad = m.groups()
        return f"unknown {group} '{bad}'; valid: {', '.join(group_options(group))}"
    m = re.search(r"Could not override '([^']+)'", msg) or re.search(
        r"Key '[^']+' not in '\w+' full_key: ([\w.]+)", msg)
    if m:
        return _unknown_key(m.group(1))
    m = re.search(r"full_key: ([\w.]+)", msg)
    if m and any(t in msg for t in TYPE_ERRORS):
        return _type_message(m.group(1), msg, overrides)
    if any(t in msg for t in GRAMMAR_ERRORS):
        return grammar_message(msg, overrides)
    return parts[-1] if len(parts) > 1 and "Error merging" in parts[0] else parts[0]


TYPE_ERRORS = ("could not be converted", "is not a valid bool", "is not a ListConfig",
               "is not a subclass of", "is not Optional", "Incompatible value")
KIND_NAMES = {"float": "a float", "int": "an integer", "bool": "a boolean",
              "str": "a string", "list": "a list", "any": "a value"}


def _unknown_key(key: str) -> str:
    parent, _, _ = key.rpartition(".")
    valid = _valid_keys(parent)
    hint = f"; valid keys of '{parent or 'the root'}': {', '.join(valid)}" if valid else ""
    return f"unknown config key '{key}'{hint}"


def _given_value(key: str, msg: str, overrides: Sequence[str]) -> str:
    """The value as the user typed it (the override), else as OmegaConf quotes it."""
    for o in overrides:
        k, eq, v = o.partition("=")
        if eq and k.lstrip("+~") == key:
            return v
    m = re.search(r"[Vv]alue '(.*?)'(?: of type| is not a valid| for field)", msg) \
        or re.search(r"value: (\S+)", msg)
    return m.group(1) if m else "null" if "not Optional" in msg else "?"


def _type_message(key: str, msg: str, overrides: Sequence[str]) -> str:
    """'invalid value V for KEY: expected TYPE (e.g. KEY=EXAMPLE)', from the schema."""
    spec = next((s for s in schema_fields() if s.key == key), None)
    value = _given_value(key, msg, overrides)
    if spec is None:
        return f"invalid value '{value}' for '{key}': {msg.split(' full_key')[0][-160:]}"
    if spec.kind == "group":
        keys = ", ".join(_valid_keys(key))
        return (f"invalid value '{value}' for '{key}': it is a group of keys ({keys}); set one of "
                f"them, e.g. {key}.{_valid_keys(key)[0]}=...")
    what = KIND_NAMES[spec.kind]
    if spec.kind == "list":
        what = {"str": "a list of strings", "float": "a list of floats"}.get(spec.item, "a list")
    if spec.optional:
        what += " or null"
    elif value in ("null", "None"):
        what += " (null is not allowed)"
    return f"invalid value '{value}' for '{key}': expected {what} (e.g. {key}={example_value(spec)})"


def _valid_keys(parent: str) -> List[str]:
    node = OmegaConf.structured(RLConfig)
    try:
        sub = OmegaConf.select(node, parent) if parent else node
    except Exception:  # noqa: BLE001 - best-effort hint only
        return []
    return sorted(k for k in sub.keys() if k != "defaults") if isinstance(sub, DictConfig) else []
