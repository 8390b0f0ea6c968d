"""The shell's overrides before composition: Hydra's grammar check with its one-line
message, and old key names moved to their new ones (in overrides and recipes)."""
from __future__ import annotations

import re
import sys
from typing import Dict, List, Optional, Sequence

from hydra.core.override_parser.overrides_parser import OverridesParser

from rlctl.errors import ConfigError, one_line


# Old names still accepted (overrides and recipes), with a one-line notice.
RENAMED = {"trainer.async": "trainer.async_rollout"}


def _renamed_notice(old: str, new: str, told: set, stream) -> None:
    if old not in told:
        told.add(old)
        print(f"rlctl: warning: {old} is deprecated, renamed {new} (e.g. {new}.enabled=true)",
              file=stream or sys.stderr, flush=True)


_TOLD_RENAMES: set = set()   # renames already announced in this process


def rename_deprecated(overrides: List[str], recipe: Optional[Dict] = None, stream=None):
    """(overrides, recipe) with renamed keys moved to their new names; one notice a process."""
    told = _TOLD_RENAMES
    out = []
    for o in overrides:
        bare = o.lstrip("+~")
        prefix, key = o[:len(o) - len(bare)], bare
        for old, new in RENAMED.items():
            if key == old or key.startswith((old + ".", old + "=")):
                key = new + key[len(old):]
                _renamed_notice(old, new, told, stream)
        out.append(prefix + key)
    for old, new in RENAMED.items():
        (section, leaf), (_, new_leaf) = old.split("."), new.split(".")
        node = (recipe or {}).get(section)
        if isinstance(node, dict) and leaf in node:
            _renamed_notice(old, new, told, stream)
            node = {(new_leaf if k == leaf else k): v for k, v in node.items()}
            recipe = {**recipe, section: node}
    return out, recipe


# the phrases of Hydra's override grammar errors (from its ANTLR parser)
GRAMMAR_ERRORS = ("mismatched input", "no viable alternative", "extraneous input", "missing EQUAL",
                  "token recognition error")


def grammar_message(msg: str, overrides: Sequence[str]) -> str:
    """Hydra's override grammar error as one line: which override, and what it looks like."""
    m = re.search(r"Error parsing override '([^']*)'", msg)
    bad = m.group(1) if m else _first_unparsable(overrides)
    reason = re.search(r"(mismatched input|no viable alternative at input|extraneous input|"
                       r"missing EQUAL at|token recognition error at:) ?('[^']*')?", msg)
    why = f" ({reason.group(1)} {reason.group(2) or ''})".replace(" )", ")") if reason else ""
    what = f"'{bad}'" if bad is not None else "an override"
    return (f"cannot parse {what}{why}; overrides look like key=value (e.g. algo.clip_eps=0.1), "
            "a sweep (-m) lists values like seed=0,1,2")


def _first_unparsable(overrides: Sequence[str]) -> Optional[str]:
    parser = OverridesParser.create()
    for o in overrides:
        try:
            parser.parse_override(o)
        except Exception:  # noqa: BLE001 - Hydra's grammar errors
            return o
    return None


def check_override_syntax(overrides: Sequence[str]) -> None:
    """Parse overrides with Hydra's grammar (sweep lists included); ConfigError on failure."""
    try:
        OverridesParser.create().parse_overrides(list(overrides))
    except Exception as exc:  # noqa: BLE001 - Hydra's grammar errors
        raise ConfigError(grammar_message(one_line(exc), overrides)) from None
