"""Failures that must not be silent: a task factory that returns no task, or a task
without training rows, is refused in one line (exit 2 from the CLI)."""
import pytest

from rlctl.tasks import build_task

FACTORIES = '''
from rlctl.envs.environment import EnvTask
from rlctl.types import Example


def as_list(**options):
    return [Example("1 +")]


def no_train(**options):
    return EnvTask("empty", object, [], [Example("1 +")])
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
