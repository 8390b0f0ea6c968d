"""`rlctl inspect`: one run, two runs, and the audit of a hand-made rollout file."""
import json

import pytest

PLOTS = ("reward", "eval_exact_match", "kl", "clip_frac", "entropy", "length")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_inspect_run_writes_plots_and_config_diff(cli, run_b, tmp_path):
    res = cli("inspect", run_b, "--json", tmp_path / "report.json")
    assert res.exit_code == 0, res.output
    for stem in PLOTS:
        png = run_b / f"inspect_{stem}.png"
        assert png.read_bytes()[:8] == PNG_MAGIC, png
        assert str(png) in res.stdout.replace("\n", "")
    report = json.loads((tmp_path / "report.json").read_text())
    diff = report["config_diff"]
    assert diff["algo.clip_eps"]["run"] == 0.1 and diff["algo.clip_eps"]["default"] != 0.1
    assert diff["trainer.steps"]["run"] == 4
    assert "algo.group_size" in diff and "algo.name" not in diff     # grpo is the default
    assert "algo.clip_eps" in res.stdout
    m = report["metrics"]
    assert m["reward/mean"]["n"] == 4 and m["eval/exact_match"]["n"] == 3   # steps 0, 2, 4
    assert m["eval/exact_match"]["best"] == max(m["eval/exact_match"][k] for k in ("min", "max"))


def test_inspect_two_runs_shows_the_differing_key(cli, run_a, run_b, tmp_path):
    out = tmp_path / "plots"
    res = cli("inspect", run_a, run_b, "--out-dir", out, "--json", tmp_path / "cmp.json")
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "cmp.json").read_text())
    a, b = report["runs"]
    assert report["config_diff"]["algo.clip_eps"] == {a: 0.2, b: 0.1}
    assert "trainer.steps" not in report["config_diff"]            # same in both runs
    assert "algo.clip_eps" in res.stdout
    for stem in PLOTS:
        assert (out / f"inspect_compare_{stem}.png").read_bytes()[:8] == PNG_MAGIC


def _row(group, length, truncated, reward, cap=6, eos=2):
    ids = [5] * cap if truncated else [5] * (length - 1) + [eos]
    return {"group": group, "prompt": "3 1 2 =", "completion": "1 2 3", "token_ids": ids,
            "logprobs": [-0.5] * len(ids), "length": length, "ended_with_eos": not truncated,
            "truncated": truncated, "max_new_tokens": cap, "eos_token_id": eos,
            "reward": reward, "correct": False}


# 5 groups of 2; reward = length / 10; 3 of 10 rows truncated at the cap 6, all paid 0.6;
# group 1 has equal rewards (zero std).
HAND = [(0, 3, False), (0, 5, False), (1, 4, False), (1, 4, False), (2, 6, True),
        (2, 2, False), (3, 6, True), (3, 3, False), (4, 6, True), (4, 5, False)]


def test_inspect_rollout_audit_of_a_hand_made_file(cli, tmp_path):
    path = tmp_path / "hand.jsonl"
    path.write_text("".join(json.dumps(_row(g, n, t, n / 10)) + "\n" for g, n, t in HAND))
    res = cli("inspect", path, "--json", tmp_path / "audit.json")
    assert res.exit_code == 0, res.output
    rep = json.loads((tmp_path / "audit.json").read_text())
    assert rep["rows"] == 10 and rep["groups"] == 5
    assert rep["truncation_rate"] == pytest.approx(0.3)
    assert rep["frac_zero_std_groups"] == pytest.approx(0.2)
    assert rep["reward_length_corr"] == pytest.approx(1.0)
    assert rep["mean_reward_truncated"] == pytest.approx(0.6)
    assert rep["mean_reward_finished"] == pytest.approx(2.6 / 7)
    assert rep["alignment_ok"] is True
    flags = {s["sign"]: s["flagged"] for s in rep["hacking_signs"]}
    assert flags["reward_rises_with_length"] and flags["truncated_scores_as_well"]
    assert flags["top_rewards_at_length_cap"] and not flags["wrong_beats_correct"]
    assert "truncation rate" in res.stdout and "0.3" in res.stdout
    assert sum(len(v) for v in rep["samples"].values()) > 0


def test_inspect_rollout_audit_finds_misaligned_rows(cli, tmp_path):
    rows = [_row(0, 3, False, 0.3), _row(0, 6, True, 0.6)]
    rows[1]["length"] = 4                       # truncated but shorter than the cap
    rows[0]["logprobs"] = rows[0]["logprobs"][:-1]  # one log-prob missing
    bad_eos = _row(1, 4, False, 0.1)
    bad_eos["token_ids"] = [5, 2, 5, 2]         # EOS inside: the mask must stop at the first
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows + [bad_eos]) + "{torn line\n")
    res = cli("inspect", path, "--json", tmp_path / "audit.json")
    assert res.exit_code == 0, res.output
    rep = json.loads((tmp_path / "audit.json").read_text())
    checks = rep["checks"]
    assert checks["truncated_at_cap"]["violations"] == 1 and checks["truncated_at_cap"]["lines"] == [2]
    assert checks["logprobs_match_tokens"]["violations"] == 1
    assert checks["no_eos_inside"]["violations"] == 1 and checks["no_eos_inside"]["lines"] == [3]
    assert rep["bad_lines"] == 1 and rep["alignment_ok"] is False
    assert "PROBLEMS" in res.stdout
