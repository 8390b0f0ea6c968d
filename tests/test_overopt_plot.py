"""bench/overopt_plot.py (docs/rlhf.md, "The RLHF demonstration"): the seed means per window of
steps over finished runs of one or more sweep directories, checked against hand sums."""
import json
import subprocess
import sys
from pathlib import Path

import yaml

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "overopt_plot.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run_dir(sweep: Path, name: str, coef: float, rows, finished=True) -> None:
    run = sweep / name
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"algo": {"kl": {"coef": coef}}}))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if finished:
        (run / "summary.json").write_text("{}")


def _step(step, kl, proxy, gold):
    return {"step": step, "kl/k1": kl, "reward/reward_model": proxy, "reward/exact": gold}


def _plot(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def test_two_sweeps_of_seeds_average_per_window_and_skip_unfinished_runs(tmp_path):
    a, b = tmp_path / "sweep-a", tmp_path / "sweep-b"
    _run_dir(a, "s0", 0.1, [{"step": 0, "eval/exact_match": 0.0},
                            _step(1, 0.2, 1.0, 0.0), _step(2, 0.4, 2.0, 0.5),
                            {"step": 2, "eval/exact_match": 0.25},
                            _step(3, 0.6, 3.0, 1.0), _step(4, 0.8, 4.0, 1.0),
                            {"step": 4, "eval/exact_match": 0.5}])
    _run_dir(b, "s1", 0.1, [_step(s, 0.4, 0.0, 0.0) for s in (1, 2, 3, 4)]
             + [{"step": 2, "eval/exact_match": 0.75}, {"step": 4, "eval/exact_match": 0.5}])
    _run_dir(b, "s2", 0.1, [_step(s, 9.0, 9.0, 9.0) for s in (1, 2, 3, 4)], finished=False)
    out = _plot(a, b, "--window", 2, "--out", tmp_path / "o.png")
    assert out.returncode == 0, out.stderr[-2000:]
    # window 1 (steps 1-2): seed 0 kl 0.3, proxy 1.5, gold 0.25, eval 0.25; seed 1 kl 0.4,
    # proxy 0, gold 0, eval 0.75 -> means 0.35, 0.75, 0.125, 0.5. Window 2 (steps 3-4):
    # seed 0 0.7, 3.5, 1.0, 0.5; seed 1 0.4, 0, 0, 0.5 -> 0.55, 1.75, 0.5, 0.5.
    assert "| 0.1 | 2 | 0.350 | 0.750 | 0.125 | 0.500 |" in out.stdout
    assert "| 0.1 | 4 | 0.550 | 1.750 | 0.500 | 0.500 |" in out.stdout
    assert (tmp_path / "o.png").read_bytes()[:8] == PNG_MAGIC


def test_no_finished_run_is_one_line_naming_the_directories(tmp_path):
    _run_dir(tmp_path / "sweep", "s0", 0.1, [_step(1, 0.1, 0.1, 0.1)], finished=False)
    out = _plot(tmp_path / "sweep", "--out", tmp_path / "o.png")
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == \
        [f"no finished run directories (with summary.json) under {tmp_path / 'sweep'}"]
