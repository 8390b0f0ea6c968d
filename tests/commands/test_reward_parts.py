"""`rlctl eval` and `rlctl rollout` report each reward function beside the weighted total,
under training's names (reward/<name>), a weight-0 reward included."""
import json

import pytest

REWARDS = "def right(prompt, completion, **f):\n    return float('1' in completion)\n\n" \
          "def fmt(prompt, completion, **f):\n    return 0.25\n"


@pytest.fixture()
def two_rewards(tmp_path):
    (tmp_path / "r.py").write_text(REWARDS)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i} 3 1 ="}) + "\n" for i in range(6)))
    return ["task=jsonl", f"task.train_path={data}", "task.num_eval=2", "rollout.max_new_tokens=4",
            f"task.rewards=[{{fn:'{tmp_path}/r.py:right'}},{{fn:'{tmp_path}/r.py:fmt',weight:0}}]"]


def test_eval_reports_each_reward_function(cli, tmp_path, two_rewards):
    res = cli("eval", *two_rewards, "--out", tmp_path / "e.json")
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "e.json").read_text())
    for part in ("greedy", "sampled"):
        d = data[part]
        assert d["reward/fmt"] == 0.25 and 0.0 <= d["reward/right"] <= 1.0
        assert d["reward"] == pytest.approx(d["reward/right"])       # fmt weighs 0
    assert "reward/fmt" in res.stdout and "reward/right" in res.stdout


def test_rollout_rows_hold_each_reward_function(cli, tmp_path, two_rewards):
    out = tmp_path / "ro.jsonl"
    res = cli("rollout", *two_rewards, "--out", out, "--prompts", "2", "--samples", "2")
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4
    for r in rows:
        assert set(r["rewards"]) == {"right", "fmt"} and r["rewards"]["fmt"] == 0.25
        assert r["reward"] == r["rewards"]["right"]
    assert "reward/fmt 0.2500" in res.stdout and "reward/right" in res.stdout   # the summary
