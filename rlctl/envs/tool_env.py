"""``ToolEnv``: an environment in which the model may call tools before it answers
(docs/agents.md, "Tools and call formats").

A call is bound, run in the sandbox and answered ``<result> R </result>``; any failure is
``<result> error </result>``, counted. A turn without a call (or a call past
``max_tool_calls``, or any first turn with ``use_tools=False``) is the final answer:
``check(example, text)`` gives its reward, done. Each step's info holds ``tool_calls``,
``tool_errors`` (0 or 1), ``error`` on a failure and ``stop`` (the parser's closing tag)
while the episode goes on."""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence

from rlctl.envs.sandbox import Limits, ToolFailed, call_tool, check_sandbox
from rlctl.envs.toolcalls import ToolCallError, make_parser
from rlctl.envs.tools import Tool, ToolArgumentError, make_tool
from rlctl.types import Example, Step, Turn

RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"
ERROR = "error"


def result_text(text: str) -> str:
    return f"{RESULT_OPEN} {text} {RESULT_CLOSE}"


class ToolEnv:
    def __init__(self, tools: Sequence[Any], check: Callable[[Example, str], float],
                 parser: Any = "tag", sandbox: str = "none", limits: Limits = Limits(),
                 max_tool_calls: int = 4, format_result: Callable[[Any], str] = str,
                 use_tools: bool = True):
        tools = [make_tool(t) for t in tools]
        self.tools: Dict[str, Tool] = {t.name: t for t in tools}
        self.parser = make_parser(parser) if isinstance(parser, str) else parser
        self.sandbox = check_sandbox(sandbox, tools)
        if not isinstance(max_tool_calls, int) or max_tool_calls < 1:
            raise ValueError(f"task.max_tool_calls must be an integer >= 1, got {max_tool_calls!r}")
        self.check, self.limits, self.max_tool_calls = check, limits, max_tool_calls
        self.format_result, self.use_tools = format_result, use_tools
        self.stop = list(self.parser.stop) if use_tools else []
        self.example: Optional[Example] = None
        self.calls = 0

    def reset(self, example: Example, seed: int) -> str:
        self.example, self.calls = example, 0
        return example.prompt

    def step(self, turn: Turn) -> Step:
        if not self.use_tools or self.calls >= self.max_tool_calls:
            return self._final(turn.text, tool_limit=self.use_tools)
        try:
            call = self.parser.parse(turn.text)
        except ToolCallError as exc:
            return self._failed(f"malformed call: {exc}")
        if call is None:
            return self._final(turn.text)
        tool = self.tools.get(call.name)
        if tool is None:
            return self._failed(f"unknown tool '{call.name}'; tools: {', '.join(self.tools)}")
        try:
            value = call_tool(tool, tool.bind(call.arguments), self.sandbox, self.limits)
        except (ToolArgumentError, ToolFailed) as exc:
            return self._failed(str(exc))
        self.calls += 1
        return Step(result_text(self.format_result(value)), 0.0, False,
                    {"tool_calls": 1, "tool_errors": 0, "stop": list(self.stop)})

    def _failed(self, why: str) -> Step:
        self.calls += 1
        return Step(result_text(ERROR), 0.0, False,
                    {"tool_calls": 1, "tool_errors": 1, "error": why, "stop": list(self.stop)})

    def _final(self, text: str, tool_limit: bool = False) -> Step:
        reward = float(self.check(self.example, text))
        info = {"success": reward > 0, "tool_calls": 0, "tool_errors": 0}
        if tool_limit and self.calls >= self.max_tool_calls:
            info["tool_limit"] = True
        return Step(None, reward, True, info)
