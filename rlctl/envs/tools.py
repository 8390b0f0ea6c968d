"""Tools, their call parsers (``PARSERS``: ``tag``, ``json`` or ``module:Class``) and ``ToolEnv``,
where the model may call tools before it answers; ``task.sandbox`` none, subprocess or bwrap
(docs/agents.md). A tool's first failure of each kind is said in one line."""
from __future__ import annotations

import importlib.util
import inspect
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import typing
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Sequence, Set, Tuple, Union

from rlctl.registry import Registry, load_object
from rlctl.types import Example, Step, Turn

PARSERS = Registry("tool-call parser")
RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"
ERROR = "error"
SANDBOXES = ("none", "subprocess", "bwrap")
CHILD = Path(__file__).with_name("sandbox_child.py")
log = logging.getLogger(__name__)
_SAID: Set[Tuple[str, str]] = set()      # (tool, kind of failure) already said


class ToolFailed(Exception):
    """A tool call that raised, timed out or was killed; a one-line message, ``kind`` what happened."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 5.0           # wall clock per call; the child is killed after it
    memory_mb: int = 512             # RLIMIT_AS (and RLIMIT_FSIZE)
    cpu_s: Optional[int] = None      # RLIMIT_CPU; None: ceil(timeout_s)

    def cpu(self) -> int:
        return self.cpu_s if self.cpu_s is not None else max(1, math.ceil(self.timeout_s))


def check_sandbox(sandbox: str, tools=()) -> str:
    if sandbox not in SANDBOXES:
        raise ValueError(f"invalid task.sandbox {sandbox!r}; valid: {', '.join(SANDBOXES)}")
    for tool in tools if sandbox != "none" else ():
        if tool.source is None:
            raise ValueError(f"tool '{tool.name}' cannot run in the {sandbox} sandbox: "
                             "define it at the top level of a module (module:function)")
    if sandbox == "bwrap" and _bwrap_problem():
        raise ValueError(f"task.sandbox=bwrap: {_bwrap_problem()}")
    return sandbox


@lru_cache(maxsize=None)
def _bwrap_problem() -> Optional[str]:
    """Why bubblewrap cannot run a sandboxed interpreter here (None: it can); probed once."""
    if shutil.which("bwrap") is None:
        return "the bwrap binary is not on PATH; install it (Debian/Ubuntu: apt-get install bubblewrap)"
    with tempfile.TemporaryDirectory(prefix="rlctl-tool-") as cwd:
        try:
            out = subprocess.run([*_bwrap_argv(None, cwd, 2 ** 20), sys.executable, "-I", "-c", ""],
                                 capture_output=True, text=True, timeout=30, cwd=cwd)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"bwrap cannot start: {exc}"
    lines = out.stderr.strip().splitlines()
    return None if out.returncode == 0 else \
        f"bwrap cannot make its sandbox here: {lines[-1] if lines else f'exit code {out.returncode}'}"


SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/alternatives", "/etc/localtime")


def _tool_files(source: Optional[str]) -> list:
    """The files a tool's import path needs: the file itself, or its top-level package."""
    module = (source or "").rpartition(":")[0]
    if not module or module.endswith(".py") or "/" in module:
        return [module] if module else []
    spec = importlib.util.find_spec(module.split(".")[0])
    if spec is None:
        return []
    return list(spec.submodule_search_locations or ()) or \
        ([spec.origin] if spec.origin and os.path.isabs(spec.origin) else [])


def _bwrap_argv(source: Optional[str], cwd: str, size_bytes: int) -> list:
    """bwrap's arguments: the system, Python, rlctl and the tool's files read-only, a tmpfs at ``cwd``."""
    argv = [shutil.which("bwrap") or "bwrap", "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc",
            "--unshare-uts", "--unshare-cgroup-try", "--die-with-parent", "--new-session",
            "--proc", "/proc", "--dev", "/dev"]
    for path in SYSTEM_DIRS:
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    for path in SYSTEM_FILES:
        argv += ["--ro-bind-try", path, path]
    visible = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
               str(CHILD.parent.parent), *_tool_files(source)}
    for path in sorted(os.path.abspath(p) for p in visible):    # a folder before its contents
        argv += ["--ro-bind", path, path]
    return argv + ["--size", str(size_bytes), "--tmpfs", cwd, "--chdir", cwd, "--remount-ro", "/"]


def call_tool(tool, kwargs: Dict[str, Any], sandbox: str = "none",
              limits: Limits = Limits()) -> Any:
    """``tool.fn(**kwargs)`` in the sandbox; any failure raises ``ToolFailed``."""
    if sandbox == "none":
        try:
            return tool.fn(**kwargs)
        except Exception as exc:  # noqa: BLE001 - a tool's failure is an observation
            raise ToolFailed(f"{tool.name}: {type(exc).__name__}: "
                             f"{' '.join(str(exc).split())[:200]}", type(exc).__name__) from None
    check_sandbox(sandbox, [tool])
    memory_bytes = int(limits.memory_mb) * 2 ** 20
    payload = json.dumps({"source": tool.source, "kwargs": kwargs,
                          "path": [os.path.abspath(p or ".") for p in sys.path],
                          "memory_bytes": memory_bytes, "cpu_s": limits.cpu(),
                          "own_pid_namespace": sandbox == "bwrap"})
    # bwrap: a tmpfs over cwd
    with tempfile.TemporaryDirectory(prefix="rlctl-tool-") as cwd, tempfile.TemporaryFile() as err:
        env = {"PATH": "/usr/bin:/bin", "HOME": cwd, "TMPDIR": cwd, "LANG": "C.UTF-8",
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        jail = _bwrap_argv(tool.source, cwd, memory_bytes) if sandbox == "bwrap" else []
        proc = subprocess.Popen([*jail, sys.executable, "-I", str(CHILD)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=err, cwd=cwd,
                                env=env, start_new_session=True, close_fds=True)
        try:
            out, _ = proc.communicate(payload.encode(), timeout=limits.timeout_s)
        except subprocess.TimeoutExpired:
            raise ToolFailed(f"{tool.name}: timed out after {limits.timeout_s:g} s",
                             "timeout") from None
        finally:
            _kill(proc)
        rc = proc.returncode   # bwrap exits 128 + N for a child killed by signal N
        return _result(tool, 128 - rc if jail and rc > 128 else rc, out, _last_line(err))


def _last_line(err) -> str:
    """The last non-empty line of the child's stderr file (its last 4 KB read)."""
    err.seek(max(0, err.seek(0, os.SEEK_END) - 4096))
    lines = err.read().decode("utf-8", "replace").strip().splitlines()
    return " ".join(lines[-1].split())[:200] if lines else ""


def _kill(proc: subprocess.Popen) -> None:
    """Kill the child's process group, even when the child has exited."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.communicate()


def _result(tool, rc: int, out: bytes, stderr: str = "") -> Any:
    try:
        reply = json.loads(out.decode("utf-8", "replace") or "null")
    except json.JSONDecodeError:
        reply = None
    if isinstance(reply, dict) and reply.get("ok") is True:
        return reply.get("result")
    if isinstance(reply, dict) and "error" in reply:
        raise ToolFailed(f"{tool.name}: {reply['error']}", str(reply["error"]).split(":")[0])
    last = f"; its last stderr line: {stderr}" if stderr else "; it wrote nothing on stderr"
    if rc < 0:
        name = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else str(-rc)
        why = " (CPU limit)" if name == "SIGXCPU" else ""
        raise ToolFailed(f"{tool.name}: killed by {name}{why}{last}", name)
    raise ToolFailed(f"{tool.name}: the sandboxed interpreter exited with code {rc} and no "
                     f"result{last}", f"exit {rc}")


class ToolArgumentError(ValueError):
    """A call's arguments do not fit the tool's signature (one line)."""


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
    """A ``Tool`` from a function, an import path to one, or a Tool; ``source``: the sandbox's path."""
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
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 - unresolvable annotations: take values as given
        hints = {}
    return Tool(name=name or getattr(fn, "__name__", "tool"), fn=fn,
                params=tuple(p.name for p in params),
                required=tuple(p.name for p in params if p.default is p.empty),
                kinds={p.name: hints.get(p.name, p.annotation) for p in params},
                source=source or _source(fn))


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
        except ToolArgumentError as exc:
            return self._failed(str(exc))
        except ToolFailed as exc:       # the tool itself failed: said once per tool and kind
            if (tool.name, exc.kind) not in _SAID:
                _SAID.add((tool.name, exc.kind))
                log.warning("tool %s failed (sandbox=%s): %s (its calls are answered 'error' and "
                            "counted in tool_errors; said once per tool and kind)", tool.name,
                            self.sandbox, str(exc).removeprefix(f"{tool.name}: "))
            return self._failed(str(exc))
        self.calls += 1
        return Step(f"{RESULT_OPEN} {self.format_result(value)} {RESULT_CLOSE}", 0.0, False,
                    {"tool_calls": 1, "tool_errors": 0, "stop": list(self.stop)})

    def _failed(self, why: str) -> Step:
        self.calls += 1
        return Step(f"{RESULT_OPEN} {ERROR} {RESULT_CLOSE}", 0.0, False,
                    {"tool_calls": 1, "tool_errors": 1, "error": why, "stop": list(self.stop)})

    def _final(self, text: str, tool_limit: bool = False) -> Step:
        reward = float(self.check(self.example, text))
        info = {"success": reward > 0, "tool_calls": 0, "tool_errors": 0}
        if tool_limit and self.calls >= self.max_tool_calls:
            info["tool_limit"] = True
        return Step(None, reward, True, info)
