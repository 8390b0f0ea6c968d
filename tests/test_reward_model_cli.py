"""`rlctl reward-model train` as a user meets it: pairs that carry no preference, the
console's figures, a stop by signal, and reward-model files that cannot be used."""
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

RLCTL = str(Path(sys.executable).parent / "rlctl")
QUIET = ["logger=jsonl", "logger.console=false"]


def sorted_pairs(n: int, seed: int):
    """chosen: the prompt's digits sorted; rejected: the same sorted digits reversed."""
    rng = random.Random(seed)
    rows = []
    while len(rows) < n:
        d = [rng.randrange(10) for _ in range(5)]
        if len(set(d)) < 2:
            continue
        s = sorted(d)
        rows.append({"prompt": " ".join(map(str, d)) + " =", "chosen": " ".join(map(str, s)),
                     "rejected": " ".join(map(str, reversed(s)))})
    return rows


def same(rows):
    return [dict(r, rejected=r["chosen"]) for r in rows]


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def invoke(*args):
    from rlctl.cli import app

    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


def error_line(res) -> str:
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.exit_code == 2 and len(lines) == 1, (res.exit_code, res.stdout, res.stderr)
    assert lines[0].startswith("error: ") and "Traceback" not in res.stderr
    return lines[0]


# -- pairs with chosen == rejected (issue 21.7) -------------------------------------------

def test_all_pairs_identical_is_refused_before_a_run_directory(tmp_path):
    prefs = write_jsonl(tmp_path / "same.jsonl", same(sorted_pairs(10, 0)))
    held = write_jsonl(tmp_path / "held.jsonl", sorted_pairs(4, 1))
    res = invoke("reward-model", "train", prefs, "--eval", held, *QUIET,
                 f"run.output_dir={tmp_path / 'runs'}")
    line = error_line(res)
    assert "all 10 training pairs have chosen and rejected reading as the same tokens" in line
    assert not (tmp_path / "runs").exists()


def test_some_identical_pairs_are_counted_in_one_line_and_the_summary(tmp_path):
    # 8 real pairs + 2 identical ones to train on; 3 real + 1 identical held out
    prefs = write_jsonl(tmp_path / "p.jsonl", sorted_pairs(8, 0) + same(sorted_pairs(2, 2)))
    held = write_jsonl(tmp_path / "h.jsonl", sorted_pairs(3, 1) + same(sorted_pairs(1, 3)))
    res = invoke("reward-model", "train", prefs, "--eval", held, *QUIET, "rm.steps=1",
                 f"run.output_dir={tmp_path / 'runs'}")
    assert res.exit_code == 0, res.stdout + res.stderr
    notes = [ln for ln in res.stderr.splitlines() if "chosen == rejected" in ln]
    assert len(notes) == 1, res.stderr
    assert "2 of 10 training pairs and 1 of 4 held-out pairs (--eval)" in notes[0]
    (run_dir,) = (tmp_path / "runs").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["train_pairs_identical"] == 2 and summary["eval_pairs_identical"] == 1


# -- what the console shows, and a stop by signal (issue 21.13) ----------------------------

def test_console_shows_the_fits_loss_and_accuracy_at_each_step_and_at_the_end(tmp_path):
    prefs = write_jsonl(tmp_path / "p.jsonl", sorted_pairs(12, 0))
    held = write_jsonl(tmp_path / "h.jsonl", sorted_pairs(4, 1))
    res = invoke("reward-model", "train", prefs, "--eval", held, "logger=jsonl",
                 "logger.console=true", "rm.steps=2", "rm.batch_size=4",
                 f"run.output_dir={tmp_path / 'runs'}")
    assert res.exit_code == 0, res.stdout + res.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r for r in rows if "step" in r}
    lines = res.stdout.splitlines()
    for step in (1, 2):     # off a TTY: one plain line per step (2 steps <= 20 lines)
        (line,) = [ln for ln in lines if ln.startswith(f"step {step}/2 ")]
        m = by_step[step]
        assert f"train/loss {m['train/loss']:.4g}" in line, line
        assert f"train/accuracy {m['train/accuracy']:.4g}" in line, line
    assert f"eval/pairwise_accuracy {by_step[2]['eval/pairwise_accuracy']:.4g}" in lines[1]
    summary = json.loads((run_dir / "summary.json").read_text())
    (end,) = [ln for ln in lines if ln.startswith("held-out pairwise accuracy")]
    assert end == (f"held-out pairwise accuracy {summary['eval/pairwise_accuracy']:.4f} (4 pairs, "
                   f"mean margin {summary['eval/margin']:+.4f}); last training step: loss "
                   f"{by_step[2]['train/loss']:.4f}, accuracy {by_step[2]['train/accuracy']:.4f}")


@pytest.mark.parametrize("signum,code", [(15, 143), (2, 130)])
def test_a_signal_stops_the_fit_after_a_step_with_the_model_saved(tmp_path, signum, code):
    from transformers import AutoModelForSequenceClassification

    prefs = write_jsonl(tmp_path / "p.jsonl", sorted_pairs(20, 0))
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline")
    proc = subprocess.Popen([RLCTL, "reward-model", "train", prefs, *QUIET, "rm.steps=100000",
                             "rm.eval_every=0", "rm.batch_size=2",
                             f"run.output_dir={tmp_path / 'runs'}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob("runs/*/metrics.jsonl")) or \
                not list(tmp_path.glob("runs/*/metrics.jsonl"))[0].read_text().strip():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, err
    (run_dir,) = (tmp_path / "runs").iterdir()
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = max(r["step"] for r in rows if "step" in r)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_at_step"] == last and 1 <= last < 100000
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines[-1] == (f"interrupted by {'SIGTERM' if signum == 15 else 'SIGINT'} after step "
                         f"{last} of 100000; the model so far is saved in {run_dir / 'model'} "
                         f"(summary.json: stopped_at_step {last}; a reward-model fit does not "
                         "resume)"), err
    assert "Traceback" not in err
    model = AutoModelForSequenceClassification.from_pretrained(run_dir / "model")
    assert model.config.num_labels == 1
