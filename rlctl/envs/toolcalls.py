"""Tool-call formats (docs/agents.md). A parser has ``parse(text) -> ToolCall | None``
(malformed: ``ToolCallError``), ``format(call) -> str`` and ``stop`` (where a turn with a
call is cut); registered in ``PARSERS`` (``tool_parser=NAME`` or ``package.module:Class``):
``json`` (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``) and ``tag``
(``<call> calc 1 2 3 * 4 5 </call>``). Only a turn's first call is read."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple, Union

from rlctl.registry import Registry

PARSERS = Registry("tool-call parser")


class ToolCallError(ValueError):
    """A turn opened a tool call that cannot be read (one line: what is wrong)."""


@dataclass(frozen=True)
class ToolCall:
    """A parsed call: tool name and arguments (words for ``tag``, the JSON object for ``json``)."""
    name: str
    arguments: Union[Tuple[str, ...], Dict[str, Any]] = ()


def _between(text: str, open_: str, close: str) -> Optional[str]:
    """The text between the first ``open_`` and the next ``close``; None without ``open_``."""
    start = text.find(open_)
    if start == -1:
        return None
    end = text.find(close, start + len(open_))
    if end == -1:
        raise ToolCallError(f"{open_} without {close}")
    return text[start + len(open_):end]


@PARSERS.register("tag")
class TagParser:
    """``<call> NAME ARG ARG ... </call>``: whitespace-separated words."""
    OPEN, CLOSE = "<call>", "</call>"
    stop = (CLOSE,)

    def parse(self, text: str) -> Optional[ToolCall]:
        inner = _between(text, self.OPEN, self.CLOSE)
        if inner is None:
            return None
        words = inner.split()
        if not words:
            raise ToolCallError(f"{self.OPEN} {self.CLOSE} names no tool")
        if self.OPEN in inner:
            raise ToolCallError(f"{self.OPEN} inside a call")
        return ToolCall(words[0], tuple(words[1:]))

    def format(self, call: ToolCall) -> str:
        args = call.arguments.values() if isinstance(call.arguments, dict) else call.arguments
        return " ".join([self.OPEN, call.name, *map(str, args), self.CLOSE])


@PARSERS.register("json")
class JsonParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    stop = (CLOSE,)

    def parse(self, text: str) -> Optional[ToolCall]:
        inner = _between(text, self.OPEN, self.CLOSE)
        if inner is None:
            return None
        obj = _json(inner, "the call")
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            raise ToolCallError('a call must be a JSON object with a "name" string')
        args = obj.get("arguments", {})
        if isinstance(args, str):
            args = _json(args, '"arguments"')
        if not isinstance(args, dict):
            raise ToolCallError('"arguments" must be a JSON object')
        return ToolCall(obj["name"], args)

    def format(self, call: ToolCall) -> str:
        args = call.arguments if isinstance(call.arguments, dict) else list(call.arguments)
        return f"{self.OPEN}{json.dumps({'name': call.name, 'arguments': args})}{self.CLOSE}"


def _json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ToolCallError(f"{what} is not valid JSON ({exc.msg} at char {exc.pos})") from None


def make_parser(name: str):
    """The parser registered as ``name`` (or a user class by import path); one-line ValueError."""
    try:
        cls = PARSERS.get(name)
    except ValueError as exc:
        raise ValueError(f"task.tool_parser: {exc}") from None
    where = f"task.tool_parser '{name}'"
    try:
        parser = cls()
    except Exception as exc:  # noqa: BLE001 - the user's class: one line, not a traceback
        raise ValueError(f"{where} cannot be made with no arguments: {type(exc).__name__}: "
                         f"{' '.join(str(exc).split())[:160]}") from None
    if not callable(getattr(parser, "parse", None)) or not hasattr(parser, "stop"):
        raise ValueError(f"{where} is not a tool-call parser: it needs parse(text) and stop "
                         "(the strings that end a turn holding a call); docs/agents.md")
    stop = parser.stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(x, str) for x in stop):
        raise ValueError(f"{where} has a bad stop: stop must be a list of strings, "
                         f"got {type(stop).__name__}")
    return parser
