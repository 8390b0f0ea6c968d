"""`rlctl inspect RUN --samples [--step N]`: a real run's sample tables, the audit over a
hand-made samples.jsonl, and the one-line errors."""
import json

import pytest

COLUMNS = ["step", "group", "prompt", "completion", "reward/exact", "reward/inclusion_order",
           "reward/positional", "reward", "advantage", "length", "finish_reason", "stop_id",
           "stop_token", "policy_version"]


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_run_s_newest_tables_are_shown(cli, run_a, tmp_path):
    """run_a: 4 steps, eval every 2, samples at the defaults (every 25: so only the last
    step's train table; n=8 of 4 groups of 4: two whole groups), and an eval table at each
    eval (steps 0, 2, 4)."""
    lines = _lines(run_a / "samples.jsonl")
    assert sorted({(r["table"], r["step"]) for r in lines}) == [("eval", 0), ("eval", 2), ("eval", 4),
                                                                ("train", 4)]
    res = cli("inspect", run_a, "--samples", "--json", tmp_path / "s.json")
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "s.json").read_text())
    assert report["steps"] == {"eval": [0, 2, 4], "train": [4]} and report["step"] == 4
    train = report["tables"]["train"]
    assert [list(r) for r in train] == [COLUMNS] * 8
    assert train == [{k: v for k, v in r.items() if k != "table"} for r in lines if r["table"] == "train"]
    assert len({r["group"] for r in train}) == 2 and {r["policy_version"] for r in train} == {3}
    assert len(report["tables"]["eval"]) == 8 and report["audit"]["rows"] == 8
    assert 0 <= res.stdout.index("train samples at step 4") < res.stdout.index("eval samples at step 4")
    assert "reward_rises_with_length" in res.stdout
    res = cli("inspect", run_a, "--samples", "--step", "2", "--json", tmp_path / "s2.json")
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "s2.json").read_text())
    assert list(report["tables"]) == ["eval"] and report["audit"] is None
    assert "no train rows to audit" in res.stdout


def _hand_run(tmp_path, rows):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("seed: 0\n")
    (run / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def _sample(step, group, length, finish, reward):
    return {"table": "train", "step": step, "group": group, "prompt": "3 1 2 =", "completion": "[1] 2 3",
            "reward/exact": 0.0, "reward/positional": reward, "reward": reward, "advantage": 0.0,
            "length": length, "finish_reason": finish, "stop_id": None if finish == "length" else 2,
            "stop_token": None if finish == "length" else "</s>", "policy_version": step - 1}


# steps 5 and 10, two groups of two each; reward = length / 10 within every group, the
# rows at the cap (8) paid the most; group 0 of step 10 repeats group 0 of step 5's ids
HAND = [(5, 0, 3, "stop"), (5, 0, 8, "length"), (5, 1, 4, "stop"), (5, 1, 8, "length"),
        (10, 0, 2, "stop"), (10, 0, 8, "length"), (10, 1, 5, "stop"), (10, 1, 8, "length")]


def test_the_audit_runs_over_the_sample_rows(cli, tmp_path):
    run = _hand_run(tmp_path, [_sample(s, g, n, f, n / 10) for s, g, n, f in HAND])
    res = cli("inspect", run, "--samples", "--json", tmp_path / "a.json")
    assert res.exit_code == 0, res.output
    audit = json.loads((tmp_path / "a.json").read_text())["audit"]
    assert audit["rows"] == 8 and audit["groups"] == 4           # (step, group): 4 groups, not 2
    assert audit["truncation_rate"] == pytest.approx(0.5)
    assert audit["mean_reward_truncated"] == pytest.approx(0.8)
    assert audit["mean_reward_finished"] == pytest.approx((3 + 4 + 2 + 5) / 40)
    assert audit["reward_length_corr"] == pytest.approx(1.0)
    flags = {s["sign"]: s["flagged"] for s in audit["hacking_signs"]}
    assert flags["reward_rises_with_length"] and flags["truncated_scores_as_well"]
    assert flags["top_rewards_at_length_cap"]
    assert "[1] 2 3" in res.stdout                                # printed as text, not markup
    res = cli("inspect", run, "--samples", "--step", "5", "--json", tmp_path / "b.json")
    assert json.loads((tmp_path / "b.json").read_text())["audit"]["rows"] == 4
    res = cli("inspect", run / "samples.jsonl", "--json", tmp_path / "c.json")   # the file as PATH
    assert res.exit_code == 0 and json.loads((tmp_path / "c.json").read_text())["step"] == 10


@pytest.mark.parametrize("args, message", [
    (["--samples"], "has no samples.jsonl (a run writes one with logger.jsonl=true and "
                    "logger.samples.every > 0"),
    (["--samples", "--step", "7"], "has no sample table at step 7; steps with samples: train: 5, 10"),
    (["--samples", "--step", "7", "--table"], "unknown option '--table'"),
    (["--step", "5"], "--step N picks a sample table: use it with --samples"),
    (["--samples", "--step", "x"], "--step expects an integer, got 'x'"),
])
def test_sample_errors_are_one_line(cli, tmp_path, args, message):
    run = _hand_run(tmp_path, [_sample(s, g, n, f, 0.1) for s, g, n, f in HAND])
    if "no samples.jsonl" in message:
        (run / "samples.jsonl").unlink()
    res = cli("inspect", run, *args)
    assert res.exit_code == 2
    assert message in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "Traceback" not in res.output


def test_samples_of_two_runs_is_refused(cli, run_a, run_b):
    res = cli("inspect", run_a, run_b, "--samples")
    assert res.exit_code == 2 and "--samples reads one run directory" in res.stderr


@pytest.mark.parametrize("change, message", [
    ({"reward": None}, "row 2 (train) needs numbers in reward (required: step, reward, length)"),
    ({"length": "six"}, "row 2 (train) needs numbers in length"),
    ({"table": "test"}, "row 2 has table 'test'; valid: train, eval"),
])
def test_a_malformed_sample_row_is_one_line_naming_it(cli, tmp_path, change, message):
    rows = [_sample(s, g, n, f, 0.1) for s, g, n, f in HAND]
    rows[1] = dict(rows[1], **change)
    res = cli("inspect", _hand_run(tmp_path, rows), "--samples")
    assert res.exit_code == 2, res.output
    assert message in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
