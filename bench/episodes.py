"""Concurrent environment steps: episodes whose every step sleeps, 8 at once vs 1.

    OMP_NUM_THREADS=1 python bench/episodes.py [--sleep 0.2] [--episodes 8] [--turns 3]

Plays ``--episodes`` episodes (4 rows x 2) of ``--turns`` model turns each on a tiny
random-init Llama (2 layers, width 32) with an environment whose ``step`` sleeps
``--sleep`` seconds (a slow tool or remote service), once with
``rollout.episode.concurrency`` = the number of episodes and once with 1, after one
untimed warm-up play. Prints each way's wall time and the
speed-up (issue 23's target: >= 6x with 8 episodes). With concurrency 1 the steps run
one after another: episodes x turns x sleep seconds; with 8, one sleep per turn.
"""
from __future__ import annotations

import argparse
import time

import torch

from rlctl.envs.base import EnvTask
from rlctl.models.tiny import build_model, build_tokenizer
from rlctl.rollout.episodes import EpisodePlayer, EpisodeSettings
from rlctl.types import Example, Step


class Sleepy:
    """Each step sleeps, then answers '1 +'; the episode ends after ``turns`` steps."""

    def __init__(self, sleep: float, turns: int):
        self.sleep, self.turns = sleep, turns

    def reset(self, example, seed):
        self.k = 0
        return example.prompt

    def step(self, turn):
        time.sleep(self.sleep)
        self.k += 1
        return Step(observation="1 +", reward=0.0, done=self.k >= self.turns)


def play(model, tok, rows, args, concurrency: int) -> float:
    s = EpisodeSettings(group_size=args.episodes // len(rows), max_new_tokens=3, temperature=1.0,
                        max_turns=args.turns, max_tokens=200, concurrency=concurrency,
                        step_timeout_s=60.0)
    task = EnvTask("sleepy", lambda: Sleepy(args.sleep, args.turns), rows, rows)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    batch = EpisodePlayer(tok, task, s, ()).play(model, rows, seed=0)
    seconds = time.perf_counter() - t0
    assert all(e.turns == args.turns and e.env_errors == 0 for e in batch.episodes)
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sleep", type=float, default=0.2)
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = build_tokenizer()
    model = build_model(tok, hidden_size=32, num_layers=2, num_heads=4, seed=0).eval()
    rows = [Example(f"{d} +") for d in range(1, 5)]
    play(model, tok, rows, argparse.Namespace(**{**vars(args), "sleep": 0.0}), args.episodes)
    many = play(model, tok, rows, args, args.episodes)
    one = play(model, tok, rows, args, 1)
    print(f"{args.episodes} episodes x {args.turns} turns, each step sleeping {args.sleep:g} s")
    print(f"concurrency {args.episodes}: {many:.3f} s  (ideal {args.turns * args.sleep:.3f} s of steps)")
    print(f"concurrency 1: {one:.3f} s  (ideal {args.episodes * args.turns * args.sleep:.3f} s of steps)")
    print(f"speed-up: {one / many:.2f}x")


if __name__ == "__main__":
    main()
