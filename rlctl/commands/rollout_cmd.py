"""`rlctl rollout`: sample G completions for N prompts, score them, write JSONL.

One JSON object per completion (the fields `rlctl inspect FILE.jsonl` audits):

    group           int   prompt index in this file (rows of a group are contiguous)
    sample          int   0..G-1 within the group
    split           str   "train" | "eval"
    prompt_index    int   index of the prompt in the task's split
    prompt          str
    completion      str   decoded counted tokens (EOS and padding dropped)
    token_ids       [int] the counted completion tokens: up to and including the first
                          EOS, or all max_new_tokens tokens of a truncated row
    logprobs        [float] log pi(token) for each of token_ids, from the learner's forward
                          (rlctl.engine.policy.learner_forward) at rollout.temperature,
                          i.e. the sampling distribution; same length as token_ids
    logprob_sum     float
    length          int   == len(token_ids)
    ended_with_eos  bool  token_ids[-1] is EOS
    truncated       bool  no EOS within max_new_tokens (then length == max_new_tokens)
    max_new_tokens  int
    eos_token_id    int
    reward          float the configured reward (task.reward; also the training reward)
    rewards         {design: float} every reward design of the task
    correct         bool  task.is_correct

Rows are written chunk by chunk (--batch-size sequences per generate call) and flushed,
so N may be large; an interrupted run leaves the complete chunks written so far.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional, Sequence

from rlctl.commands.targets import (open_target, task_scores)
from rlctl.errors import UserError

def run_rollout(target_arg: Optional[str], overrides: Sequence[str], out: Optional[str],
                prompts: Optional[int] = None, samples: Optional[int] = None,
                split: str = "train", batch_size: int = 256, quiet: bool = False) -> dict:
    if not out:
        raise UserError("rollout needs --out FILE.jsonl")
    if split not in ("train", "eval"):
        raise UserError(f"invalid --split '{split}'; valid: train, eval")
    for name, value in (("--prompts", prompts), ("--samples", samples),
                        ("--batch-size", batch_size)):
        if value is not None and value < 1:
            raise UserError(f"{name} must be >= 1 (got {value})")
    t0 = time.perf_counter()
    target, cfg, task, model, tokenizer, what = open_target(target_arg, overrides)
    import torch

    from rlctl.engine.policy import learner_forward
    from rlctl.rollout.generate import rollout

    examples = task.train_examples() if split == "train" else task.eval_examples()
    n_prompts = prompts or int(cfg.trainer.prompts_per_step)
    group = samples or int(cfg.algo.group_size)
    if n_prompts > len(examples):
        raise UserError(f"--prompts {n_prompts} exceeds the {len(examples)} prompts of the "
                        f"{split} split")
    examples = examples[:n_prompts]
    ro = cfg.rollout
    temperature, top_k, max_new = float(ro.temperature), int(ro.get("top_k", 0) or 0), \
        int(ro.max_new_tokens)
    reward_name = str(cfg.task.get("reward", None) or "reward")
    eos = int(tokenizer.eos_token_id)
    path = Path(out).expanduser()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fh = path.open("w", encoding="utf-8")
    except OSError as exc:
        raise UserError(f"cannot write '{out}': {exc.strerror or exc}") from None

    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn,
                               TimeRemainingColumn)

    err = Console(stderr=True, quiet=quiet)
    err.print(f"rollout: {what}, {n_prompts} {split} prompts x {group} samples "
              f"(temperature {temperature:g}, max_new_tokens {max_new}) -> {path}", soft_wrap=True)
    torch.manual_seed(cfg.seed)
    per_chunk = max(1, batch_size // group)
    rows = truncated = 0
    reward_sum = 0.0
    from rlctl.tasks.scoring import RewardScorer
    scorer = RewardScorer(task)
    totals: list = []

    def score(rows, texts):        # keep the exact totals (the batch holds float32)
        totals[:] = scorer.score_batch(rows, texts)
        return totals
    with scorer, fh, Progress("[progress.description]{task.description}", BarColumn(),
                      MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
                      console=err, transient=True) as bar:
        job = bar.add_task("prompts", total=n_prompts)
        for start in range(0, n_prompts, per_chunk):
            chunk = examples[start:start + per_chunk]
            batch = rollout(model, tokenizer, chunk, group, max_new, temperature, top_k, score)
            per_row = [chunk[i // group] for i in range(len(totals))]
            oks = scorer.correct_batch(per_row, batch.completions, totals)
            with torch.no_grad():
                logp = learner_forward(model, batch.input_ids, batch.attention_mask,
                                       batch.prompt_len, temperature,
                                       share_prompts=True).logp.float()  # [N, T]
            ids = batch.completion_ids.tolist()
            lengths = batch.mask.sum(-1).long().tolist()
            logp_rows = logp.tolist()
            lines = []
            for i, text in enumerate(batch.completions):
                b, n = i // group, lengths[i]
                ex = chunk[b]
                token_ids, lps = ids[i][:n], logp_rows[i][:n]
                row = {
                    "group": start + b, "sample": i % group, "split": split,
                    "prompt_index": start + b, "prompt": ex.prompt, "completion": text,
                    "token_ids": token_ids, "logprobs": [round(v, 6) for v in lps],
                    "logprob_sum": round(sum(lps), 6), "length": n,
                    "ended_with_eos": bool(n > 0 and token_ids[-1] == eos
                                           and not batch.truncated[i].item()),
                    "truncated": bool(batch.truncated[i].item()),
                    "max_new_tokens": max_new, "eos_token_id": eos,
                    "reward": float(totals[i]),  # exact, not float32
                    "rewards": task_scores(task, ex, text, reward_name, totals[i]),
                    "correct": bool(oks[i]),
                }
                rows += 1
                truncated += row["truncated"]
                reward_sum += row["reward"]
                lines.append(json.dumps(row, allow_nan=False))
            fh.write("\n".join(lines) + "\n")
            fh.flush()
            bar.advance(job, len(chunk))
    summary = {"path": str(path), "rows": rows, "prompts": n_prompts, "samples": group,
               "split": split, "truncated_frac": truncated / max(rows, 1),
               "reward_mean": reward_sum / max(rows, 1),
               "seconds": round(time.perf_counter() - t0, 3)}
    if not quiet:
        print(f"wrote {rows} completions ({n_prompts} prompts x {group}) to {path}; "
              f"reward/mean {summary['reward_mean']:.4f}, truncated "
              f"{summary['truncated_frac']:.3f}, {summary['seconds']:.1f}s")
    return summary
