"""`rlctl rollout`: N*G JSON lines with the documented fields, consistent EOS flags and
log-probs that match an independent forward pass."""
import json

import pytest
import torch

ROW_KEYS = {"group", "sample", "split", "prompt_index", "prompt", "completion", "token_ids",
            "logprobs", "logprob_sum", "length", "ended_with_eos", "truncated",
            "max_new_tokens", "eos_token_id", "stop_token_ids", "reward", "rewards", "correct"}


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def rollout_file(run_a, tmp_path_factory):
    from typer.testing import CliRunner

    from rlctl.cli import app

    out = tmp_path_factory.mktemp("rollout") / "sub" / "ro.jsonl"
    res = CliRunner().invoke(app, ["rollout", str(run_a), "rollout.max_new_tokens=6", "--out",
                                   str(out), "--prompts", "5", "--samples", "4",
                                   "--batch-size", "8"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return out


def test_rollout_rows_fields_and_eos_flags(rollout_file):
    rows = _rows(rollout_file)
    assert len(rows) == 5 * 4
    assert [r["group"] for r in rows] == [g for g in range(5) for _ in range(4)]
    assert [r["sample"] for r in rows] == list(range(4)) * 5
    for r in rows:
        assert set(r) == ROW_KEYS
        assert r["split"] == "train" and r["max_new_tokens"] == 6
        n = r["length"]
        assert n == len(r["token_ids"]) == len(r["logprobs"]) >= 1
        assert all(lp <= 0.0 for lp in r["logprobs"])
        assert r["logprob_sum"] == pytest.approx(sum(r["logprobs"]), abs=1e-4)
        assert r["ended_with_eos"] != r["truncated"]
        eos = r["eos_token_id"]
        if r["ended_with_eos"]:
            assert r["token_ids"][-1] == eos and eos not in r["token_ids"][:-1]
        else:
            assert n == 6 and eos not in r["token_ids"]
        assert set(r["rewards"]) == {"exact", "positional", "inclusion_order"}
        assert r["reward"] == r["rewards"]["positional"]       # the configured design
        assert r["correct"] == (r["rewards"]["exact"] == 1.0)
    # rows of a group share the prompt; groups are distinct train prompts
    assert len({r["prompt"] for r in rows}) == 5


def test_rollout_logprobs_match_an_unpadded_forward(rollout_file, run_a):
    """Recompute log pi(token) for a few rows one at a time (no padding, no batching):
    catches an off-by-one shift or logits of the wrong positions."""
    from rlctl.models.loading import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer("hf", name_or_path=str(run_a / "model"))
    model.eval()
    for r in _rows(rollout_file)[::5]:
        prompt_ids = tok([r["prompt"]], return_tensors="pt")["input_ids"]      # [1, P]
        ids = torch.cat([prompt_ids, torch.tensor([r["token_ids"]])], dim=1)   # [1, P+T]
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, prompt_ids.shape[1] - 1:-1]  # [T, V]
        expected = torch.log_softmax(logits.float(), -1).gather(
            -1, torch.tensor(r["token_ids"])[:, None])[:, 0]
        assert r["logprobs"] == pytest.approx(expected.tolist(), abs=1e-3)


def test_rollout_eval_split_at_a_short_cap_is_truncated(cli, run_a, tmp_path):
    out = tmp_path / "short.jsonl"
    res = cli("rollout", run_a, "rollout.max_new_tokens=3", "--split", "eval", "--out", out,
              "--prompts", "3", "--samples", "2")
    assert res.exit_code == 0, res.output
    rows = _rows(out)
    assert len(rows) == 6 and {r["split"] for r in rows} == {"eval"}
    assert all(r["length"] <= 3 for r in rows)
    truncated = [r for r in rows if r["truncated"]]
    assert truncated and all(r["length"] == 3 and not r["ended_with_eos"] for r in truncated)


def test_rollout_scores_under_the_reward_time_limit(tmp_path):
    """The rewards come from the RewardScorer: a reward that never returns is cut off at
    task.reward_timeout_s (scored 0) instead of hanging `rlctl rollout`."""
    from typer.testing import CliRunner

    from rlctl.cli import app

    (tmp_path / "slow.py").write_text("def reward(prompt, completion, **f):\n    while True:\n        pass\n")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i} 3 1 ="}) + "\n" for i in range(6)))
    out = tmp_path / "ro.jsonl"
    res = CliRunner().invoke(app, ["rollout", "task=jsonl", f"task.train_path={data}", "task.num_eval=2",
                                   f"task.reward_fn={tmp_path / 'slow.py'}:reward",
                                   "task.reward_timeout_s=1", "--out", str(out), "--prompts", "2",
                                   "--samples", "2"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    rows = _rows(out)
    assert len(rows) == 4 and all(r["reward"] == 0.0 and r["correct"] is False for r in rows)
