"""Environments of the user's own, loaded by import path as tasks are: one written in a
temporary file, one importable by module name, and docs/agents.md's example (at most 30
lines), played with scripted turns and built from a composed config as the docs say."""
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rlctl.config.compose import compose
from rlctl.envs.environment import ENVS, is_episodic
from rlctl.demo.tiny import resolve_warmup_task
from rlctl.tasks import build_task
from rlctl.types import Turn

ROOT = Path(__file__).resolve().parents[2]
COMMON = dict(prompt_format="raw", reward_timeout_s=60, on_reward_error="zero")

COUNTDOWN = '''
from rlctl.envs.environment import EnvTask
from rlctl.types import Example, Step


class Countdown:
    """Say the numbers down from n to 1, one per turn; 0.5 per right number."""
    def reset(self, example, seed):
        self.next = example.fields["n"]
        return f"count down from {self.next}"

    def step(self, turn):
        right = turn.text.strip() == str(self.next)
        self.next -= 1
        done = self.next == 0 or not right
        return Step(None if done else "next", 0.5 * right, done, {"success": done and right})


def make_task(num_eval: int = 2, start: int = 3):
    rows = [Example("", {"n": n}) for n in range(start, start + 10)]
    return EnvTask("countdown", Countdown, rows[num_eval:], rows[:num_eval])
'''


def play(env, example, turns):
    first = env.reset(example, 0)
    return first, [(s.observation, s.reward, s.done, s.info)
                   for s in (env.step(Turn(t, [])) for t in turns)]


def test_a_user_environment_from_a_file(tmp_path):
    (tmp_path / "countdown_env.py").write_text(COUNTDOWN)
    spec = f"{tmp_path / 'countdown_env.py'}:make_task"
    task = build_task(spec, num_eval=3, **COMMON)
    assert is_episodic(task) and len(task.eval_examples()) == 3 and len(task.train_examples()) == 7
    first, steps = play(task.make_env(), task.eval_examples()[0], ["3", "2", "1"])
    assert first == "count down from 3"
    assert steps == [("next", 0.5, False, {"success": False}), ("next", 0.5, False, {"success": False}),
                     (None, 0.5, True, {"success": True})]
    _, steps = play(task.make_env(), task.eval_examples()[0], ["3", "7"])
    assert steps[-1] == (None, 0.0, True, {"success": False})
    assert is_episodic(ENVS.get(spec)(num_eval=1))    # the environment registry loads it too
    with pytest.raises(ValueError) as exc:
        build_task(spec, max_number=4, **COMMON)
    assert str(exc.value).startswith("task.max_number does not apply to task")


def test_a_user_environment_by_module_name(tmp_path, monkeypatch):
    (tmp_path / "countdown_mod.py").write_text(COUNTDOWN)
    monkeypatch.syspath_prepend(str(tmp_path))
    task = build_task("countdown_mod:make_task", num_eval=1, start=5, **COMMON)
    assert task.eval_examples()[0].fields == {"n": 5}
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        build_task("countdown_mod:nope", **COMMON)


def _example_source() -> str:
    text = (ROOT / "docs" / "agents.md").read_text()
    (body,) = re.findall(r"```python\n(# myenv\.py.*?)```", text, re.S)
    return body


def test_the_docs_example_environment(tmp_path, monkeypatch):
    source = _example_source()
    assert len(source.splitlines()) <= 30
    (tmp_path / "myenv.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    cfg = compose(["task=guess_number", "task.name=myenv.py:make_task", "task.max_number=null"]).cfg
    opts = {k: v for k, v in OmegaConf.to_container(cfg.task).items()
            if k not in ("name", "reward_model", "reward_norm", "reward_clip")}
    task = build_task(cfg.task.name, **opts)                      # as the docs say: it builds
    # model.warmup_task is ${task.name}: the tiny model takes a user task's path (sorting warm-up)
    assert resolve_warmup_task(cfg.model.warmup_task) == "sorting"
    assert is_episodic(task) and len(task.eval_examples()) == opts["num_eval"]
    rows = task.train_examples() + task.eval_examples()
    boiling = next(ex for ex in rows if ex.prompt.startswith("What is 212 F"))
    env = task.make_env()
    first, steps = play(env, boiling, [
        '<tool_call>{"name": "to_celsius", "arguments": {"fahrenheit": 212}}</tool_call>', "100.0"])
    assert first == "What is 212 F in Celsius? Answer with the number."
    assert steps[0][:3] == ("<result> 100.0 </result>", 0.0, False)      # (212 - 32) * 5 / 9
    assert steps[1][:3] == (None, 1.0, True)
    _, (wrong,) = play(env, boiling, ["212"])
    assert wrong[:3] == (None, 0.0, True)
    held, train = ({ex.prompt for ex in part} for part in (task.eval_examples(), task.train_examples()))
    assert not held & train and len(held | train) == 261                  # -40..220 F
