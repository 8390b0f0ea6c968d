"""The shipped agent tiny models at step 0: what each warm-up leaves for RL to learn.

    OMP_NUM_THREADS=1 python bench/agent_warmups.py [--tasks calculator,guess_number,running_sum]
        [--cache DIR] [--rows 128]

Builds (or reuses, from ``--cache`` or $RLCTL_CACHE, else the default cache) the agent
model of each task with the shipped settings (rlctl/config/conf/model/tiny.yaml) and plays one
greedy episode on each of the task's first ``--rows`` eval rows with its recipe's budgets
(recipes/calculator-tool.yaml, guess-number.yaml, running-sum.yaml), through the real
episode loop (rlctl.rollout.episodes.loop.EpisodePlayer). Prints per task: success, mean
turns, the share of episodes with a tool call and their tool errors, the share of model
turns that are numbers (digit words) and the share of turns rewarded. These are the
step-0 numbers the recipes start from (the warm-up teaches the format, not the skill):
calculator calls the tool in some episodes and every call parses, direct answers are
wrong; guess_number's guesses are numbers in 1..N, not yet binary search; running_sum
answers numbers, some right. The test suite does not build these models (minutes);
tests/models/test_tiny_agents.py checks the format on small warm-ups.
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from omegaconf import OmegaConf

from rlctl.envs.calc import read_number
from rlctl.models.loading import load_model_and_tokenizer
from rlctl.models.stop_ids import resolve_stop_ids
from rlctl.config.schema import EpisodeConfig, RolloutConfig
from rlctl.rollout.episodes.loop import EpisodePlayer
from rlctl.tasks import build_task
from rlctl.types import MODEL

ROOT = Path(__file__).resolve().parent.parent
RECIPES = {"calculator": "calculator-tool", "guess_number": "guess-number",
           "running_sum": "running-sum"}
TINY_KEYS = ("hidden_size", "num_layers", "num_heads", "warmup_steps", "warmup_lr")


def shipped_tiny() -> dict:
    cfg = OmegaConf.load(ROOT / "rlctl" / "config" / "conf" / "model" / "tiny.yaml")
    return {k: cfg[k] for k in TINY_KEYS}


def settings_of(recipe: str) -> RolloutConfig:
    ro = OmegaConf.load(ROOT / "recipes" / f"{recipe}.yaml").rollout
    return RolloutConfig(max_new_tokens=ro.max_new_tokens, temperature=1.0, episode=EpisodeConfig(
        max_turns=ro.episode.max_turns, max_tokens=ro.episode.max_tokens))


def step0(task_name: str, cache: str, rows: int) -> dict:
    t0 = time.perf_counter()
    model, tok = load_model_and_tokenizer("tiny", warmup_task=task_name, cache_dir=cache,
                                          **shipped_tiny())
    built = time.perf_counter() - t0
    task = build_task(task_name)
    player = EpisodePlayer(tok, task, settings_of(RECIPES[task_name]), 1,
                           resolve_stop_ids(model, tok))
    eps = player.play(model, task.eval_examples()[:rows], 0, greedy=True).episodes.records
    turns = [s for e in eps for s in e.spans if s.role == MODEL]
    called = [e for e in eps if e.tool_calls]
    n = len(eps)
    return {"episodes": n, "success": sum(bool(e.success) for e in eps) / n,
            "turns_mean": sum(e.turns for e in eps) / n, "tool_call_frac": len(called) / n,
            "tool_errors_per_call": sum(e.tool_errors for e in called) / max(1, sum(e.tool_calls for e in called)),
            "number_turn_frac": sum(read_number(s.text) is not None for s in turns) / max(1, len(turns)),
            "rewarded_turn_frac": sum(r > 0 for e in eps for r in e.turn_rewards) / max(1, len(turns)),
            "load_s": round(built, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default=",".join(RECIPES))
    ap.add_argument("--cache", default=os.environ.get("RLCTL_CACHE"))
    ap.add_argument("--rows", type=int, default=128)
    args = ap.parse_args()
    for name in args.tasks.split(","):
        if name not in RECIPES:
            raise SystemExit(f"unknown task '{name}'; valid: {', '.join(RECIPES)}")
        stats = step0(name, args.cache, args.rows)
        print(name + ": " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                      for k, v in stats.items()), flush=True)


if __name__ == "__main__":
    main()
