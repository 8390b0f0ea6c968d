"""The embedded RLHF demonstration: ``task.reward_model=tiny``, the rlhf-sorting recipe
(2 steps here; its learning claim is measured and stated in docs/rlhf.md) and the
proxy-vs-gold figure of `rlctl inspect`."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlctl.commands.inspect.report import proxy_keys
from rlctl.commands.inspect.plots import plot_proxy_gold

RLCTL = str(Path(sys.executable).with_name("rlctl"))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FAST = ["trainer.steps=2", "trainer.eval_every=2", "trainer.prompts_per_step=2",
        "algo.group_size=2", "logger=jsonl", "logger.console=false", "task.num_eval=4"]


def _rlctl(cwd, *args, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline",
               TOKENIZERS_PARALLELISM="false")
    return subprocess.run([RLCTL, *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=timeout)


def _train(tmp_path, name, *overrides, rlctl=_rlctl):
    out = rlctl(tmp_path, "train", "--recipe", "rlhf-sorting", f"run.output_dir={tmp_path}/{name}",
                 *FAST, *overrides)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    run = next((tmp_path / name).iterdir())
    return run, [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]


def test_recipe_with_tiny_equals_the_cached_directory_and_inspect_plots_proxy_vs_gold(tmp_path,
                                                                                     rlctl_app):
    from rlctl.rm.tiny_rm import tiny_reward_model_dir

    def in_process(cwd, *args):          # the same CLI app, without a new interpreter
        return rlctl_app(*args, cwd=cwd)

    run, rows = _train(tmp_path, "tiny")                         # the recipe sets reward_model: tiny
    _, by_path = _train(tmp_path, "path", f"task.reward_model={tiny_reward_model_dir()}",
                        rlctl=in_process)
    steps = [r for r in rows if "reward/mean" in r]
    assert len(steps) == 2
    # same seed, same model: "tiny" is that directory, so every proxy score is identical
    assert [r["reward/reward_model"] for r in steps] == \
        [r["reward/reward_model"] for r in by_path if "reward/mean" in r]
    for r in steps:                                              # the recipe's settings act
        assert "reward/exact" in r and "value/loss" in r and r["kl/coef"] == 0.3
        assert r["reward/mean"] <= 2.0 + 1e-6                   # task.reward_clip=2.0
    assert any("eval/exact_match" in r for r in rows)
    out = in_process(tmp_path, "inspect", run)
    assert out.returncode == 0, out.stderr[-2000:]
    png = run / "inspect_proxy_gold.png"
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert str(png) in out.stdout.replace("\n", "")


def _rows(n=4, proxy=True, gold=True, kl=True):
    rows = []
    for s in range(n):
        row = {"step": s}
        if proxy:
            row["reward/reward_model"] = 0.5 * s
        if gold:
            row["reward/exact"] = 0.1 * s
        if kl:
            row["kl/k1"] = 0.2 * s
        rows.append(row)
    return rows


@pytest.mark.parametrize("kw", [{"proxy": False}, {"gold": False}])
def test_proxy_gold_figure_needs_both_a_proxy_and_a_gold_series(tmp_path, kw):
    path = tmp_path / "p.png"
    assert plot_proxy_gold(_rows(**kw), ["reward/reward_model"], path) is None
    assert not path.exists()


@pytest.mark.parametrize("kl", [True, False])
def test_proxy_gold_figure_is_written_with_or_without_a_kl_series(tmp_path, kl):
    path = tmp_path / "p.png"
    assert plot_proxy_gold(_rows(kl=kl), ["reward/reward_model"], path) == path
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_proxy_keys_follow_the_reward_model_names():
    assert proxy_keys({"task.reward_model": "tiny"}) == ["reward/reward_model", "eval/reward"]
    rewards = [{"fn": "exact", "weight": 0.5}, {"model": "/rm", "name": "rm"}, {"model": "/b"}]
    assert proxy_keys({"task.reward_model": None, "task.rewards": rewards}) == \
        ["reward/rm", "reward/reward_model"]
    assert proxy_keys({"task.reward_model": None, "task.rewards": None}) == []
