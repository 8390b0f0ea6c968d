"""Bring your own task, end to end through the installed console script: a user's
20-line reward module and a JSONL file, trained with one command."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

RLCTL = shutil.which("rlctl") or str(Path(sys.executable).parent / "rlctl")
FAST = ["trainer.steps=3", "trainer.eval_every=3", "trainer.prompts_per_step=4",
        "algo.group_size=4", "logger=jsonl", "logger.console=false"]

USER_MODULE = '''"""My reward: the first digit of the reply should be the smallest digit of the prompt."""
import os


def _note(name):
    log = os.environ.get("MY_REWARD_LOG")
    if log:
        with open(log, "a") as f:
            f.write(name + "\\n")


def smallest_first(prompt, completion, answer, **fields):
    _note("smallest_first")
    words = completion.split()
    return 1.0 if words and words[0] == str(answer) else 0.0


def short(prompt, completion, **fields):
    _note("short")
    return 1.0 if len(completion.split()) <= fields["max_words"] else 0.0
'''


def _rows(n, offset):
    rows = []
    for i in range(n):
        digits = [(i * 7 + offset + k * 3) % 10 for k in range(4)]
        rows.append({"prompt": " ".join(map(str, digits)) + " =", "answer": min(digits),
                     "max_words": 4})
    return rows


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    d = tmp_path_factory.mktemp("byo")
    (d / "my_reward.py").write_text(USER_MODULE)
    assert len(USER_MODULE.splitlines()) <= 20
    for name, rows in (("train.jsonl", _rows(40, 0)), ("eval.jsonl", _rows(8, 5))):
        (d / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def _rlctl(project, *args, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(project),
               MY_REWARD_LOG=str(project / "calls.log"))
    return subprocess.run([RLCTL, "train", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=project)


@pytest.fixture(scope="module")
def single(project):
    out = _rlctl(project, "task=jsonl", "task.train_path=train.jsonl",
                 "task.eval_path=eval.jsonl", "task.reward_fn=my_reward:smallest_first",
                 "run.output_dir=runs/single", *FAST)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out, sorted((project / "runs" / "single").iterdir())[-1]


def test_one_command_trains_on_my_data_and_reward(project, single):
    out, run = single
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 3
    assert set(summary["eval_start"]) >= {"eval/exact_match", "eval/reward"}
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2, 3]
    for r in rows:
        if "reward/mean" in r:
            assert 0.0 <= r["reward/mean"] <= 1.0 and r["reward/errors"] == 0
    calls = (project / "calls.log").read_text().split()
    assert calls.count("smallest_first") >= 3 * 16          # 3 steps x 4 prompts x 4 samples
    cfg = (run / "config.yaml").read_text()
    assert "reward_fn: my_reward:smallest_first" in cfg and "train_path: train.jsonl" in cfg


def test_reward_components_are_logged_when_the_engine_scores_batches(single):
    _, run = single
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert all("reward/timeouts" in r for r in steps)
    assert all("reward/smallest_first" in r for r in steps)


def test_weighted_rewards_from_the_command_line(project, rlctl_app):
    # the same argv through the Typer app in-process (`single` runs the console script)
    out = rlctl_app("train", "task=jsonl", "task.train_path=train.jsonl",
                 "task.eval_path=eval.jsonl", "task.correct_threshold=1.5",
                 "task.rewards=[{fn: my_reward:smallest_first, weight: 1.0}, "
                 "{fn: my_reward:short, weight: 0.5}]",
                 "run.output_dir=runs/multi", *FAST, cwd=project, path=[project],
                 env={"MY_REWARD_LOG": project / "calls.log"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    run = sorted((project / "runs" / "multi").iterdir())[-1]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        if "reward/mean" in r:
            assert 0.0 <= r["reward/mean"] <= 1.5
    assert "short" in (project / "calls.log").read_text().split()


@pytest.mark.parametrize("args, msg", [
    (["task.reward_fn=my_reward:nope"], "module 'my_reward' has no attribute 'nope'"),
    (["task.reward_fn=not_my_module:f"], "cannot import module 'not_my_module'"),
    (["task.reward_fn=my_reward:short", "task.train_path=missing.jsonl"],
     "task.train_path: no such file or directory 'missing.jsonl'"),
    (["task.reward_fn=my_reward:short", "task.num_digits=4"],
     "task.num_digits does not apply to task 'jsonl'"),
    (["task.reward_fn=my_reward:short", "task.on_reward_error=ignore"],
     "invalid task.on_reward_error 'ignore'; valid: zero, raise"),
])
def test_bad_task_options_exit_2_in_one_line(project, args, msg, rlctl_app):
    base = {"task.train_path": "train.jsonl", "task.eval_path": "eval.jsonl"}
    given = {a.split("=", 1)[0] for a in args}
    out = rlctl_app("train", "task=jsonl", *[f"{k}={v}" for k, v in base.items() if k not in given],
                    *args, "run.output_dir=runs/bad", *FAST, cwd=project, path=[project])
    assert out.returncode == 2, out.stdout[-1000:] + out.stderr[-2000:]
    err = out.stderr.strip()
    assert msg in err and len(err.splitlines()) == 1, err
    assert not (project / "runs" / "bad").exists()           # failed before the run dir


def test_arithmetic_runs_from_the_command_line(tmp_path, rlctl_app):
    """The arithmetic task with its own tiny-model warm-up (shortened here to 1 step);
    through the Typer app in-process."""
    out = rlctl_app("train", "algo=grpo", "task=arithmetic", "model.warmup_steps=1",
                    "task.num_eval=16", "run.output_dir=runs", *FAST, cwd=tmp_path,
                    env={"RLCTL_CACHE": tmp_path / "cache"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    summary = json.loads(next((tmp_path / "runs").rglob("summary.json")).read_text())
    assert 0.0 <= summary["eval_end"]["eval/exact_match"] <= 1.0
    meta = json.loads(next((tmp_path / "cache").rglob("rlctl_tiny.json")).read_text())
    assert meta["warmup_task"] == "arithmetic"
