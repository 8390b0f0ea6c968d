"""The child of the subprocess and bwrap sandboxes (``python -I sandbox_child.py``): a JSON
payload on stdin -> ``{"ok": true, "result": ...}`` or ``{"ok": false, "error": "..."}`` on
stdout, under limits and without sockets. Standard library only until the limits are set."""
import json
import os
import resource
import signal
import socket
import sys
import time

# sys.path[0] is rlctl/envs/ (a script): the folder holding rlctl (registry: stdlib only)
sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rlctl.registry import load_object  # noqa: E402

MAX_RESULT_CHARS = 65536


def _refuse(*args, **kwargs):
    raise PermissionError("the network is disabled in the rlctl tool sandbox")


class _NoSocket(socket.socket):
    def __init__(self, *args, **kwargs):
        _refuse()


def _end_the_namespace() -> None:
    """Kill every other process of this PID namespace but init, and wait up to 2 s for them."""
    try:
        os.kill(-1, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline and any(_running(pid) for pid in os.listdir("/proc")
                                              if pid.isdigit() and int(pid) not in (1, os.getpid())):
        time.sleep(0.005)


def _running(pid: str) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def main() -> None:
    reply_fd = os.dup(1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)   # the tool's prints go nowhere
    payload = json.loads(sys.stdin.read())
    sys.path[:] = payload["path"]             # the parent's, made absolute
    memory_bytes, cpu_s = payload["memory_bytes"], payload["cpu_s"]
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    socket.socket = _NoSocket                 # no network
    socket.socketpair = socket.fromfd = socket.create_connection = _refuse
    try:
        result = load_object(payload["source"], "tool")(**payload["kwargs"])
        text = json.dumps({"ok": True, "result": result}, default=str)
    except BaseException as exc:  # noqa: BLE001 - everything becomes the error reply
        text = json.dumps({"ok": False, "error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"})
    if len(text) > MAX_RESULT_CHARS:
        text = json.dumps({"ok": False, "error": f"result over {MAX_RESULT_CHARS} characters"})
    if payload.get("own_pid_namespace") and os.getppid() == 1:   # below bwrap's init only
        _end_the_namespace()
    with os.fdopen(reply_fd, "w") as out:
        out.write(text)
    if os.getpgrp() == os.getpid():           # our own group (the parent's new session):
        os.killpg(0, signal.SIGKILL)          # end what the tool started, and this process


if __name__ == "__main__":
    main()
