"""`rlctl rollout`: G scored completions (or episodes) of N prompts, one JSON line each
(docs/runs.md), flushed per chunk; log-probs from the learner's forward at rollout.temperature."""
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

from rlctl.commands.targets import held_out_scorer, learned_names, open_target, task_scores
from rlctl.envs.environment import is_episodic
from rlctl.errors import UserError
from rlctl.train.evaluate import episode_success
from rlctl.models.forward import learner_forward
from rlctl.train.metrics import episode_columns, offers_tools
from rlctl.models.stop_ids import stop_ids
from rlctl.rollout.episodes.loop import EpisodePlayer
from rlctl.rollout.generate import rollout
from rlctl.types import DONE, MODEL


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
    seed: int
    player: Optional[EpisodePlayer] = None      # a task played as episodes
    tool_task: bool = False


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
    target, cfg, prepared, model, tokenizer, what = open_target(target_arg, overrides)
    task = prepared.task
    examples = list(prepared.train if split == "train" else prepared.eval)
    n_prompts = prompts or int(cfg.trainer.prompts_per_step)
    group = samples or int(cfg.algo.group_size)
    if n_prompts > len(examples):
        raise UserError(f"--prompts {n_prompts} exceeds the {len(examples)} prompts of the "
                        f"{split} split")
    ro = cfg.rollout
    plan = _Plan(split=split, examples=examples[:n_prompts], group=group,
                 per_chunk=max(1, batch_size // group), temperature=float(ro.temperature),
                 top_k=int(ro.get("top_k", 0) or 0), max_new=int(ro.max_new_tokens),
                 reward_name=str(cfg.task.get("reward", None) or "reward"),
                 eos=int(tokenizer.eos_token_id), stops=tuple(stop_ids(model, tokenizer)),
                 seed=int(cfg.seed))
    if is_episodic(task):
        plan.player = EpisodePlayer(tokenizer, task, cfg.rollout, int(cfg.algo.group_size),
                                    plan.stops)
        plan.tool_task = offers_tools(task)
    path = Path(out).expanduser()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fh = path.open("w", encoding="utf-8")
    except OSError as exc:
        raise UserError(f"cannot write '{out}': {exc.strerror or exc}") from None
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
            lines = _episode_rows(plan, model, start, chunk) if plan.player is not None else \
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
        what = "episodes" if plan.player is not None else "completions"
        print(f"wrote {rows} {what} ({n_prompts} prompts x {plan.group}) to {path}; "
              f"reward/mean {summary['reward_mean']:.4f}, truncated "
              f"{summary['truncated_frac']:.3f}, {summary['seconds']:.1f}s")
    return summary


def _chunk_rows(plan: _Plan, model, tokenizer, task, scorer, start: int, chunk) -> List[dict]:
    """Sample G completions of each prompt in ``chunk``, score them, and return one row
    per completion (group ids count from ``start``)."""
    totals: list = []

    def score(rows, texts):        # keep the exact totals (the batch holds float32)
        totals[:] = scorer.score_batch(rows, texts)
        return totals
    models = learned_names(scorer)
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
        ex, n, trunc = chunk[i // g], lengths[i], bool(truncated[i])
        tok, lps = ids[i][:n], logp_rows[i][:n]
        row = {"group": start + i // g, "sample": i % g, "split": plan.split,
               "prompt_index": start + i // g, "prompt": ex.prompt, "completion": text,
               "token_ids": tok, "logprobs": [round(v, 6) for v in lps],
               "logprob_sum": round(sum(lps), 6), "length": len(tok),
               "ended_with_eos": bool(tok and tok[-1] in plan.stops and not trunc),
               "truncated": trunc, "max_new_tokens": plan.max_new, "eos_token_id": plan.eos,
               "stop_token_ids": list(plan.stops), "reward": float(totals[i]),  # exact, not float32
               "rewards": task_scores(task, ex, text, plan.reward_name, totals[i]),
               "correct": bool(oks[i])}
        if scorer.shapes:
            row["reward_raw"] = float(scorer.last_raw_totals[i])
        if not scorer.has_gold:          # reward models alone: no gold, no correctness
            row["correct"], row["rewards"] = None, {}
        row["rewards"].update({k: float(scorer.last_components[k][i]) for k in models})
        rows.append(row)
    return rows


def _episode_rows(plan: _Plan, model, start: int, chunk) -> List[dict]:
    """G episodes of each prompt in ``chunk`` (the G of a prompt share its environment seed,
    ``seed`` + the prompt's index in the file), one row each."""
    g, ro, s = plan.group, plan.player.rollout, plan.player.episode
    batch = plan.player.play(model, chunk, plan.seed + start, group_size=g)
    widths = batch.attention_mask[:, batch.prompt_len:].sum(-1).tolist()  # [N] transcripts
    ids, masks = batch.completion_ids.tolist(), batch.mask.long().tolist()
    logps, rewards = batch.logprobs.old.double().tolist(), batch.rewards.double().tolist()
    out = []
    for i, e in enumerate(batch.episodes.records):
        n = int(widths[i])
        mask = masks[i][:n]
        lps = [round(v, 6) if m else 0.0 for v, m in zip(logps[i][:n], mask)]
        row = {"group": start + i // g, "sample": i % g, "split": plan.split,
               "prompt_index": start + i // g, "prompt": chunk[i // g].prompt,
               "completion": batch.completions[i], "token_ids": ids[i][:n], "mask": mask,
               "logprobs": lps, "logprob_sum": round(sum(lps), 6), "length": sum(mask),
               "transcript_length": len(ids[i][:n]), "max_new_tokens": ro.max_new_tokens,
               "max_turns": s.max_turns, "max_tokens": s.max_tokens, "eos_token_id": plan.eos,
               "stop_token_ids": list(plan.stops), "truncated": e.status != DONE,
               "reward": rewards[i], "turn_rewards": list(e.turn_rewards),
               "turn_reward": s.turn_reward, "correct": episode_success(e, rewards[i]),
               **episode_columns(e, plan.tool_task)}       # the sample tables' columns
        row["turns"] = [
            {**turn, "start": x.start, "end": x.end, "token_ids": ids[i][x.start:x.end],
             "logprobs": [round(v, 6) for v in logps[i][x.start:x.end]] if x.role == MODEL
             else []}
            for turn, x in zip(row["turns"], e.spans)]
        out.append(row)
    return out
