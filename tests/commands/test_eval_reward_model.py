"""`rlctl eval` and `rlctl rollout` of a run trained against a reward model with
``task.reward_norm=running``: scores are normalised with the run's saved statistics (the
newest checkpoint's), never whitened with the evaluated batch's own; the raw scores are
reported beside them, and every row says what it holds (the reward model's score is not
labelled as the task's positional design). Expected values come from the checkpoint's
count/mean/M2 by the formula (x - mean) / sqrt(M2 / count) and from re-scoring the
completions with the reward model directly."""
import json
import math
from pathlib import Path

import pytest

from random_rm import save_random_reward_model
from rlctl.rm.learned import RewardModel
from rlctl.rm.score import render

FAST = ["trainer.steps=2", "trainer.eval_every=2", "task.num_eval=8",
        "trainer.prompts_per_step=4", "algo.group_size=4", "logger=jsonl",
        "logger.console=false", "rollout.max_new_tokens=8"]


@pytest.fixture(scope="module")
def rm_run(tmp_path_factory):
    """(run dir, reward-model dir): 2 steps against a random reward model, running norm."""
    from rlctl.train.run import run_training

    root = tmp_path_factory.mktemp("rm_run")
    save_random_reward_model(root / "rm")
    summary = run_training([f"run.output_dir={root / 'runs'}", *FAST,
                            f"task.reward_model={root / 'rm'}", "task.reward_norm=running"])
    return Path(summary["run_dir"]), root / "rm"


def saved_stats(run: Path):
    (ckpt,) = sorted((run / "checkpoints").glob("step-*"))[-1:]
    s = json.loads((ckpt / "trainer_state.json").read_text())["scorer"]["reward_norm"]["reward_model"]
    return s["mean"], math.sqrt(s["m2"] / s["count"]), s["count"]


def test_eval_normalises_with_the_saved_statistics_and_reports_raw(cli, rm_run, monkeypatch):
    run, _ = rm_run
    monkeypatch.setenv("COLUMNS", "200")          # one table row per line
    res = cli("eval", run, "--samples", "2")
    assert res.exit_code == 0, res.output
    data = json.loads((run / "eval.json").read_text())
    mean, std, count = saved_stats(run)
    assert count == 2 * 4 * 4                     # every training score, none of eval's
    for part in ("greedy", "sampled"):
        d = data[part]
        # normalisation is affine, so the mean normalised score is the normalised mean
        # (to float32: the sums travel as eval/*'s float32 tensor, rlctl.train.evaluate.means)
        assert d["reward"] == pytest.approx((d["reward_raw"] - mean) / std, rel=1e-6, abs=1e-7)
        assert d["reward/reward_model"] == pytest.approx(d["reward_raw"], abs=1e-12)
    assert abs(data["greedy"]["reward"]) > 1e-3   # not whitened by its own batch (was ~1e-17)
    # the trainer's final eval used the same statistics: the same numbers
    end = json.loads((run / "summary.json").read_text())["eval_end"]
    assert data["greedy"]["reward"] == pytest.approx(end["eval/reward"], abs=1e-6)
    assert data["greedy"]["reward_raw"] == pytest.approx(end["eval/reward_raw"], abs=1e-6)
    assert data["reward_norm"]["step"] == 2
    # the labels: what each reward row holds
    lines = res.stdout.splitlines()
    assert any("reward (reward model, normalised with the run's saved statistics, step 2)"
               in ln for ln in lines), res.stdout
    assert any("reward/reward_model (reward model, raw score)" in ln for ln in lines)
    assert any(ln.strip("│ ").startswith("reward/positional ") for ln in lines)
    assert not any("reward (positional)" in ln for ln in lines)


def test_rollout_reports_raw_scores_and_the_saved_normalisation(cli, rm_run, tmp_path):
    run, rm_dir = rm_run
    out = tmp_path / "r.jsonl"
    res = cli("rollout", run, "--out", out, "--prompts", "4", "--samples", "4")
    assert res.exit_code == 0, res.output
    rows = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert len(rows) == 16
    rm = RewardModel(rm_dir)
    direct = rm.score_texts([render(rm.tokenizer, r["prompt"], r["completion"]) for r in rows])
    mean, std, _ = saved_stats(run)
    for r, want in zip(rows, direct):
        # the same model on the same texts, batched differently (float32): 1e-5
        assert r["reward_raw"] == pytest.approx(want, abs=1e-5)
        assert r["rewards"]["reward_model"] == r["reward_raw"]
        assert r["reward"] == pytest.approx((r["reward_raw"] - mean) / std, abs=1e-9)
    rewards = [r["reward"] for r in rows]
    m = sum(rewards) / len(rewards)
    s = math.sqrt(sum((x - m) ** 2 for x in rewards) / len(rewards))
    assert abs(m) > 1e-3 or abs(s - 1) > 1e-3     # not whitened by its own batch (was 0, 1)
    assert "saved statistics (checkpoint step 2)" in res.stderr
