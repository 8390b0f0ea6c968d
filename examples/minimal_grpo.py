"""GRPO on the sorting task in one file, on top of `rlctl.core` and the tiny model.

    python examples/minimal_grpo.py --steps 300

Read it top to bottom: load the embedded tiny Llama (built locally, cached), then
repeat: sample G completions for each of B prompts, score them with the sorting
reward, turn the rewards into group-normalised advantages (GRPO, Shao et al., 2024),
and take one AdamW step on the PPO clipped surrogate (Schulman et al., 2017)
averaged per sequence. Held-out greedy exact-match is printed at the start and the end.
The formulas are written out in docs/math.md. What `rlctl train algo=grpo` adds on top
(KL to a reference, minibatches, checkpoints, metrics, multi-process) is left out.

Shape letters: B prompts, G samples per prompt, N = B * G sequences, P prompt tokens,
T completion tokens, V vocabulary.
"""
from __future__ import annotations

import argparse
import random
import time

import torch
import transformers

from rlctl.core import (aggregate, completion_mask, group_advantages, ppo_clip_per_token,
                        token_logprobs)
from rlctl.train.evaluate import evaluate, means
from rlctl.models.loading import load_model_and_tokenizer
from rlctl.models.kv_share import position_ids_from_mask
from rlctl.tasks.scoring import RewardScorer
from rlctl.tasks.sorting import SortingTask, reward_names


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return int(text)


def parse_args() -> tuple[argparse.Namespace, SortingTask]:
    """The options and the sorting task they describe; bad input: one line, exit 2."""
    # usage suppressed: bad input gets one line ("...: error: argument --steps: ...")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], usage=argparse.SUPPRESS)
    p.add_argument("--steps", type=positive, default=300, help="optimizer steps, one rollout each")
    p.add_argument("--prompts", type=positive, default=8, help="B: prompts per step")
    p.add_argument("--group-size", type=positive, default=8, help="G: samples per prompt")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--clip-eps", type=float, default=0.2, help="PPO clip epsilon")
    p.add_argument("--epochs", type=positive, default=1, help="updates per rollout (1: ratio 1)")
    p.add_argument("--max-new-tokens", type=positive, default=8, help="T: completion budget")
    p.add_argument("--reward", default="positional", choices=reward_names())
    p.add_argument("--num-eval", type=positive, default=256, help="held-out prompts")
    p.add_argument("--eval-every", type=int, default=0, help="also evaluate every k steps")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    try:
        task = SortingTask(num_digits=5, reward=args.reward, num_eval=args.num_eval)
    except ValueError as err:                   # e.g. --num-eval above the 99999 tuples
        p.error(f"argument --num-eval: {err}")
    if args.prompts > len(task.train_examples()):
        p.error(f"--prompts {args.prompts} exceeds the {len(task.train_examples())} training prompts")
    return args, task


@torch.no_grad()
def sample_groups(model, tokenizer, prompts, G: int, max_new_tokens: int):
    """G sampled completions per prompt -> (input_ids [N, P+T], attention [N, P+T], P)."""
    enc = tokenizer(prompts, return_tensors="pt", padding=True)       # left-padded [B, P]
    prompt_ids = enc["input_ids"].repeat_interleave(G, dim=0)         # [N, P]
    prompt_attn = enc["attention_mask"].repeat_interleave(G, dim=0)   # [N, P]
    seqs = model.generate(input_ids=prompt_ids, attention_mask=prompt_attn, do_sample=True,
                          temperature=1.0, top_k=0, max_new_tokens=max_new_tokens,
                          pad_token_id=tokenizer.pad_token_id,
                          eos_token_id=tokenizer.eos_token_id)         # [N, P+T]
    return seqs, prompt_attn, prompt_ids.shape[1]


def completion_logprobs(model, seqs, attn, P: int):
    """log pi(completion token t | prompt, tokens < t) -> [N, T] (with gradient)."""
    inputs = seqs[:, :-1]                                             # [N, P+T-1]
    mask = attn[:, :-1]
    logits = model(input_ids=inputs, attention_mask=mask,
                   position_ids=position_ids_from_mask(mask)).logits  # [N, P+T-1, V]
    return token_logprobs(logits[:, P - 1:], seqs[:, P:])             # [N, T]


def main() -> None:
    args, task = parse_args()
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    transformers.utils.logging.disable_progress_bar()
    # the project's default tiny model: 80 warm-up steps teach the answer format only
    model, tokenizer = load_model_and_tokenizer("tiny", warmup_steps=80)
    train, held_out = task.train_examples(), task.eval_examples()
    B, G = args.prompts, args.group_size
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

    def held_out_eval(step: int) -> float:     # rlctl train's eval/* (greedy, one evaluator)
        with RewardScorer(task) as scorer:
            m = means(evaluate(model, tokenizer, held_out, scorer=scorer,
                               max_new_tokens=args.max_new_tokens).sums)
        print(f"step {step:4d}  held-out greedy exact-match {m['exact_match']:.3f}  "
              f"truncated {m['truncated_frac']:.3f}", flush=True)
        return m["exact_match"]

    exact_start = held_out_eval(0)
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        # 1. rollout: B prompts, G samples each, from the current policy (= pi_old)
        batch = rng.sample(train, B)
        model.eval()
        seqs, prompt_attn, P = sample_groups(model, tokenizer, [ex.prompt for ex in batch], G,
                                             args.max_new_tokens)
        completion = seqs[:, P:]                                      # [N, T]
        mask, truncated = completion_mask(completion, tokenizer.eos_token_id)  # [N, T], [N]
        attn = torch.cat([prompt_attn, mask.long()], dim=1)           # [N, P+T]
        # 2. score: one scalar reward per completion (EOS and padding are not text)
        texts = tokenizer.batch_decode(completion, skip_special_tokens=True)
        r = torch.tensor([task.reward(batch[i // G], text) for i, text in enumerate(texts)])
        r = r.view(B, G)                                              # [B, G]
        # 3. advantages: A_i = (r_i - mean(r_group)) / (std(r_group) + eps), one per sequence
        A = group_advantages(r).reshape(-1)                           # [N], broadcast over T
        # 4. old log-probs: pi_old is the policy that sampled; fixed during the update
        model.train()
        with torch.no_grad():
            old_logp = completion_logprobs(model, seqs, attn, P)      # [N, T]
        # 5. update: PPO clipped surrogate, mean over each sequence's tokens, then over rows
        for _ in range(args.epochs):
            logp = completion_logprobs(model, seqs, attn, P)          # [N, T]
            loss_mat, m = ppo_clip_per_token(logp, old_logp, A, mask, args.clip_eps, args.clip_eps)
            loss = aggregate(loss_mat, mask, "seq-mean-token-mean")       # per-token [N, T] -> scalar
            opt.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        if step % 25 == 0 or step == args.steps:  # with --epochs 1 the ratio is 1, so the
            # loss value is -mean(A) = 0 (A sums to 0 in each group); its gradient is not 0
            print(f"step {step:4d}  reward {r.mean():.3f}  loss {loss.item():+.4f}  "
                  f"clip_frac {m['policy/clip_frac']:.3f}  len {mask.sum(-1).mean():.2f}  "
                  f"truncated {truncated.float().mean():.2f}  grad_norm {grad_norm:.3f}  "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)
        if args.eval_every and step % args.eval_every == 0 and step != args.steps:
            held_out_eval(step)
    exact_end = held_out_eval(args.steps)
    print(f"held-out greedy exact-match: start {exact_start:.3f} end {exact_end:.3f} "
          f"({args.steps} steps, {time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
