"""`rlctl inspect`: one run, two runs, and the audit of a hand-made rollout file."""
import dataclasses
import json
from pathlib import Path

import pytest

from rlctl.rm.settings import RMConfig

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


def test_inspect_of_a_reward_model_run_reads_its_metrics_and_its_own_defaults(cli, run_a, tmp_path):
    """A run of `rlctl reward-model train` (issue 21.13): its config is compared with the
    reward-model command's defaults (``RMConfig``'s and the composed sections),
    not `rlctl train`'s, and its metrics are the fit's."""
    prefs = tmp_path / "p.jsonl"
    prefs.write_text("".join(json.dumps({"prompt": f"{a} {b} =", "chosen": f"{min(a, b)} {max(a, b)}",
                                         "rejected": f"{max(a, b)} {min(a, b)}"}) + "\n"
                             for a, b in [(1, 2), (5, 3), (9, 4), (2, 7), (8, 6), (0, 3)]))
    res = cli("reward-model", "train", prefs, "--eval", prefs, "logger=jsonl",
              "logger.console=false", "rm.steps=3", "rm.eval_every=2", "rm.batch_size=2",
              f"run.output_dir={tmp_path / 'runs'}")
    assert res.exit_code == 0, res.output
    (run_dir,) = (tmp_path / "runs").iterdir()
    res = cli("inspect", run_dir, "--json", tmp_path / "rm.json")
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "rm.json").read_text())
    assert report["keys_not_in_run"] == [] and "not in this run's config" not in res.stdout
    defaults = dataclasses.asdict(RMConfig())
    diff = report["config_diff"]
    assert diff["rm.steps"] == {"default": defaults["steps"], "run": 3}
    assert diff["rm.eval_every"] == {"default": defaults["eval_every"], "run": 2}
    assert diff["rm.batch_size"] == {"default": defaults["batch_size"], "run": 2}
    assert diff["data.prefs"]["run"] == str(prefs) and diff["data.eval"]["run"] == str(prefs)
    assert not [k for k in diff if k.startswith("rm.") and k not in
                ("rm.steps", "rm.eval_every", "rm.batch_size")]
    assert not [k for k in diff if k.split(".")[0] in ("algo", "trainer", "task", "rollout")]
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    loss = [r["train/loss"] for r in rows if "train/loss" in r]
    m = report["metrics"]
    assert m["train/loss"]["n"] == 3 and (m["train/loss"]["first"], m["train/loss"]["last"]) == \
        (loss[0], loss[-1])
    assert m["eval/pairwise_accuracy"]["n"] == 2     # eval_every=2: step 2, and the last step 3
    assert m["eval/pairwise_accuracy"]["best"] == m["eval/pairwise_accuracy"]["max"]
    assert "train/loss" in res.stdout and "reward/mean" not in res.stdout
    for stem in ("rm_loss", "rm_accuracy", "rm_margin"):
        assert (run_dir / f"inspect_{stem}.png").read_bytes()[:8] == PNG_MAGIC
    res = cli("inspect", run_dir, run_dir, "--no-plots", "--json", tmp_path / "cmp.json")
    assert res.exit_code == 0, res.output
    cmp = json.loads((tmp_path / "cmp.json").read_text())
    assert "eval/pairwise_accuracy" in cmp["summary_keys"] and "reward/mean" not in cmp["summary_keys"]
    res = cli("inspect", run_a, run_dir, "--no-plots", "--json", tmp_path / "mixed.json")
    assert res.exit_code == 0, res.output
    mixed = json.loads((tmp_path / "mixed.json").read_text())
    rl, rm = mixed["runs"]
    assert {"reward/mean", "train/loss"} <= set(mixed["summary_keys"])
    # an RL run beside a reward-model run: their own sections named once by section, not
    # ~100 keys as a changed schema
    assert "schema changed" not in res.stdout
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("RL and reward-model"))
    assert f"algo.*, rollout.*, task.*, trainer.* [{rl}]" in line and f"data.*, rm.* [{rm}]" in line
