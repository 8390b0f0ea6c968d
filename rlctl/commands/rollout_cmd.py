"""`rlctl rollout`: sample G completions for N prompts, score them, write JSONL.

One JSON object per completion (the fields `rlctl inspect FILE.jsonl` audits):

    group           int   prompt index in this file (rows of a group are contiguous)
    sample          int   0..G-1 within the group
    split           str   "train" | "eval"
    prompt_index    int   index of the prompt in the task's split
    prompt          str
    completion      str   decoded counted tokens (the closing stop id and padding dropped)
    token_ids       [int] the counted completion tokens: up to and including the first
                          stop id, or all max_new_tokens tokens of a truncated row
    logprobs        [float] log pi(token) for each of token_ids, from the learner's forward
                          (rlctl.learner.forward.learner_forward) at rollout.temperature,
                          i.e. the sampling distribution; same length as token_ids
    logprob_sum     float
    length          int   == len(token_ids)
    ended_with_eos  bool  token_ids[-1] is a stop id
    truncated       bool  no stop id within max_new_tokens (then length == max_new_tokens)
    max_new_tokens  int
    eos_token_id    int   the tokenizer's EOS
    stop_token_ids  [int] every id that ends a completion: the tokenizer's EOS, the model's
                          generation_config.eos_token_id and rollout.stop_token_ids
    reward          float the configured reward (task.reward; also the training reward).
                          With reward models: their scores as training used them, i.e.
                          normalised with the run's saved statistics (task.reward_norm=
                          running: the newest checkpoint's; never this file's own) and
                          clipped (task.reward_clip)
    reward_raw      float the same total from the reward models' raw scores (only when
                          task.reward_norm or task.reward_clip applies)
    rewards         {design: float} every reward design of the task, and each reward
                          model's raw score under its name (default reward_model)
    correct         bool  task.is_correct (null for a data task scored by reward models
                          alone: it has no gold reward)

Rows are written chunk by chunk (--batch-size sequences per generate call) and flushed,
so N may be large; an interrupted run leaves the complete chunks written so far.

A task played as episodes (``rlctl.envs.base.is_episodic``) writes one row per episode,
every turn with its tokens, mask, behaviour log-probs and reward
(rlctl/commands/rollout_episodes.py lists the fields).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

import torch
from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn,
                           TimeRemainingColumn)

from rlctl.commands.held_out import held_out_scorer
from rlctl.commands.rollout_episodes import EpisodeDump
from rlctl.commands.targets import open_target, task_scores
from rlctl.envs.base import is_episodic
from rlctl.errors import UserError
from rlctl.learner.forward import learner_forward
from rlctl.models.stop_ids import stop_ids
from rlctl.rollout.generate import rollout


@dataclass
class _Plan:
    """What to sample: the prompts and the rollout settings of the composed config."""
    split: str
    examples: list          # the first N prompts of the split
    group: int              # G completions per prompt
    per_chunk: int          # prompts per generate call
    temperature: float
    top_k: int
    max_new: int
    reward_name: str
    eos: int
    stops: tuple            # every stop id (rlctl.models.stop_ids)


def run_rollout(target_arg: Optional[str], overrides: Sequence[str], out: Optional[str],
                prompts: Optional[int] = None, samples: Optional[int] = None,
                split: str = "train", batch_size: int = 256, quiet: bool = False) -> dict:
    _check_options(out, split, prompts, samples, batch_size)
    t0 = time.perf_counter()
    target, cfg, prepared, model, tokenizer, what = open_target(target_arg, overrides)
    task = prepared.task
    plan = _plan(cfg, prepared, tokenizer, split, prompts, samples, batch_size,
                 stop_ids(model, tokenizer))
    episodes = EpisodeDump.of(cfg, tokenizer, task, plan.stops) if is_episodic(task) else None
    path, fh = _open_out(out)
    n_prompts = len(plan.examples)
    err = Console(stderr=True, quiet=quiet)
    err.print(f"rollout: {what}, {n_prompts} {split} prompts x {plan.group} samples "
              f"(temperature {plan.temperature:g}, max_new_tokens {plan.max_new}) -> {path}",
              soft_wrap=True)
    torch.manual_seed(cfg.seed)
    rows = truncated = 0
    reward_sum = 0.0
    scorer, saved = held_out_scorer(prepared, target)
    if saved is not None:
        err.print(saved.note, soft_wrap=True)
    with scorer, fh, Progress("[progress.description]{task.description}", BarColumn(),
                              MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
                              console=err, transient=True) as bar:
        job = bar.add_task("prompts", total=n_prompts)
        for start in range(0, n_prompts, plan.per_chunk):
            chunk = plan.examples[start:start + plan.per_chunk]
            lines = episodes.rows(plan, model, start, chunk) if episodes is not None else \
                _chunk_rows(plan, model, tokenizer, task, scorer, start, chunk)
            for row in lines:
                rows += 1
                truncated += row["truncated"]
                reward_sum += row["reward"]
            fh.write("\n".join(json.dumps(row, allow_nan=False) for row in lines) + "\n")
            fh.flush()
            bar.advance(job, len(chunk))
    summary = {"path": str(path), "rows": rows, "prompts": n_prompts, "samples": plan.group,
               "split": split, "truncated_frac": truncated / max(rows, 1),
               "reward_mean": reward_sum / max(rows, 1),
               "seconds": round(time.perf_counter() - t0, 3)}
    if not quiet:
        what = "episodes" if episodes is not None else "completions"
        print(f"wrote {rows} {what} ({n_prompts} prompts x {plan.group}) to {path}; "
              f"reward/mean {summary['reward_mean']:.4f}, truncated "
              f"{summary['truncated_frac']:.3f}, {summary['seconds']:.1f}s")
    return summary


def _check_options(out, split, prompts, samples, batch_size) -> None:
    if not out:
        raise UserError("rollout needs --out FILE.jsonl")
    if split not in ("train", "eval"):
        raise UserError(f"invalid --split '{split}'; valid: train, eval")
    for name, value in (("--prompts", prompts), ("--samples", samples),
                        ("--batch-size", batch_size)):
        if value is not None and value < 1:
            raise UserError(f"{name} must be >= 1 (got {value})")


def _plan(cfg, prepared, tokenizer, split, prompts, samples, batch_size, stops) -> _Plan:
    examples = list(prepared.train if split == "train" else prepared.eval)
    n_prompts = prompts or int(cfg.trainer.prompts_per_step)
    group = samples or int(cfg.algo.group_size)
    if n_prompts > len(examples):
        raise UserError(f"--prompts {n_prompts} exceeds the {len(examples)} prompts of the "
                        f"{split} split")
    ro = cfg.rollout
    return _Plan(split=split, examples=examples[:n_prompts], group=group,
                 per_chunk=max(1, batch_size // group), temperature=float(ro.temperature),
                 top_k=int(ro.get("top_k", 0) or 0), max_new=int(ro.max_new_tokens),
                 reward_name=str(cfg.task.get("reward", None) or "reward"),
                 eos=int(tokenizer.eos_token_id), stops=tuple(stops))


def _open_out(out: str):
    path = Path(out).expanduser()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return path, path.open("w", encoding="utf-8")
    except OSError as exc:
        raise UserError(f"cannot write '{out}': {exc.strerror or exc}") from None


def _chunk_rows(plan: _Plan, model, tokenizer, task, scorer, start: int, chunk) -> List[dict]:
    """Sample G completions of each prompt in ``chunk``, score them, and return one row
    per completion (group ids count from ``start``)."""
    totals: list = []

    def score(rows, texts):        # keep the exact totals (the batch holds float32)
        totals[:] = scorer.score_batch(rows, texts)
        return totals
    models = [m.name for m in scorer.learned.models] if scorer.learned is not None else []
    g = plan.group
    batch = rollout(model, tokenizer, chunk, g, plan.max_new, plan.temperature, plan.top_k,
                    score, stops=plan.stops)
    per_row = [chunk[i // g] for i in range(len(totals))]
    oks = scorer.correct_batch(per_row, batch.completions, totals)
    with torch.no_grad():
        logp = learner_forward(model, batch.input_ids, batch.attention_mask,
                               batch.prompt_len, plan.temperature,
                               share_prompts=True).logp.float()  # [N, T]
    ids, logp_rows = batch.completion_ids.tolist(), logp.tolist()    # [N, T] lists
    lengths = batch.mask.sum(-1).long().tolist()                     # [N]
    truncated = batch.truncated.tolist()                             # [N]
    rows = []
    for i, text in enumerate(batch.completions):
        n = lengths[i]
        row = _row(plan, task, start + i // g, i % g, chunk[i // g], text, ids[i][:n],
                   logp_rows[i][:n], bool(truncated[i]), totals[i], bool(oks[i]))
        if scorer.shapes:
            row["reward_raw"] = float(scorer.last_raw_totals[i])
        if not scorer.has_gold:          # reward models alone: no gold, no correctness
            row["correct"], row["rewards"] = None, {}
        row["rewards"].update({k: float(scorer.last_components[k][i]) for k in models})
        rows.append(row)
    return rows


def _row(plan: _Plan, task, group: int, sample: int, ex, text: str, token_ids, lps,
         truncated: bool, total: float, correct: bool) -> dict:
    n = len(token_ids)
    return {
        "group": group, "sample": sample, "split": plan.split,
        "prompt_index": group, "prompt": ex.prompt, "completion": text,
        "token_ids": token_ids, "logprobs": [round(v, 6) for v in lps],
        "logprob_sum": round(sum(lps), 6), "length": n,
        "ended_with_eos": bool(n > 0 and token_ids[-1] in plan.stops and not truncated),
        "truncated": truncated,
        "max_new_tokens": plan.max_new, "eos_token_id": plan.eos,
        "stop_token_ids": list(plan.stops),
        "reward": float(total),  # exact, not float32
        "rewards": task_scores(task, ex, text, plan.reward_name, total),
        "correct": correct,
    }
