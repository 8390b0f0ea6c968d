"""Recipes (listing, every shipped one composes) and sweeps (grid, per-cell table)."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlctl.config.compose import compose
from rlctl.errors import ConfigError
from rlctl.config.compose import recipe_files
from rlctl.commands.sweep import expand, summarize

RLCTL = shutil.which("rlctl") or str(Path(sys.executable).parent / "rlctl")
SHIPPED = sorted(recipe_files())


def test_grid_expansion_is_the_cartesian_product():
    jobs = expand(["algo.loss_agg_mode=token-mean,seq-mean-token-mean", "seed=0,1,2", "trainer.steps=5"])
    assert len(jobs) == 6 and all("trainer.steps=5" in j for j in jobs)
    assert {tuple(j) for j in jobs} == {(f"algo.loss_agg_mode={m}", f"seed={s}", "trainer.steps=5")
                                        for m in ("token-mean", "seq-mean-token-mean") for s in range(3)}


def test_summary_mean_and_spread_by_hand():
    runs = [{"cell": "a", "train_seconds": 1.0, "eval_end": {"eval/exact_match": v}} for v in (0.2, 0.4, 0.9)]
    row = summarize(runs)[0]
    assert row["runs"] == 3
    assert row["eval/exact_match"]["mean"] == pytest.approx(0.5)
    # sample std of (0.2, 0.4, 0.9): deviations -0.3, -0.1, 0.4 -> (0.09+0.01+0.16)/2 = 0.13
    assert row["eval/exact_match"]["std"] == pytest.approx(0.13 ** 0.5)


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_recipe_composes(name):
    cfg = compose(["seed=5"], recipe=name).cfg
    assert cfg.seed == 5 and cfg.run.name == name


def test_recipes_differ_in_what_they_say():
    adv = {n: compose([], recipe=n).cfg.algo.advantage for n in ("baseline-raw", "baseline-centred", "baseline-normalised")}
    assert adv == {"baseline-raw": "reinforce", "baseline-centred": "dr_grpo", "baseline-normalised": "grpo"}
    placement = compose([], recipe="kl-in-reward").cfg.algo.kl
    assert placement.placement == "in_reward" and placement.coef > 0


def test_list_recipes_and_unknown_name():
    out = subprocess.run([RLCTL, "recipes"], capture_output=True, text=True)
    assert out.returncode == 0
    for name in SHIPPED:
        line = next(ln for ln in out.stdout.splitlines() if ln.startswith(name + " "))
        assert len(line.split(None, 1)[1]) > 10          # a description
    with pytest.raises(ConfigError, match="recipes: agg-seq-mean-token-mean"):
        compose([], recipe="no-such-recipe")


def test_sweep_through_the_cli(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([RLCTL, "train", "-m", "--recipe", "baseline-raw", "seed=0,1",
                          "algo.group_size=2,4", "trainer.steps=2", "trainer.eval_every=2",
                          "task.num_eval=16", "trainer.prompts_per_step=2", "logger=jsonl",
                          "run.save_model=false", f"run.output_dir={tmp_path}"],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    sweep = next(tmp_path.glob("sweep-*"))
    data = json.loads((sweep / "sweep.json").read_text())
    assert len(data["jobs"]) == 4
    assert sorted(c["cell"] for c in data["cells"]) == ["algo.group_size=2", "algo.group_size=4"]
    assert all(c["runs"] == 2 and c["failed"] == 0 for c in data["cells"])
    assert data["failed"] == 0 and all(j["status"] == "ok" and j["warnings"] == [] for j in data["jobs"])
    for job in data["jobs"]:             # sorting's rewards never fail: every call counted, none failed
        s = json.loads((Path(job["run_dir"]) / "summary.json").read_text())
        G = int(job["cell"].split("=")[1])
        assert (s["reward_calls"], s["reward_errors"], s["reward_timeouts"]) == (2 * 2 * G, 0, 0)
        assert (s["eval_reward_calls"], s["eval_reward_errors"]) == (2 * 16, 0)   # eval at 0 and 2
    assert (sweep / "sweep.png").stat().st_size > 1000 and (sweep / "sweep.md").exists()
    assert len([p for p in sweep.iterdir() if p.is_dir()]) == 4
    assert "sweep dir:" in out.stdout


def test_sweep_validates_every_cell_first(tmp_path):
    with pytest.raises(ConfigError, match="algo.loss_agg_mode"):
        from rlctl.commands.sweep import run_sweep
        run_sweep(["algo.loss_agg_mode=token-mean,bogus", f"run.output_dir={tmp_path}"], None)
    assert not any(tmp_path.iterdir())
