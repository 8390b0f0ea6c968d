"""`rlctl train` (in this process) on an episodic task loaded by import path: a scripted
environment of the user's own, 2 steps with a held-out eval; the episode metrics and
eval/* of episodes are logged and the run directory is written. (Async actors and several
ranks with episodes: tests/rollout/test_episode_async.py, test_episode_ranks.py.)"""
import json

import pytest

USER_ENV = '''"""A user's own environment: count up; each turn's reward is 1 if it says the next number."""
from rlctl.envs.environment import EnvTask
from rlctl.types import Example, Step


class CountUp:
    def reset(self, example, seed):
        self.n = int(example.fields["start"])
        return example.prompt

    def step(self, turn):
        self.n += 1
        right = turn.text.split() == [str(self.n)]
        return Step(observation=f"{self.n} +", reward=float(right), done=self.n % 3 == 0,
                    info={"success": right, "tool_calls": 1})


def make_task(**options):        # the task config's other keys do not apply here
    rows = [Example(prompt=f"{s} +", fields={"start": s}) for s in range(1, 8)]
    return EnvTask("count_up", CountUp, train=rows[:5], eval=rows[5:])
'''

ARGS = ["trainer.steps=2", "trainer.eval_every=2", "trainer.prompts_per_step=2", "algo.group_size=2",
        "logger=jsonl", "logger.console=false", "run.save_model=false", "task=guess_number",
        "task.name=ep_user_env:make_task", "rollout.max_new_tokens=3",
        "rollout.episode.max_turns=3", "rollout.episode.max_tokens=20", "model.warmup_task=sorting"]


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("user_env")
    (d / "ep_user_env.py").write_text(USER_ENV)
    return d


def test_train_on_a_user_environment_logs_episode_metrics(rlctl_app, user_dir, tmp_path):
    run = tmp_path / "run"
    done = rlctl_app("train", *ARGS, f"run.dir={run}", path=[user_dir], cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in rows if "step" in r}
    assert {1, 2} <= set(steps)
    for key in ("episode/turns_mean", "episode/tool_calls_mean", "episode/turn_limit_frac"):
        assert key in steps[2], sorted(steps[2])
    assert 1 <= steps[2]["episode/turns_mean"] <= 3
    assert steps[2]["episode/tool_calls_mean"] == steps[2]["episode/turns_mean"]  # 1 per step
    for key in ("eval/success_rate", "eval/exact_match", "eval/turns_mean", "eval/tool_calls_mean",
                "eval/tool_errors_mean"):
        assert key in steps[2], sorted(steps[2])
    assert steps[2]["eval/exact_match"] == steps[2]["eval/success_rate"]
    assert (run / "summary.json").is_file() and (run / "config.yaml").is_file()

