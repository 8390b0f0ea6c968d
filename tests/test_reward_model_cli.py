"""`rlctl reward-model train` as a user meets it: pairs that carry no preference, the
console's figures, a stop by signal, and reward-model files that cannot be used."""
import json
import os
import random
import subprocess
import sys
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
