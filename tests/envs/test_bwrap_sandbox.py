"""``task.sandbox=bwrap`` holds where ``subprocess`` does not (docs/agents.md): processes a
tool starts in new sessions (setsid, a double fork) end with its call, a loopback server
the test runs is unreachable, files outside the tool's work directory can be neither read
nor written; the limits still apply and the calculator answers as in ``subprocess``. The
same escapes under ``subprocess`` are shown to succeed (its documented limits). Skipped,
with the reason, where bwrap is missing or cannot make namespaces."""
import json
import os
import socket
import threading
import time
import uuid

import pytest

from rlctl.envs import tools as tools_module
from rlctl.envs.builtin import product_example
from rlctl.envs.tools import Limits, ToolFailed, call_tool, check_sandbox, make_tool
from rlctl.tasks import build_task
from rlctl.types import Turn

PROBLEM = tools_module._bwrap_problem()          # probed once per process
needs_bwrap = pytest.mark.skipif(PROBLEM is not None, reason=f"bwrap sandbox unavailable: {PROBLEM}")

TOOLS = '''
import _socket, os, subprocess, time


def _count(marker):
    """Running `sleep marker`s (exec'd: past their setsid)."""
    found = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                found += f.read().split(b"\\0")[:2] == [b"sleep", marker.encode()]
        except OSError:
            pass
    return found


def spawn(marker: str):
    """Three sleepers in sessions of their own; returns how many run (waits for all 3)."""
    subprocess.Popen(["setsid", "sleep", marker])
    subprocess.Popen(["sleep", marker], start_new_session=True)
    if os.fork() == 0:                       # double fork: the grandchild is an orphan
        os.setsid()
        if os.fork() == 0:
            os.execvp("sleep", ["sleep", marker])
        os._exit(0)
    deadline = time.monotonic() + 3
    while _count(marker) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    return _count(marker)


def connect(port: int):
    s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)    # under Python's socket patch
    s.settimeout(2)
    s.connect(("127.0.0.1", port))
    return s.recv(16).decode()


def read(path: str):
    with open(path) as f:
        return f.read()


def write(path: str):
    with open(path, "w") as f:
        f.write("escaped")
    return os.path.abspath(path)


def spin():
    while True:
        pass


def hog(gib: int):
    return len(bytearray(gib * 2 ** 30))
'''


@pytest.fixture(scope="module")
def tools(tmp_path_factory):
    path = tmp_path_factory.mktemp("bwrap_tools") / "escape_tools.py"
    path.write_text(TOOLS)
    return lambda name: make_tool(f"{path}:{name}")


def run(tool, sandbox, limits=Limits(timeout_s=5), **kwargs):
    try:
        return call_tool(tool, kwargs, sandbox, limits)
    except ToolFailed as exc:
        return exc


def marked(marker):
    """Host pids whose command line holds ``marker`` as an argument (zombies have none)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:
            pass
    return found


@pytest.fixture
def marker():
    mark = f"97.{uuid.uuid4().int % 10 ** 12:012d}"        # a unique `sleep` argument
    yield mark
    for pid in marked(mark):                               # what a leaking sandbox left
        os.kill(pid, 9)


@pytest.fixture
def server():
    """A loopback TCP server that greets each connection; yields its port."""
    sock = socket.create_server(("127.0.0.1", 0))
    sock.settimeout(0.2)
    done = threading.Event()

    def serve():
        while not done.is_set():
            try:
                conn, _ = sock.accept()
            except OSError:
                continue
            conn.sendall(b"hello")
            conn.close()
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield sock.getsockname()[1]
    done.set()
    thread.join()
    sock.close()


@needs_bwrap
def test_bwrap_ends_processes_started_in_new_sessions(tools, marker):
    assert run(tools("spawn"), "bwrap", marker=marker) == 3         # they ran inside
    assert marked(marker) == []                                      # and are gone at return
    time.sleep(0.3)
    assert marked(marker) == []


def test_subprocess_leaks_processes_started_in_new_sessions(tools, marker):
    """The documented limit of ``subprocess``: only the child's process group is killed."""
    assert run(tools("spawn"), "subprocess", marker=marker) == 3
    assert len(marked(marker)) == 3                                  # the fixture ends them


@needs_bwrap
def test_bwrap_has_no_network(tools, server):
    assert run(tools("connect"), "subprocess", port=server) == "hello"   # the leak it closes
    err = run(tools("connect"), "bwrap", port=server)
    assert isinstance(err, ToolFailed) and "ConnectionRefusedError" in str(err), err


@needs_bwrap
def test_bwrap_hides_the_hosts_files_and_writes_only_its_work_dir(tools, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2")
    assert run(tools("read"), "subprocess", path=str(secret)) == "hunter2"   # the leak
    for path in (secret, __file__, "/etc/passwd"):
        err = run(tools("read"), "bwrap", path=str(path))
        assert isinstance(err, ToolFailed) and "FileNotFoundError" in str(err), (path, err)
    outside = tmp_path / "escaped.txt"
    rlctl_dir = os.path.dirname(tools_module.__file__)             # visible, read-only
    for path in (outside, "/escaped.txt", os.path.join(rlctl_dir, "escaped.txt")):
        err = run(tools("write"), "bwrap", path=str(path))
        assert isinstance(err, ToolFailed) and "Error" in str(err), (path, err)
        assert not os.path.exists(path)
    inside = run(tools("write"), "bwrap", path="scratch.txt")       # the work directory
    assert os.path.basename(os.path.dirname(inside)).startswith("rlctl-tool-"), inside
    assert not os.path.exists(inside)                               # a tmpfs: never on the host


@needs_bwrap
def test_a_tool_by_module_path_sees_its_package_only(tmp_path, monkeypatch):
    (tmp_path / "sbx_pkg").mkdir()
    (tmp_path / "sbx_pkg" / "__init__.py").write_text("")
    (tmp_path / "sbx_pkg" / "helper.py").write_text("WORD = 'from the package'\n")
    (tmp_path / "sbx_pkg" / "tool.py").write_text(
        "from sbx_pkg.helper import WORD\n\n\ndef read(path: str):\n"
        "    try:\n        return WORD, open(path).read()\n"
        "    except OSError as exc:\n        return WORD, type(exc).__name__\n")
    (tmp_path / "secret.txt").write_text("hunter2")
    monkeypatch.syspath_prepend(str(tmp_path))
    tool = make_tool("sbx_pkg.tool:read")
    path = str(tmp_path / "secret.txt")
    assert run(tool, "subprocess", path=path) == ["from the package", "hunter2"]
    assert run(tool, "bwrap", path=path) == ["from the package", "FileNotFoundError"]


@needs_bwrap
def test_bwrap_keeps_the_limits(tools):
    err = run(tools("spin"), "bwrap", Limits(timeout_s=0.5, cpu_s=30))
    assert isinstance(err, ToolFailed) and "timed out after 0.5 s" in str(err), err
    err = run(tools("spin"), "bwrap", Limits(timeout_s=20, cpu_s=1))  # bwrap's exit 128 + 24
    assert isinstance(err, ToolFailed) and "killed by SIGXCPU (CPU limit)" in str(err), err
    err = run(tools("hog"), "bwrap", Limits(timeout_s=5, memory_mb=256), gib=8)
    assert isinstance(err, ToolFailed) and "MemoryError" in str(err), err


@needs_bwrap
def test_the_calculator_answers_the_same_under_bwrap():
    observations = {}
    for sandbox in ("subprocess", "bwrap"):
        task = build_task("calculator", num_eval=3, max_train=50, sandbox=sandbox, max_tool_calls=4,
                          tool_memory_gb=0.125)
        env = task.make_env()
        env.reset(product_example(123, 45), 0)
        steps = [env.step(Turn(f"<call> calc {expr} </call>", []))
                 for expr in ("1 2 3 * 4 5", "- 7 + 2 * ( 3 - 9 )", "1 +", "9 " * 70)]
        observations[sandbox] = [(s.observation, s.info.get("error")) for s in steps]
    assert observations["bwrap"] == observations["subprocess"]
    assert observations["bwrap"][0][0] == "<result> 5 5 3 5 </result>"
    assert observations["bwrap"][2] == ("<result> error </result>", "calc: ValueError: cannot read '1+'")


# the small calculator agent of tests/models/test_tiny_agents.py (the same cache entry)
SMALL_AGENT = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2",
               "model.warmup_steps=15", "model.warmup_lr=1e-3"]


@needs_bwrap
def test_a_short_train_run_with_the_bwrap_sandbox(rlctl_app, tmp_path):
    """The recipe's settings with task.sandbox=bwrap, 1 step of 4 episodes (its small model
    calls the tool in few of them: the tool's answers are compared in the test above)."""
    run_dir = tmp_path / "run"
    done = rlctl_app("train", "--recipe", "calculator-tool", "task.sandbox=bwrap", "trainer.steps=1",
                     "trainer.prompts_per_step=2", "algo.group_size=2", "trainer.eval_every=0",
                     "task.num_eval=2", "logger=jsonl", "logger.console=false", "run.save_model=false",
                     f"run.dir={run_dir}", *SMALL_AGENT, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in rows if r.get("step") == 1)
    assert "episode/tool_calls_mean" in step, sorted(step)


def _refusal(monkeypatch, path):
    monkeypatch.setenv("PATH", str(path))
    tools_module._bwrap_problem.cache_clear()
    try:
        with pytest.raises(ValueError) as exc:
            check_sandbox("bwrap")
        return str(exc.value)
    finally:
        tools_module._bwrap_problem.cache_clear()


def test_bwrap_missing_or_unusable_is_one_line(monkeypatch, tmp_path):
    assert _refusal(monkeypatch, tmp_path) == (                     # no bwrap there
        "task.sandbox=bwrap: the bwrap binary is not on PATH; install it "
        "(Debian/Ubuntu: apt-get install bubblewrap)")
    fake = tmp_path / "bwrap"                                       # one that cannot unshare
    fake.write_text("#!/bin/sh\necho 'bwrap: setting up uid map: Permission denied' >&2\nexit 1\n")
    fake.chmod(0o755)
    assert _refusal(monkeypatch, tmp_path) == ("task.sandbox=bwrap: bwrap cannot make its sandbox "
                                              "here: bwrap: setting up uid map: Permission denied")
