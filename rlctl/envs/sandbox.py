"""Where a tool runs: ``sandbox=none`` (in the calling process) or ``sandbox=subprocess``
(docs/agents.md, "The sandbox").

``subprocess`` runs each call in a fresh ``python -I sandbox_child.py`` with
``RLIMIT_AS``/``RLIMIT_FSIZE`` (``memory_mb``), ``RLIMIT_CPU`` (``cpu_s``), Python
sockets refused, a temporary working directory and a minimal environment; after
``timeout_s`` the whole process group is killed. The tool is loaded by ``Tool.source``
(top-level functions only); arguments and result cross as JSON (else ``str(result)``).
A tool here is ``rlctl.envs.tools.Tool`` (its name, fn and source).
Best-effort isolation, not a security boundary."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional

SANDBOXES = ("none", "subprocess")
CHILD = Path(__file__).with_name("sandbox_child.py")


class ToolFailed(Exception):
    """A tool call that raised, timed out or was killed; the message is one line."""


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
    if sandbox == "subprocess":
        for tool in tools:
            if tool.source is None:
                raise ValueError(f"tool '{tool.name}' cannot run in the subprocess sandbox: "
                                 "define it at the top level of a module (module:function)")
    return sandbox


def call_tool(tool, kwargs: Dict[str, Any], sandbox: str = "none",
              limits: Limits = Limits()) -> Any:
    """``tool.fn(**kwargs)`` in the sandbox; any failure raises ``ToolFailed``."""
    if sandbox == "none":
        try:
            return tool.fn(**kwargs)
        except Exception as exc:  # noqa: BLE001 - a tool's failure is an observation
            raise ToolFailed(f"{tool.name}: {type(exc).__name__}: "
                             f"{' '.join(str(exc).split())[:200]}") from None
    return run_in_subprocess(tool, kwargs, limits)


def run_in_subprocess(tool, kwargs: Dict[str, Any], limits: Limits) -> Any:
    if tool.source is None:
        check_sandbox("subprocess", [tool])
    payload = json.dumps({"source": tool.source, "kwargs": kwargs,
                          "path": [os.path.abspath(p or ".") for p in sys.path],
                          "memory_bytes": int(limits.memory_mb) * 2 ** 20, "cpu_s": limits.cpu()})
    with tempfile.TemporaryDirectory(prefix="rlctl-tool-") as cwd:
        env = {"PATH": "/usr/bin:/bin", "HOME": cwd, "TMPDIR": cwd, "LANG": "C.UTF-8",
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        proc = subprocess.Popen([sys.executable, "-I", str(CHILD)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=cwd,
                                env=env, start_new_session=True, close_fds=True)
        try:
            out, _ = proc.communicate(payload.encode(), timeout=limits.timeout_s)
        except subprocess.TimeoutExpired:
            raise ToolFailed(f"{tool.name}: timed out after {limits.timeout_s:g} s") from None
        finally:
            _kill(proc)
    return _result(tool, proc.returncode, out)


def _kill(proc: subprocess.Popen) -> None:
    """Kill the child's process group even when the child has exited (the tool's processes
    would outlive the call, or hold the reply pipe)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.communicate()


def _result(tool, rc: int, out: bytes) -> Any:
    try:
        reply = json.loads(out.decode("utf-8", "replace") or "null")
    except json.JSONDecodeError:
        reply = None
    if isinstance(reply, dict) and reply.get("ok") is True:
        return reply.get("result")
    if isinstance(reply, dict) and "error" in reply:
        raise ToolFailed(f"{tool.name}: {reply['error']}")
    if rc < 0:
        name = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else str(-rc)
        why = " (CPU limit)" if name == "SIGXCPU" else ""
        raise ToolFailed(f"{tool.name}: killed by {name}{why}")
    raise ToolFailed(f"{tool.name}: the sandboxed interpreter exited with code {rc} and no result")
