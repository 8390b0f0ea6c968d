"""Episodes: concurrent environment steps (8 at once vs 1), and the KV cache carried
across turns vs each turn recomputing its context.

    OMP_NUM_THREADS=1 python bench/episodes.py [--sleep 0.2] [--episodes 8] [--turns 3]
        [--kv-prompt 400] [--kv-turns 8] [--kv-obs 24]

Plays ``--episodes`` episodes (4 rows x 2) of ``--turns`` model turns each on a tiny
random-init Llama (2 layers, width 32) with an environment whose ``step`` sleeps
``--sleep`` seconds (a slow tool or remote service), once with
``rollout.episode.concurrency`` = the number of episodes and once with 1, after one
untimed warm-up play. Prints each way's wall time and the
speed-up (issue 23's target: >= 6x with 8 episodes). With concurrency 1 the steps run
one after another: episodes x turns x sleep seconds; with 8, one sleep per turn.

Then the KV cache (``rollout.episode.kv_reuse``): ``--episodes`` episodes of ``--kv-turns``
model turns of 8 tokens on a random-init Llama (4 layers, width 256, context 2048), a
``--kv-prompt``-token first observation and ``--kv-obs`` tokens of observation after each
turn (contexts grow to prompt + turns x (8 + obs) tokens), played with the cache carried
across turns and with each turn recomputing its whole context, after one untimed warm-up
each; the same tokens either way (checked). Prints each way's wall time and the ratio.
"""
from __future__ import annotations

import argparse
import time

import torch

from transformers import LlamaConfig, LlamaForCausalLM

from rlctl.envs.environment import EnvTask
from rlctl.demo.tiny import build_model, build_tokenizer
from rlctl.config.schema import EpisodeConfig, RolloutConfig
from rlctl.rollout.episodes.loop import EpisodePlayer
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
    s = RolloutConfig(max_new_tokens=3, temperature=1.0, episode=EpisodeConfig(
        max_turns=args.turns, max_tokens=200, concurrency=concurrency, step_timeout_s=60.0))
    task = EnvTask("sleepy", lambda: Sleepy(args.sleep, args.turns), rows, rows)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    batch = EpisodePlayer(tok, task, s, args.episodes // len(rows), ()).play(model, rows, seed=0)
    seconds = time.perf_counter() - t0
    assert all(e.turns == args.turns and e.env_errors == 0 for e in batch.episodes.records)
    return seconds


class Chatty:
    """Each step answers ``obs`` tokens of digits; the episode ends after ``turns`` steps."""

    def __init__(self, obs: int, turns: int):
        self.obs, self.turns = obs, turns

    def reset(self, example, seed):
        self.k = 0
        return example.prompt

    def step(self, turn):
        self.k += 1
        return Step(observation=" ".join(str((self.k + j) % 10) for j in range(self.obs)),
                    reward=0.0, done=self.k >= self.turns)


def play_kv(model, tok, args, kv_reuse: bool):
    rows = [Example(" ".join(str((d + j) % 10) for j in range(args.kv_prompt - 1))) for d in range(4)]
    s = RolloutConfig(max_new_tokens=8, temperature=1.0, episode=EpisodeConfig(
        max_turns=args.kv_turns, max_tokens=args.kv_turns * (8 + args.kv_obs),
        max_obs_tokens=args.kv_obs, concurrency=args.episodes, kv_reuse=kv_reuse))
    task = EnvTask("chatty", lambda: Chatty(args.kv_obs, args.kv_turns), rows, rows)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    batch = EpisodePlayer(tok, task, s, args.episodes // len(rows), ()).play(model, rows, seed=0)
    seconds = time.perf_counter() - t0
    assert all(e.turns == args.kv_turns for e in batch.episodes.records)
    return seconds, batch


def bench_kv(tok, args) -> None:
    tok.model_max_length = 2048          # the tiny tokenizer says 64 (its model's context)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=512,
                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
                         max_position_embeddings=2048, pad_token_id=tok.pad_token_id,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    for reuse in (True, False):
        play_kv(model, tok, args, reuse)
    cached, a = play_kv(model, tok, args, True)
    recomputed, b = play_kv(model, tok, args, False)
    assert torch.equal(a.input_ids, b.input_ids), "the cache path drew other tokens"
    width = a.input_ids.shape[1]
    print(f"{args.episodes} episodes x {args.kv_turns} turns of 8 tokens, prompt {args.kv_prompt} "
          f"tokens, {args.kv_obs}-token observations (contexts up to {width} tokens), "
          f"Llama 4 x 256")
    print(f"KV cache across turns: {cached:.3f} s")
    print(f"recompute every turn:  {recomputed:.3f} s")
    print(f"speed-up: {recomputed / cached:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sleep", type=float, default=0.2)
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--kv-prompt", type=int, default=400)
    ap.add_argument("--kv-turns", type=int, default=8)
    ap.add_argument("--kv-obs", type=int, default=24)
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
    bench_kv(tok, args)


if __name__ == "__main__":
    main()
