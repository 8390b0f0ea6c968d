"""One registry shape for every pluggable kind: entries registered where defined, looked up
by name, alias or a user's ``package.module:attr`` / ``path/file.py:attr`` (the registry's
default attributes unless it sets its own); every failure is a one-line ValueError, no torch.

- advantage, level "outcome": ``fn(rewards [B, G], eps, **options) -> [B, G]``; level
  "token": ``fn(rewards, values, mask [N, T], gamma, lam) -> (advantages, returns) [N, T]``.
- policy loss: ``fn(logp, old_logp, advantages, mask, clip_low, clip_high,
  clip_ratio_c=None) -> (loss [N, T], metrics dict of detached scalar tensors)``.
- KL estimator: ``fn(logp [N, T], ref_logp [N, T]) -> [N, T]``.
- task: ``factory(**task options) -> Task``; backend: ``cls(device, zero_stage, precision,
  deepspeed_config, cpu_offload)``.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

__all__ = ["Registry", "Entry", "load_object", "is_import_path"]


def _short(exc: BaseException, limit: int = 160) -> str:
    s = " ".join(str(exc).split())
    return s if len(s) <= limit else s[:limit - 3] + "..."


def is_import_path(name: Any) -> bool:
    """True for a user entry ``package.module:attr`` / ``path/file.py:attr``."""
    return isinstance(name, str) and ":" in name


def _import_file(key: str, spec: str, module_name: str):
    path = Path(module_name).expanduser()
    if not path.is_file():
        raise ValueError(f"{key} '{spec}': no such file '{module_name}'")
    mod_name = f"rlctl_user_{path.stem}"
    try:
        mod_spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules[mod_name] = module
        mod_spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - the user's module failed to import
        sys.modules.pop(mod_name, None)
        raise ValueError(f"{key} '{spec}': importing '{module_name}' failed: "
                         f"{type(exc).__name__}: {_short(exc)}") from None
    return module


def _import_module(key: str, spec: str, module_name: str):
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())  # console scripts do not search the working dir
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ValueError(f"{key} '{spec}': cannot import module '{module_name}' ({_short(exc)}); "
                         "put its directory on PYTHONPATH or give path/file.py:function") from None
    except Exception as exc:  # noqa: BLE001 - the user's module failed to import
        raise ValueError(f"{key} '{spec}': importing '{module_name}' failed: "
                         f"{type(exc).__name__}: {_short(exc)}") from None


def load_object(spec: str, key: str) -> Callable:
    """The callable named ``package.module:attr`` or ``path/file.py:attr`` (``attr`` may
    be dotted, e.g. ``Class.method``). ValueError, one line naming ``key``."""
    module_name, sep, attr = spec.strip().rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{key} '{spec}' must look like package.module:function "
                         "(or path/file.py:function)")
    if module_name.endswith(".py") or os.sep in module_name or "/" in module_name:
        module = _import_file(key, spec, module_name)
    else:
        module = _import_module(key, spec, module_name)
    obj = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ValueError(f"{key} '{spec}': module '{module_name}' has no attribute '{attr}'")
    if not callable(obj):
        raise ValueError(f"{key} '{spec}': '{attr}' is not callable "
                         f"(it is a {type(obj).__name__})")
    return obj


@dataclass(frozen=True)
class Entry:
    """A registered callable, its name and its attributes (also read as ``entry.level``)."""
    name: str
    fn: Callable
    attrs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        for key, value in self.attrs.items():
            object.__setattr__(self, key, value)


class Registry:
    """Entries of one kind by config name. ``kind``: for messages ("policy loss"); ``attrs``:
    attribute -> allowed values, the first the default; ``aliases``: other spellings ->
    canonical names; ``dashes``: "-" and "_" interchangeable."""

    def __init__(self, kind: str, attrs: Optional[Dict[str, Tuple[Any, ...]]] = None,
                 aliases: Optional[Dict[str, str]] = None, dashes: bool = False):
        self.kind, self.dashes = kind, dashes
        self.attr_choices, self.aliases = dict(attrs or {}), dict(aliases or {})
        self._entries: Dict[str, Entry] = {}
        self._loaded: Dict[str, Entry] = {}

    def register(self, name: str, **attrs: Any) -> Callable[[Callable], Callable]:
        """Decorator: register ``fn`` as ``name`` with ``attrs``; returns ``fn`` unchanged. ``fn``
        may be a ``module:attr`` string: imported when the entry is first looked up."""
        def deco(fn: Callable) -> Callable:
            self._entries[name] = Entry(name, fn, self._attrs(name, attrs))
            return fn
        return deco

    def _attrs(self, name: str, given: Mapping[str, Any]) -> Dict[str, Any]:
        unknown = sorted(set(given) - set(self.attr_choices))
        if unknown:
            raise ValueError(f"{self.kind} '{name}': unknown attribute '{unknown[0]}'; "
                             f"valid: {', '.join(sorted(self.attr_choices)) or 'none'}")
        out = {}
        for key, choices in self.attr_choices.items():
            value = given.get(key, choices[0])
            if value not in choices:
                raise ValueError(f"{self.kind} '{name}': invalid {key} {value!r}; valid: "
                                 f"{', '.join(map(str, choices))}")
            out[key] = value
        return out

    def canonical(self, name: str) -> str:
        """The registered name ``name`` stands for (aliases, dashes); user paths as given."""
        if is_import_path(name):
            return name
        key = self.aliases.get(name, name)
        if key not in self._entries and self.dashes and isinstance(key, str):
            key = key.replace("-", "_")
        return key

    def entry(self, name: str) -> Entry:
        """The entry for a registered name, alias or user import path; ValueError if none."""
        if is_import_path(name) and name not in self._entries:
            return self._user_entry(name)
        key = name if name in self._entries else self.canonical(name)
        found = self._entries.get(key)
        if found is None:
            alias = f" (aliases: {', '.join(sorted(self.aliases))})" if self.aliases else ""
            raise ValueError(f"unknown {self.kind} {name!r}; valid: {', '.join(self.names())}"
                             f"{alias}, or package.module:function for your own")
        if isinstance(found.fn, str):           # registered by import path: imported once
            found = self._entries[key] = Entry(key, load_object(found.fn, self.kind), found.attrs)
        return found

    def _user_entry(self, spec: str) -> Entry:
        if spec not in self._loaded:
            fn = load_object(spec, self.kind)
            own = {k: getattr(fn, k) for k in self.attr_choices if hasattr(fn, k)}
            self._loaded[spec] = Entry(spec, fn, self._attrs(spec, own))
        return self._loaded[spec]

    def get(self, name: str) -> Callable:
        """The callable registered as ``name`` (or named by a user import path)."""
        return self.entry(name).fn

    def names(self) -> List[str]:
        """Registered names, sorted (aliases and user entries not included)."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.canonical(name) in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self.names())})"
