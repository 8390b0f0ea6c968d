"""One evaluator: `rlctl eval RUN` reports exactly the run's last `eval/*` row (same keys,
same values) for a single-turn task (sorting) and for a task played as episodes
(guess_number), each trained with an evaluation at its last step."""
import json

EPISODE = ["task=guess_number", "task.max_number=4", "task.num_eval=3", "model.warmup_task=sorting",
           "rollout.max_new_tokens=1", "rollout.episode.max_turns=4", "rollout.episode.max_tokens=14",
           "trainer.steps=2", "trainer.eval_every=2", "trainer.prompts_per_step=2",
           "algo.group_size=2", "logger=jsonl", "logger.console=false"]


def _last_eval_row(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if any(k.startswith("eval/") for k in r)][-1]
    return last["step"], {k: v for k, v in last.items() if k.startswith("eval/")}


def _eval_json(cli, run_dir, out):
    res = cli("eval", run_dir, "--samples", "2", "--out", out)
    assert res.exit_code == 0, res.output
    return json.loads(out.read_text())


def test_eval_of_a_run_is_its_last_eval_row(cli, run_a, tmp_path):
    step, logged = _last_eval_row(run_a)
    assert step == 4 and set(logged) == {"eval/exact_match", "eval/reward", "eval/length_mean",
                                         "eval/truncated_frac"}
    data = _eval_json(cli, run_a, tmp_path / "eval.json")
    assert data["eval"] == logged
    assert {f"eval/{k}": data["greedy"][k] for k in ("exact_match", "reward", "length_mean",
                                                     "truncated_frac")} == logged


def test_eval_of_an_episode_run_is_its_last_eval_row(cli, rlctl_app, tmp_path):
    run = tmp_path / "run"
    done = rlctl_app("train", *EPISODE, f"run.dir={run}")
    assert done.returncode == 0, done.stdout + done.stderr
    step, logged = _last_eval_row(run)
    assert step == 2 and {"eval/success_rate", "eval/turns_mean", "eval/reward"} <= set(logged)
    data = _eval_json(cli, run, tmp_path / "eval.json")
    assert data["eval"] == logged
    assert "pass@2" in data["sampled"]
