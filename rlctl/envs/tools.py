"""Plain Python functions as tools (docs/agents.md). ``make_tool(fn)`` (or an import path)
gives a ``Tool``; ``Tool.bind`` maps ``tag`` words (all joined for a one-parameter tool,
else one per parameter) or a ``json`` object (by name) to keyword arguments. ``int`` and
``float`` parameters drop spaces (``"1 2 3"`` is 123), ``bool`` takes true/false; a
failure raises ``ToolArgumentError``. ``Tool.source``: the import path the subprocess
sandbox loads it by (None for a lambda or nested function)."""
from __future__ import annotations

import inspect
import os
import sys
import typing
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

from rlctl.registry import load_object


class ToolArgumentError(ValueError):
    """A call's arguments do not fit the tool's signature (one line)."""


def _hints(fn: Callable) -> Dict[str, Any]:
    try:
        return typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 - unresolvable annotations: take values as given
        return {}


def _convert(value: Any, kind: Any, name: str) -> Any:
    if not isinstance(value, str) or kind not in (int, float, bool):
        return value
    text = "".join(value.split())
    try:
        if kind is bool:
            if text.lower() not in ("true", "false"):
                raise ValueError(text)
            return text.lower() == "true"
        return kind(text)
    except ValueError:
        raise ToolArgumentError(f"argument {name}={value!r} is not a {kind.__name__}") from None


@dataclass(frozen=True)
class Tool:
    name: str
    fn: Callable
    params: Tuple[str, ...]          # positional-or-keyword / keyword parameters, in order
    required: Tuple[str, ...]        # those without a default
    kinds: Dict[str, Any]            # parameter -> annotation (for conversion)
    source: Optional[str]            # import path for the subprocess sandbox, or None
    doc: str = ""

    def bind(self, arguments: Union[Sequence[str], Dict[str, Any]]) -> Dict[str, Any]:
        """Keyword arguments for ``fn`` from a parsed call's arguments."""
        if isinstance(arguments, dict):
            unknown = sorted(set(arguments) - set(self.params))
            if unknown:
                raise ToolArgumentError(f"{self.name} has no parameter '{unknown[0]}'; "
                                        f"its parameters: {', '.join(self.params) or 'none'}")
            given = dict(arguments)
        elif len(self.params) == 1:
            given = {self.params[0]: " ".join(arguments)} if arguments else {}
        elif len(self.required) <= len(arguments) <= len(self.params):
            given = dict(zip(self.params, arguments))
        else:
            raise ToolArgumentError(f"{self.name} takes {len(self.params)} argument(s) "
                                    f"({', '.join(self.params)}), got {len(arguments)}")
        missing = [p for p in self.required if p not in given]
        if missing:
            raise ToolArgumentError(f"{self.name}: missing argument '{missing[0]}'")
        return {k: _convert(v, self.kinds.get(k), k) for k, v in given.items()}

    def schema(self) -> Dict[str, Any]:
        """The tool as a JSON-schema function description (for chat templates' tool lists)."""
        types = {int: "integer", float: "number", bool: "boolean", str: "string"}
        props = {p: {"type": types.get(self.kinds.get(p), "string")} for p in self.params}
        return {"name": self.name, "description": self.doc,
                "parameters": {"type": "object", "properties": props,
                               "required": list(self.required)}}


def _source(fn: Callable) -> Optional[str]:
    mod_name, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    module = sys.modules.get(mod_name or "")
    if module is None or not qual or "<" in qual:
        return None
    spec = getattr(module, "__spec__", None)
    if spec is not None and spec.name == mod_name and not mod_name.startswith("rlctl_user_"):
        return f"{mod_name}:{qual}"
    path = getattr(module, "__file__", None)
    return f"{os.path.abspath(path)}:{qual}" if path else None


def _absolute(spec: str) -> str:
    module, _, attr = spec.strip().rpartition(":")
    if module.endswith(".py") or "/" in module or os.sep in module:
        return f"{os.path.abspath(os.path.expanduser(module))}:{attr}"
    return spec.strip()


def make_tool(fn: Union[Callable, str, "Tool"], name: Optional[str] = None,
              source: Optional[str] = None) -> Tool:
    """A ``Tool`` from a function, an import path to one, or a Tool (returned as is).
    ``source``: the import path the subprocess sandbox loads it by, when not the default."""
    if isinstance(fn, Tool):
        return fn
    source = _absolute(source or fn) if isinstance(source or fn, str) else None
    if isinstance(fn, str):
        fn = load_object(fn, "tool")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        raise ValueError(f"tool {fn!r}: its signature cannot be read") from None
    params = [p for p in sig.parameters.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    hints = _hints(fn)
    return Tool(name=name or getattr(fn, "__name__", "tool"), fn=fn,
                params=tuple(p.name for p in params),
                required=tuple(p.name for p in params if p.default is p.empty),
                kinds={p.name: hints.get(p.name, p.annotation) for p in params},
                source=source or _source(fn), doc=inspect.getdoc(fn) or "")
