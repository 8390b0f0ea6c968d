"""A reward model and the task it is used with: the tiny reward model (5-digit sorting)
is refused in one line for another task or digit count, and a data task scored by a
reward model alone (no reward function) logs no gold reward it does not have
(reward/task, eval/exact_match, pass@k, per-row correctness)."""
import json
from pathlib import Path

import pytest

from random_rm import save_random_reward_model
from rlctl.demo import tiny

FAST = ["trainer.steps=2", "trainer.eval_every=2", "trainer.prompts_per_step=2",
        "algo.group_size=2", "logger=jsonl", "logger.console=false", "rollout.max_new_tokens=6"]


@pytest.mark.parametrize("task, fragment", [
    (["task=arithmetic"], "not task=arithmetic"),
    (["task.num_digits=3"], "not task=sorting task.num_digits=3"),
])
def test_the_tiny_reward_model_is_refused_for_another_task(cli, tmp_path, task, fragment):
    res = cli("train", *task, "task.reward_model=tiny", f"run.output_dir={tmp_path}/runs",
              "trainer.steps=1")
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.exit_code == 2, res.output
    assert len(lines) == 1, lines
    assert "task.reward_model=tiny was fitted on task=sorting task.num_digits=5" in lines[0]
    assert fragment in lines[0] and "rlctl reward-model train" in lines[0]
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_the_tiny_reward_model_is_accepted_for_its_task():
    from rlctl.rm.tiny_rm import task_mismatch

    assert task_mismatch("sorting", 5) is None


@pytest.fixture(scope="module")
def rm_only_run(tmp_path_factory):
    from rlctl.train.run import run_training

    root = tmp_path_factory.mktemp("rm_only")
    save_random_reward_model(root / "rm")
    data = root / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i} {j} ="}) + "\n"
                            for i in range(4) for j in range(4)))
    summary = run_training([f"run.output_dir={root / 'runs'}", *FAST, "task=jsonl",
                            f"task.train_path={data}", "task.num_eval=4",
                            f"task.reward_model={root / 'rm'}"])
    return Path(summary["run_dir"])


def test_a_data_task_scored_by_a_reward_model_alone_logs_no_gold(rm_only_run):
    rows = [json.loads(ln) for ln in (rm_only_run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    evals = [r for r in rows if "eval/reward" in r]
    assert len(steps) == 2 and evals
    for r in steps:
        assert r["reward/mean"] == pytest.approx(r["reward/reward_model"], abs=1e-6)
        assert "reward/task" not in r, sorted(r)        # was logged 0.0: no such reward
    assert not any("eval/exact_match" in r for r in rows)


def test_eval_and_rollout_of_it_report_no_correctness(cli, rm_only_run, tmp_path):
    res = cli("eval", rm_only_run, "--samples", "2")
    assert res.exit_code == 0, res.output
    data = json.loads((rm_only_run / "eval.json").read_text())
    for part in ("greedy", "sampled"):
        assert "exact_match" not in data[part] and not any(k.startswith("pass@") for k in data[part])
        assert data[part]["reward"] == pytest.approx(data[part]["reward/reward_model"], abs=1e-9)
    out = tmp_path / "r.jsonl"
    res = cli("rollout", rm_only_run, "--out", out, "--prompts", "2", "--samples", "2")
    assert res.exit_code == 0, res.output
    rows = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert rows and all(r["correct"] is None for r in rows)
    assert all(set(r["rewards"]) == {"reward_model"} for r in rows)   # the proxy, no gold
