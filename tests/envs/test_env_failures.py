"""Failures that must not be silent: a tool that fails on every call is said once per tool
and kind, in one line with what the sandboxed child said last; a task factory that returns
no task, or a task without training rows, is refused in one line (exit 2 from the CLI)."""
import logging

import pytest

from rlctl.envs.tools import Limits, ToolEnv, make_tool
from rlctl.tasks import build_task
from rlctl.types import Example, Turn

TOOLS = '''
import os, signal, sys


def raises(x: int):
    raise ZeroDivisionError("no way")


def dies(x: int):
    sys.stderr.write("first line\\nlibfoo.so: cannot map segment\\n")
    sys.stderr.flush()
    os._exit(3)


def crashes(x: int):
    print("Fatal Python error: Segmentation fault", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGSEGV)
'''
HEAVY = '''
BALLAST = bytearray(2 * 2 ** 30)      # what importing torch does under a small memory limit


def light(x: int):
    return x
'''
TOOLS_LOG = "rlctl.envs.tools"


@pytest.fixture(scope="module")
def tool_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("failing_tools")
    (d / "failing_tools.py").write_text(TOOLS)
    (d / "heavy_tools.py").write_text(HEAVY)
    return d


def calls(env: ToolEnv, name: str, n: int):
    env.reset(Example("q"), 0)
    return [env.step(Turn(f"<call> {name} 1 </call>", [])) for _ in range(n)]


@pytest.mark.parametrize("module, name, sandbox, words", [
    ("failing_tools", "raises", "none", ("ZeroDivisionError: no way",)),
    ("failing_tools", "raises", "subprocess", ("ZeroDivisionError: no way",)),
    ("heavy_tools", "light", "subprocess", ("MemoryError",)),
    ("failing_tools", "dies", "subprocess", ("exited with code 3", "libfoo.so: cannot map segment")),
    ("failing_tools", "crashes", "subprocess", ("killed by SIGSEGV", "Segmentation fault")),
])
def test_a_failing_tool_is_said_once_per_kind_with_its_reason(tool_dir, caplog, monkeypatch,
                                                               module, name, sandbox, words):
    monkeypatch.syspath_prepend(str(tool_dir))
    monkeypatch.setattr("rlctl.envs.tools._SAID", set())     # said once per process: start afresh
    env = ToolEnv([make_tool(f"{tool_dir / module}.py:{name}")], lambda ex, text: 0.0,
                  sandbox=sandbox, limits=Limits(timeout_s=10, memory_mb=256), max_tool_calls=4)
    with caplog.at_level(logging.WARNING, logger=TOOLS_LOG):
        steps = calls(env, name, 2)
    assert [s.info["tool_errors"] for s in steps] == [1, 1]
    lines = [r.getMessage() for r in caplog.records if r.name == TOOLS_LOG]
    assert len(lines) == 1 and f"tool {name} failed" in lines[0], lines
    assert all(w in lines[0] for w in words), lines[0]


def test_the_models_own_call_mistakes_are_not_said(tool_dir, caplog, monkeypatch):
    """A malformed call or an unknown tool is the policy's doing: counted, not logged."""
    monkeypatch.syspath_prepend(str(tool_dir))
    env = ToolEnv([make_tool(f"{tool_dir / 'failing_tools'}.py:raises")], lambda ex, text: 0.0)
    with caplog.at_level(logging.WARNING, logger=TOOLS_LOG):
        env.reset(Example("q"), 0)
        steps = [env.step(Turn(t, [])) for t in ("<call> nope 1 </call>", "<call> raises")]
    assert [s.info["tool_errors"] for s in steps] == [1, 1] and not caplog.records


FACTORIES = '''
from rlctl.envs.environment import EnvTask
from rlctl.types import Example


def as_list(**options):
    return [Example("1 +")]


def no_train(**options):
    return EnvTask("empty", object, [], [Example("1 +")])


def no_eval(**options):
    return EnvTask("empty", object, [Example("1 +")], [])
'''


@pytest.mark.parametrize("factory, why", [
    ("as_list", "its factory returned list, not a task: an object with train_examples()"),
    ("no_train", "it has no training rows")])
def test_a_factory_that_returns_no_usable_task_is_refused_in_one_line(tmp_path, rlctl_app,
                                                                      factory, why):
    (tmp_path / "factories.py").write_text(FACTORIES)
    spec = f"{tmp_path / 'factories.py'}:{factory}"
    with pytest.raises(ValueError, match=why):
        build_task(spec)
    done = rlctl_app("train", "task=guess_number", f"task.name={spec}", "task.max_number=null",
                     f"run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert done.returncode == 2 and why in done.stderr and len(done.stderr.splitlines()) == 1, \
        done.stderr


def test_a_task_with_no_held_out_rows_is_refused_when_evaluation_is_on(tmp_path, rlctl_app):
    """Without held-out rows every eval/* would be a measured-looking 0.000: refused in one
    line while trainer.eval_every > 0, accepted (dry run) with trainer.eval_every=0."""
    (tmp_path / "factories.py").write_text(FACTORIES)
    common = ("train", "task=guess_number", f"task.name={tmp_path / 'factories.py'}:no_eval",
              "task.max_number=null", f"run.dir={tmp_path / 'run'}")
    done = rlctl_app(*common, "trainer.eval_every=2", cwd=tmp_path)
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
    assert "no held-out rows" in done.stderr and "trainer.eval_every=0" in done.stderr
    assert not (tmp_path / "run").exists()
    done = rlctl_app(*common, "trainer.eval_every=0", "--dry-run", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
