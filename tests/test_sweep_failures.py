"""A sweep whose jobs fail, a run whose every reward fails, and the sweep table at 80
columns: through the CLI as a user runs them, plus the pieces in-process."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlctl.commands import sweep
from rlctl.train.run import reward_report

RLCTL = shutil.which("rlctl") or str(Path(sys.executable).parent / "rlctl")

BROKEN_REWARD = '''def broken(prompt, completion, **fields):
    raise ValueError("boom from my reward")
'''
STEPS, PROMPTS, G, EVAL_ROWS = 2, 2, 2, 4
FAST = ["algo=grpo", f"trainer.steps={STEPS}", f"trainer.eval_every={STEPS}",
        f"trainer.prompts_per_step={PROMPTS}", f"algo.group_size={G}", "logger=jsonl",
        "logger.console=false", "run.save_model=false"]
RAISE_SUM = "task.on_reward_error=raise algo.loss_agg_mode=seq-mean-token-sum"
CELLS = [RAISE_SUM, RAISE_SUM + "-norm", "task.on_reward_error=zero algo.loss_agg_mode=seq-mean-token-sum",
         "task.on_reward_error=zero algo.loss_agg_mode=seq-mean-token-sum-norm"]


def _rows(n, offset):
    return [{"prompt": " ".join(str((i * 7 + offset + k * 3) % 10) for k in range(4)) + " ="}
            for i in range(n)]


@pytest.fixture(scope="module")
def failing_sweep(tmp_path_factory):
    """2 x 2 grid over a reward that always raises: the two `raise` jobs fail (first),
    the two `zero` jobs train on all-zero rewards."""
    d = tmp_path_factory.mktemp("sweepfail")
    (d / "my_reward.py").write_text(BROKEN_REWARD)
    for name, rows in (("train.jsonl", _rows(12, 0)), ("eval.jsonl", _rows(EVAL_ROWS, 5))):
        (d / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(d), COLUMNS="80")
    out = subprocess.run(
        [RLCTL, "train", "-m", "task=jsonl", "task.train_path=train.jsonl", "task.eval_path=eval.jsonl",
         "task.reward_fn=my_reward:broken", "task.reward_timeout_s=0",
         "task.on_reward_error=raise,zero",
         "algo.loss_agg_mode=seq-mean-token-sum,seq-mean-token-sum-norm", *FAST,
         f"run.output_dir={d / 'runs'}"],
        capture_output=True, text=True, timeout=600, env=env, cwd=d)
    return out, next((d / "runs").glob("sweep-*"))


def test_failed_jobs_are_named_and_the_sweep_goes_on(failing_sweep):
    out, sweep_dir = failing_sweep
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-3000:]   # both failures: bad input
    assert "Traceback" not in out.stderr + out.stdout
    err = out.stderr.splitlines()
    named = [ln for ln in err if ln.startswith("error: sweep job")]
    assert len(named) == 2
    for line, cell in zip(named, CELLS[:2]):
        assert f"({cell})" in line and "boom from my reward" in line and "going on" in line
    assert err[-1].startswith("error: 2 of 4 sweep jobs failed (") and "sweep.json" in err[-1]
    assert [ln for ln in out.stdout.splitlines() if ln.startswith("[sweep ")] == \
        [f"[sweep {i}/4] {c}" for i, c in enumerate(CELLS, 1)]           # all four ran


def test_sweep_files_mark_the_failed_jobs(failing_sweep):
    _, sweep_dir = failing_sweep
    data = json.loads((sweep_dir / "sweep.json").read_text())
    assert [j["status"] for j in data["jobs"]] == ["failed", "failed", "ok", "ok"]
    assert data["failed"] == 2 and "interrupted" not in data
    for job in data["jobs"][:2]:
        assert "boom from my reward" in job["error"] and job["exit_code"] == 2
    assert [(c["cell"], c["runs"], c["failed"]) for c in data["cells"]] == \
        [(CELLS[0], 0, 1), (CELLS[1], 0, 1), (CELLS[2], 1, 0), (CELLS[3], 1, 0)]
    assert data["cells"][0]["eval/exact_match"]["mean"] is None
    md = (sweep_dir / "sweep.md").read_text()
    assert md.count("| failed |") == 2 and md.count("boom from my reward") == 2


def test_all_failed_rewards_are_said_in_the_summary(failing_sweep):
    out, sweep_dir = failing_sweep
    runs = [json.loads((Path(j["run_dir"]) / "summary.json").read_text())
            for j in json.loads((sweep_dir / "sweep.json").read_text())["jobs"][2:]]
    train_calls = STEPS * PROMPTS * G      # every sample of every step scored once
    eval_calls = 2 * EVAL_ROWS             # eval at step 0 and at the end
    for s in runs:
        assert (s["reward_calls"], s["reward_errors"], s["reward_timeouts"]) == (train_calls, train_calls, 0)
        assert (s["eval_reward_calls"], s["eval_reward_errors"]) == (eval_calls, eval_calls)
        assert len(s["warnings"]) == 2
        assert s["warnings"][0].startswith(f"every training reward call failed ({train_calls} of {train_calls}")
        assert s["warnings"][1].startswith(f"every held-out eval reward call failed ({eval_calls} of")
    printed = [ln for ln in out.stdout.splitlines() if ln.startswith("warning: every training reward")]
    assert len(printed) == 2                                         # one per finished run


def test_table_at_80_columns_keeps_every_cell_whole(failing_sweep):
    out, _ = failing_sweep
    tail = out.stdout[out.stdout.rindex("[sweep 4/4]"):]
    assert "…" not in tail
    # the legend and table fit; lines holding a path or an error are left to the terminal
    # to wrap, so what is pasted from them has no inserted newline
    paths = ("failed:", "sweep dir:", "run dir:")
    assert all(len(ln) <= 80 for ln in tail.splitlines() if not ln.startswith(paths))
    flat = " ".join(tail.split())        # a legend line may wrap between overrides
    for i, cell in enumerate(CELLS, 1):
        assert f"cell {i}: {cell} " in flat
    assert f"failed: {RAISE_SUM}-norm: reward failed" in flat


# ---- in-process pieces ---------------------------------------------------------------

def _row(values, exact, status="ok"):
    cell = " ".join(f"{k}={v}" for k, v in values.items())
    return {"overrides": cell.split(), "job": cell, "cell": cell, "values": values, "status": status,
            "error": "reward failed: boom", "eval_end": {"eval/exact_match": exact} if exact is not None else {},
            "train_seconds": 1.5 if exact is not None else None, "run_dir": None}


def test_short_names_are_the_shortest_unique_suffix():
    assert sweep.short_names(["algo.kl.coef", "trainer.lr", "algo.coef", "seed"]) == \
        {"algo.kl.coef": "kl.coef", "trainer.lr": "lr", "algo.coef": "algo.coef", "seed": "seed"}


def test_table_uses_one_column_per_key_when_it_fits(monkeypatch, capsys, tmp_path):
    keys = ["algo.loss_agg_mode", "algo.kl.coef"]
    rows = [_row({"algo.loss_agg_mode": m, "algo.kl.coef": c}, 0.25)
            for m in ("seq-mean-token-sum", "seq-mean-token-sum-norm") for c in ("0.01", "0.1")]
    monkeypatch.setenv("COLUMNS", "120")
    sweep.print_table(sweep.summarize(rows), tmp_path, keys, rows)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "swept: loss_agg_mode = algo.loss_agg_mode, coef = algo.kl.coef"
    head = next(ln for ln in lines if ln.startswith("loss_agg_mode"))
    assert head.split() == ["loss_agg_mode", "coef", "runs", "exact_match", "reward", "length", "train", "s"]
    body = [ln.split() for ln in lines if ln.startswith("seq-")]
    assert [b[:4] for b in body] == [["seq-mean-token-sum", "0.01", "1", "0.250±0.000"],
                                     ["seq-mean-token-sum", "0.1", "1", "0.250±0.000"],
                                     ["seq-mean-token-sum-norm", "0.01", "1", "0.250±0.000"],
                                     ["seq-mean-token-sum-norm", "0.1", "1", "0.250±0.000"]]
    assert body[0][-1] == "1.5±0.0" and not any("cell 1:" in ln for ln in lines)


def test_ctrl_c_stops_the_sweep_and_keeps_what_finished(monkeypatch, tmp_path):
    calls = []

    def fake_training(overrides, recipe=None, resume=None):
        calls.append(overrides)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return {"run_dir": str(tmp_path / "r1"), "eval_end": {"eval/exact_match": 0.5}, "train_seconds": 1.0}

    monkeypatch.setattr(sweep, "run_training", fake_training)
    with pytest.raises(KeyboardInterrupt):
        sweep.run_sweep(["trainer.lr=0.1,0.2,0.3"], None, output_dir=str(tmp_path))
    assert len(calls) == 2                                        # the third never started
    data = json.loads(next(tmp_path.glob("sweep-*/sweep.json")).read_text())
    assert data["interrupted"] is True and [j["cell"] for j in data["jobs"]] == ["trainer.lr=0.1"]


def test_a_training_fault_fails_the_sweep_with_exit_1_after_the_rest(monkeypatch, tmp_path, capsys):
    from rlctl.errors import TrainingFault
    calls = []

    def fake_training(overrides, recipe=None, resume=None):
        calls.append(overrides)
        if len(calls) == 1:
            raise TrainingFault("stopped at step 3: non-finite loss")
        return {"run_dir": str(tmp_path / "r"), "eval_end": {}, "train_seconds": 1.0}

    monkeypatch.setattr(sweep, "run_training", fake_training)
    with pytest.raises(TrainingFault, match=r"^1 of 2 sweep jobs failed \(trainer.lr=0.1\)"):
        sweep.run_sweep(["trainer.lr=0.1,0.2"], None, output_dir=str(tmp_path))
    assert len(calls) == 2
    err = capsys.readouterr().err
    assert err == ("error: sweep job 1/2 (trainer.lr=0.1) failed: stopped at step 3: non-finite loss; "
                   "going on with the other jobs\n")


def test_reward_report_by_hand():
    assert reward_report((48, 0, 0)) == {
        "reward_calls": 48, "reward_errors": 0, "reward_timeouts": 0, "eval_reward_calls": 0,
        "eval_reward_errors": 0, "eval_reward_timeouts": 0, "warnings": []}
    some = reward_report((10, 1, 2), (4, 0, 0))
    assert some["warnings"] == ["3 of 10 training reward calls failed (1 raised or were not finite, "
                                "2 timed out) and scored 0"]
    every = reward_report((8, 6, 2), (4, 4, 0))["warnings"]
    assert every[0].startswith("every training reward call failed (8 of 8: 6 raised or were not finite, "
                               "2 timed out) and scored 0: the policy was trained on all-zero rewards")
    assert every[1].startswith("every held-out eval reward call failed (4 of 4:")

