"""Every node of a multi-node run must train with the same config: right after the group
forms (tcp_group.join) every rank gathers every rank's flattened resolved config with its
digest, and names the keys that differ from rank 0's in one line that every node prints.

Left out of the comparison are the keys that are legitimately per node (``PER_NODE``):
which node this is, how it reaches node 0, its own thread count and wait limit, where it
caches downloaded or built models (``model.cache_dir``: often node-local scratch; the
model itself is ``model.name``/``name_or_path``, compared), and what
only rank 0 uses (where the run directory goes, the loggers: the other ranks log nothing
and take the run directory rank 0 shares).
"""
from __future__ import annotations

import hashlib
import json
from typing import Any, Dict, List, Optional, Tuple

PER_NODE = ("hardware.node_rank", "hardware.master_addr", "hardware.master_port",
            "hardware.num_threads", "hardware.dist_timeout_s", "model.cache_dir", "run.name",
            "run.output_dir", "run.dir")
PER_NODE_PREFIXES = ("logger.",)
_SHOWN = 3                     # differing keys named in the line; the rest are counted
_UNSET = object()


def flatten(tree: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1} (lists stay values), per-node keys left out."""
    flat: Dict[str, Any] = {}
    for k, v in tree.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            flat.update(flatten(v, name + "."))
        elif name not in PER_NODE and not name.startswith(PER_NODE_PREFIXES):
            flat[name] = v
    return flat


def digest(flat: Dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(flat, sort_keys=True, default=str).encode()).hexdigest()


def payload(flat: Dict[str, Any], label: str) -> str:
    """What a rank hands to the others: where it runs, its config and the config's digest."""
    return json.dumps({"label": label, "digest": digest(flat), "config": flat}, default=str)


def show(value: Any) -> str:
    """A value as an override would spell it (true, null, 0.0001, [a, b])."""
    if value is _UNSET:
        return "unset"
    if isinstance(value, str):
        return value
    return json.dumps(value, default=str)


def differences(mine: Dict[str, Any], theirs: Dict[str, Any]) -> List[Tuple[str, Any, Any]]:
    """(key, my value, their value) for every key whose value differs or is set on one side."""
    keys = sorted(set(mine) | set(theirs))
    return [(k, mine.get(k, _UNSET), theirs.get(k, _UNSET)) for k in keys
            if mine.get(k, _UNSET) != theirs.get(k, _UNSET)]


def mismatch(own_label: str, own: Dict[str, Any], others: List[str]) -> Optional[str]:
    """The one line naming the keys where another rank's config (``others``: their
    payloads) differs from rank 0's, or None when every digest equals rank 0's."""
    mine = digest(own)
    seen, parts = set(), []
    for text in others:
        got = json.loads(text)
        if got["digest"] == mine:
            continue
        for key, a, b in differences(own, got["config"]):
            entry = (key, show(b), got["label"])
            if entry not in seen:                 # several ranks of one node: named once
                seen.add(entry)
                parts.append(f"{key} is {show(a)} on {own_label} and {show(b)} on {got['label']}")
    if not parts:
        return None
    more = f" (and {len(parts) - _SHOWN} more)" if len(parts) > _SHOWN else ""
    return (f"config differs between nodes: {', '.join(parts[:_SHOWN])}{more}; start every node "
            "with the same config")
