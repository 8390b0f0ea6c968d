"""Suite-wide settings and fixtures.

Threads are pinned to 1 (on a small CPU more threads make tiny-model steps slower).

Parallel runs (``scripts/test`` runs pytest-xdist, ``-n auto --dist loadgroup``):

* ``build_once(name, build)`` builds something (a model directory, a run) once per test
  run, however many workers ask: the first takes a file lock and builds, the others wait
  for it and reuse the result. It lives in the run's own temporary directory, the parent
  of every worker's ``tmp_path_factory`` base, so runs never share it.
* A test that uses a module-scoped fixture (or a session-scoped one defined in its own
  module) is grouped with the rest of its module, and the users of a session fixture
  named in ``SESSION_GROUPS`` with each other, so that each such fixture is built by one
  worker only (``xdist_group``; loadgroup sends a group to one worker).
* ``rlctl_app`` runs the rlctl Typer app in this process: the same parsing, composition,
  checks and one-line errors as the console script without a new interpreter importing
  torch and transformers (several seconds each). The tests that are about the process
  itself (exit codes of the console script, signals, launched ranks) keep a subprocess.

A test phase (setup, call, teardown) over ``SLOW_S`` = 60 s without ``@pytest.mark.slow``
is listed at the end of the run; slow tests still run (the mark says why they take long).
"""
import fcntl
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from _pytest.nodeid import NodeId  # noqa: E402  (see _name_the_group)
from typer.testing import CliRunner  # noqa: E402

from rlctl.cli import app  # noqa: E402

torch.set_num_threads(1)

# session fixture -> xdist group of the tests that use it (each group runs on one worker)
SESSION_GROUPS = {"runs": "commands-runs"}


def _group_of(item):
    """The xdist group ``item`` belongs to, or None (scheduled on its own)."""
    module = item.nodeid.split("::")[0]
    for name in item.fixturenames:
        defs = item._fixtureinfo.name2fixturedefs.get(name)
        if not defs:
            continue
        fixture = defs[-1]
        if fixture.scope in ("module", "class") or (fixture.scope == "session"
                                                   and fixture.baseid == module):
            return module
        if name in SESSION_GROUPS:
            return SESSION_GROUPS[name]
    return None


def _name_the_group(item, group: str) -> None:
    """What xdist's loadgroup does on a worker: the group appended to the test's id, which
    the scheduler reads. xdist 3.8 writes it to ``Item._nodeid``, which pytest 9.2 no longer
    reads (its ids are ``NodeId`` objects in ``Item._id``), so its groups are silently
    ignored (pytest-dev/pytest-xdist#1386); this writes the id where pytest 9.2 keeps it."""
    if "@" not in item.nodeid.rpartition("]")[2]:
        item._id = NodeId.parse(f"{item.nodeid}@{group}")


@pytest.hookimpl(tryfirst=True)     # before xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        group = None if item.get_closest_marker("xdist_group") else _group_of(item)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        if names and getattr(config.option, "loadgroup", False):       # a loadgroup worker
            _name_the_group(item, "_".join(names))
    # slow tests of no group first, so that no worker starts one when the others are done
    # (grouped tests stay beside their module's, where their fixtures are)
    items.sort(key=lambda it: not (it.get_closest_marker("slow")
                                   and not it.get_closest_marker("xdist_group")))


# -- a test over SLOW_S seconds carries @pytest.mark.slow and a reason ----------------------
SLOW_S = 60
_unmarked_slow = []


def pytest_runtest_logreport(report):
    if report.duration > SLOW_S and "slow" not in report.keywords:
        _unmarked_slow.append(f"{report.duration:.0f}s {report.when} {report.nodeid}")


def pytest_terminal_summary(terminalreporter):
    if _unmarked_slow:
        terminalreporter.section(f"over {SLOW_S} s without @pytest.mark.slow (add it, with the reason)")
        for line in _unmarked_slow:
            terminalreporter.write_line(line)


# -- built once per test run ---------------------------------------------------------------

@contextmanager
def _locked(path: Path):
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)      # released when the file is closed
        yield


@pytest.fixture(scope="session")
def build_once(tmp_path_factory):
    """``build_once(name, build)`` -> the path ``build(directory)`` returned, built once
    per test run: ``directory`` is ``<run tmp>/shared/<name>``, fresh; the result is
    recorded only after ``build`` returns, so a failed build is retried by the next
    caller, never half-used."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"
    root.mkdir(parents=True, exist_ok=True)

    def get(name: str, build) -> Path:
        done = root / f"{name}.path"
        with _locked(root / f"{name}.lock"):
            if not done.exists():
                target = root / name
                if target.exists():
                    shutil.rmtree(target)
                done.write_text(str(build(target)))
        return Path(done.read_text())
    return get


# -- the CLI in this process -------------------------------------------------------------

@pytest.fixture(scope="session")
def rlctl_app():
    """``rlctl_app(*args, cwd=None, env=None, path=())`` -> ``CompletedProcess`` (args,
    returncode, stdout, stderr) of ``rlctl ARGS`` run in this process: ``env`` entries are
    set, ``path`` directories put first on ``sys.path`` (as PYTHONPATH would) and the
    modules imported from them forgotten afterwards. An exception that escapes the app
    (the console script would print a traceback) fails the test. Session-scoped (it
    keeps no state), so module- and session-scoped fixtures can run commands with it."""
    def invoke(*args, cwd=None, env=None, path=()):
        before = set(sys.modules)
        with pytest.MonkeyPatch.context() as mp:
            for key, value in (env or {}).items():
                mp.setenv(key, str(value))
            for directory in path:
                mp.syspath_prepend(str(directory))
            if cwd is not None:
                mp.chdir(cwd)
            argv = [str(a) for a in args]
            try:
                result = CliRunner().invoke(app, argv, catch_exceptions=False)
            finally:
                _forget_modules_under(path, set(sys.modules) - before)
        return subprocess.CompletedProcess(["rlctl", *argv], result.exit_code, result.stdout,
                                           result.stderr)
    return invoke


def _forget_modules_under(dirs, names):
    roots = [str(Path(d).resolve()) for d in dirs]
    for name in names:
        file = getattr(sys.modules.get(name), "__file__", None) or ""
        if roots and any(str(Path(file).resolve()).startswith(r) for r in roots):
            del sys.modules[name]
