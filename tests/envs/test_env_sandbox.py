"""The subprocess sandbox with real child interpreters (each call well under 3 s): a tool
that loops forever is stopped by its wall or CPU limit, one that allocates far past its
memory limit fails inside the child, the environment is scrubbed, the working directory
is a fresh temporary one, sockets are refused; failures become error observations."""
import os
import resource
import time

import pytest

from rlctl.envs.builtin import product_example
from rlctl.envs.tools import Limits, ToolEnv, ToolFailed, call_tool, check_sandbox, make_tool
from rlctl.tasks import build_task
from rlctl.types import Turn

TOOLS = '''
import os, socket, subprocess, sys, time


def spin():
    while True:
        pass


def hog(gib: int):
    return len(bytearray(gib * 2 ** 30))


def environ():
    return dict(os.environ)


def where():
    with open("scratch.txt", "w") as f:
        f.write("x")
    return os.getcwd()


def noisy(n: int):
    print("this must not reach the result")
    sys.stdout.flush()
    return n + 1


def connect():
    socket.create_connection(("127.0.0.1", 9), timeout=0.5)


def new_socket():
    return str(socket.socket())


def spawn():
    return subprocess.Popen(["sleep", "30"]).pid


def fork():
    pid = os.fork()
    if pid == 0:                  # holds the reply pipe: the parent's read waits on it
        time.sleep(8)
        os._exit(0)
    return pid
'''


@pytest.fixture(scope="module")
def tools(tmp_path_factory):
    path = tmp_path_factory.mktemp("sandbox") / "sandboxed_tools.py"
    path.write_text(TOOLS)
    return lambda name: make_tool(f"{path}:{name}")


def timed(tool, kwargs, limits):
    t0 = time.monotonic()
    try:
        return call_tool(tool, kwargs, "subprocess", limits), time.monotonic() - t0
    except ToolFailed as exc:
        return exc, time.monotonic() - t0


def test_a_tool_that_loops_forever_is_stopped_by_its_wall_limit(tools):
    err, took = timed(tools("spin"), {}, Limits(timeout_s=0.8, cpu_s=30))
    assert isinstance(err, ToolFailed) and str(err) == "spin: timed out after 0.8 s"
    assert 0.8 <= took < 2.0


def test_a_tool_that_loops_forever_is_stopped_by_its_cpu_limit(tools):
    # 1 s of CPU (1-2.5 s of wall time on a loaded 2-core box); the wall limit is far off
    err, took = timed(tools("spin"), {}, Limits(timeout_s=20, cpu_s=1))
    assert isinstance(err, ToolFailed) and "killed by SIGXCPU (CPU limit)" in str(err), err


def test_a_tool_far_past_its_memory_limit_fails_in_the_child(tools):
    before = resource.getrlimit(resource.RLIMIT_AS)
    err, took = timed(tools("hog"), {"gib": 8}, Limits(timeout_s=2.5, memory_mb=256))
    assert isinstance(err, ToolFailed) and str(err).startswith("hog: MemoryError")
    assert resource.getrlimit(resource.RLIMIT_AS) == before           # ours untouched
    assert len(bytearray(64 * 2 ** 20)) == 64 * 2 ** 20                # and we still allocate


def test_the_environment_is_scrubbed_and_the_cwd_is_temporary(tools, monkeypatch):
    monkeypatch.setenv("RLCTL_TEST_SECRET", "hunter2")
    env, _ = timed(tools("environ"), {}, Limits(timeout_s=2.5))
    assert "RLCTL_TEST_SECRET" not in env and "hunter2" not in env.values()
    assert set(env) <= {"PATH", "HOME", "TMPDIR", "LANG", "OMP_NUM_THREADS",
                        "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "LC_CTYPE"}
    cwd, _ = timed(tools("where"), {}, Limits(timeout_s=2.5))
    assert os.path.basename(cwd).startswith("rlctl-tool-") and cwd != os.getcwd()
    assert not os.path.exists(cwd)                                     # removed with its file
    assert env["HOME"].startswith(os.path.dirname(cwd))


def test_sockets_are_refused_and_prints_do_not_reach_the_result(tools):
    for name in ("connect", "new_socket"):
        err, _ = timed(tools(name), {}, Limits(timeout_s=2.5))
        assert isinstance(err, ToolFailed) and "network is disabled" in str(err), err
    assert timed(tools("noisy"), {"n": 41}, Limits(timeout_s=2.5))[0] == 42


def _ended(pid: int, within_s: float = 2.0) -> bool:
    """The process is gone or a zombie (nobody may reap it in a container) within the time."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_processes_a_tool_leaves_behind_end_with_its_call(tools):
    pid, _ = timed(tools("spawn"), {}, Limits(timeout_s=2.5))
    assert isinstance(pid, int), pid
    try:
        assert _ended(pid), "the tool's child outlived the call"
    finally:
        if not _ended(pid, 0.0):
            os.kill(pid, 9)
    # a forked child keeps the reply pipe open: the result still comes back at once,
    # not after the wall limit (5 s) or the child's 8 s, and the child is gone
    pid, took = timed(tools("fork"), {}, Limits(timeout_s=5))
    assert isinstance(pid, int) and took < 2.5, (pid, took)
    assert _ended(pid)


def test_failures_become_error_observations(tools):
    env = ToolEnv([tools("spin")], lambda ex, text: 0.0, sandbox="subprocess",
                  limits=Limits(timeout_s=0.5))
    env.reset(product_example(123, 45), 0)
    step = env.step(Turn("<call> spin </call>", []))
    assert step.observation == "<result> error </result>" and not step.done
    assert (step.info["tool_calls"], step.info["tool_errors"]) == (1, 1)
    assert step.info["error"] == "spin: timed out after 0.5 s"


def test_the_calculator_in_the_subprocess_sandbox():
    env = build_task("calculator", num_eval=3, max_train=50, sandbox="subprocess", tool_memory_gb=0.125,
                     prompt_format="raw", reward_timeout_s=60, on_reward_error="zero").make_env()
    env.reset(product_example(123, 45), 0)
    assert env.step(Turn("<call> calc 1 2 3 * 4 5 </call>", [])).observation == "<result> 5 5 3 5 </result>"
    assert env.step(Turn("5 5 3 5", [])).reward == 1.0


def test_tools_the_child_cannot_load_are_refused_up_front():
    with pytest.raises(ValueError, match="cannot run in the subprocess sandbox: define it at the top level"):
        check_sandbox("subprocess", [make_tool(lambda: 1, name="anon")])
    assert check_sandbox("none", [make_tool(lambda: 1)]) == "none"
