"""Bad input to eval, rollout and inspect: one line on stderr, exit code 2, no traceback."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

RLCTL = shutil.which("rlctl") or str(Path(sys.executable).parent / "rlctl")


def run(*args, cwd=None):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([RLCTL, *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=120)


def test_help_lists_the_commands():
    out = run("--help")
    assert out.returncode == 0
    for cmd in ("eval", "rollout", "inspect"):
        assert cmd in out.stdout


@pytest.mark.parametrize("args, fragment", [
    (["eval", "/nonexistent/run"], "no such file or directory"),
    (["eval", "{tmp}"], "is not a run directory"),
    (["eval", "--samples", "many"], "--samples expects an integer"),
    (["rollout", "{run}", "--out", "{tmp}/x.jsonl", "algo.foo=1"], "unknown config key 'algo.foo'"),
    (["rollout", "{run}"], "--out"),
    (["rollout", "{run}", "stray", "--out", "x.jsonl"], "unexpected argument 'stray'"),
    (["inspect", "/nonexistent/run"], "no such file or directory"),
    (["inspect", "{tmp}"], "is not a run directory"),
    (["inspect"], "inspect needs a PATH"),
])
def test_bad_input_one_line_exit_2(args, fragment, tmp_path, run_a, rlctl_app):
    """The first case through the console script (a user's exit code and stderr); the
    others through the same Typer app in-process, without a new interpreter's imports."""
    args = [a.format(tmp=tmp_path, run=run_a) for a in args]
    out = (run if args == ["eval", "/nonexistent/run"] else rlctl_app)(*args, cwd=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    assert fragment in lines[0], lines[0]
