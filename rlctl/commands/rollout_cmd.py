"""`rlctl rollout`: G scored completions (or episodes) of N prompts, a JSON line each (docs/runs.md)."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import List, Optional, Sequence

import torch
from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn,
                           TimeRemainingColumn)

from rlctl.commands.targets import held_out_scorer, open_target, reward_parts
from rlctl.envs.environment import episode_success, is_episodic
from rlctl.errors import UserError
from rlctl.models.forward import learner_forward
from rlctl.train.metrics import episode_columns
from rlctl.models.stop_ids import stop_ids
from rlctl.rollout.episodes.loop import EpisodePlayer
from rlctl.rollout.generate import rollout
from rlctl.types import DONE, MODEL


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
    ro, stops, per_chunk = cfg.rollout, tuple(stop_ids(model, tokenizer)), max(1, batch_size // group)
    player = EpisodePlayer(tokenizer, task, ro, int(cfg.algo.group_size), stops) \
        if is_episodic(task) else None
    tool_task = player is not None and player.tool_task
    reward_name = str(cfg.task.get("reward", None) or "reward")
    path = Path(out).expanduser()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fh = path.open("w", encoding="utf-8")
    except OSError as exc:
        raise UserError(f"cannot write '{out}': {exc.strerror or exc}") from None
    err = Console(stderr=True, quiet=quiet)
    err.print(f"rollout: {what}, {n_prompts} {split} prompts x {group} samples "
              f"(temperature {float(ro.temperature):g}, max_new_tokens {ro.max_new_tokens}) -> {path}",
              soft_wrap=True)
    torch.manual_seed(cfg.seed)
    rows = truncated = 0
    reward_sum, part_sums = 0.0, {}
    scorer, saved = held_out_scorer(prepared, target)
    if saved is not None:
        err.print(saved.note, soft_wrap=True)
    with scorer, fh, Progress("[progress.description]{task.description}", BarColumn(),
                              MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
                              console=err, transient=True) as bar:
        job = bar.add_task("prompts", total=n_prompts)
        for start in range(0, n_prompts, per_chunk):
            chunk = examples[start:min(start + per_chunk, n_prompts)]
            lines = _episode_rows(player, tool_task, model, split, group, int(cfg.seed), start, chunk) \
                if player is not None else \
                _chunk_rows(model, tokenizer, task, scorer, ro, stops, split, group, reward_name, start, chunk)
            for row in lines:
                rows += 1
                truncated += row["truncated"]
                reward_sum += row["reward"]
                for k, v in row.get("rewards", {}).items():
                    part_sums[f"reward/{k}"] = part_sums.get(f"reward/{k}", 0.0) + v
            fh.write("\n".join(json.dumps(row, allow_nan=False) for row in lines) + "\n")
            fh.flush()
            bar.advance(job, len(chunk))
    summary = {"path": str(path), "rows": rows, "prompts": n_prompts, "samples": group,
               "split": split, "truncated_frac": truncated / max(rows, 1),
               "reward_mean": reward_sum / max(rows, 1),
               "rewards": {k: v / max(rows, 1) for k, v in sorted(part_sums.items())},
               "seconds": round(time.perf_counter() - t0, 3)}
    if not quiet:
        what = "episodes" if player is not None else "completions"
        print(f"wrote {rows} {what} ({n_prompts} prompts x {group}) to {path}; "
              f"reward/mean {summary['reward_mean']:.4f}, "
              + "".join(f"{k} {v:.4f}, " for k, v in summary["rewards"].items()) + "truncated "
              f"{summary['truncated_frac']:.3f}, {summary['seconds']:.1f}s")
    return summary


def _chunk_rows(model, tokenizer, task, scorer, ro, stops, split: str, g: int, reward_name: str,
                start: int, chunk) -> List[dict]:
    """One row per completion of ``g`` sampled for each prompt in ``chunk``, scored."""
    totals: list = []

    def score(rows, texts):        # keep the exact totals (the batch holds float32)
        totals[:] = scorer.score_batch(rows, texts)
        return totals
    max_new = int(ro.max_new_tokens)
    batch = rollout(model, tokenizer, chunk, g, max_new, float(ro.temperature), int(ro.get("top_k", 0) or 0),
                    score, stops=stops)
    per_row = [chunk[i // g] for i in range(len(totals))]
    oks = scorer.correct_batch(per_row, batch.completions, totals)
    with torch.no_grad():
        logp = learner_forward(model, batch.input_ids, batch.attention_mask,
                               batch.prompt_len, float(ro.temperature),
                               share_prompts=True).logp.float()  # [N, T]
    ids, logp_rows = batch.completion_ids.tolist(), logp.tolist()    # [N, T] lists
    lengths = batch.mask.sum(-1).long().tolist()                     # [N]
    truncated = batch.truncated.tolist()                             # [N]
    rows = []
    for i, text in enumerate(batch.completions):
        ex, n, trunc = chunk[i // g], lengths[i], bool(truncated[i])
        tok, lps = ids[i][:n], logp_rows[i][:n]
        row = {"group": start + i // g, "sample": i % g, "split": split,
               "prompt_index": start + i // g, "prompt": ex.prompt, "completion": text,
               "token_ids": tok, "logprobs": [round(v, 6) for v in lps],
               "logprob_sum": round(sum(lps), 6), "length": len(tok),
               "ended_with_eos": bool(tok and tok[-1] in stops and not trunc),
               "truncated": trunc, "max_new_tokens": max_new, "eos_token_id": int(tokenizer.eos_token_id),
               "stop_token_ids": list(stops), "reward": float(totals[i]),  # exact, not float32
               "rewards": reward_parts(task, scorer, i, ex, text, reward_name, float(totals[i])),
               "correct": bool(oks[i])}
        if scorer.shapes:
            row["reward_raw"] = float(scorer.last_raw_totals[i])
        if not scorer.has_gold:          # reward models alone: no gold, no correctness
            row["correct"] = None
        rows.append(row)
    return rows


def _episode_rows(player: EpisodePlayer, tool_task: bool, model, split: str, g: int, seed: int,
                  start: int, chunk) -> List[dict]:
    """``g`` episodes of each prompt in ``chunk`` (environment seed ``seed`` + its index), a row each."""
    ro, s = player.rollout, player.episode
    batch = player.play(model, chunk, seed + start, group_size=g)
    widths = batch.attention_mask[:, batch.prompt_len:].sum(-1).tolist()  # [N] transcripts
    ids, masks = batch.completion_ids.tolist(), batch.mask.long().tolist()
    logps, rewards = batch.logprobs.old.double().tolist(), batch.rewards.double().tolist()
    out = []
    for i, e in enumerate(batch.episodes.records):
        n = int(widths[i])
        mask = masks[i][:n]
        lps = [round(v, 6) if m else 0.0 for v, m in zip(logps[i][:n], mask)]
        row = {"group": start + i // g, "sample": i % g, "split": split,
               "prompt_index": start + i // g, "prompt": chunk[i // g].prompt,
               "completion": batch.completions[i], "token_ids": ids[i][:n], "mask": mask,
               "logprobs": lps, "logprob_sum": round(sum(lps), 6), "length": sum(mask),
               "transcript_length": len(ids[i][:n]), "max_new_tokens": ro.max_new_tokens,
               "max_turns": s.max_turns, "max_tokens": s.max_tokens,
               "eos_token_id": int(player.tokenizer.eos_token_id),
               "stop_token_ids": list(player.stops), "truncated": e.status != DONE,
               "reward": rewards[i], "turn_rewards": list(e.turn_rewards),
               "turn_reward": s.turn_reward, "correct": episode_success(e),
               **episode_columns(e, tool_task)}       # the sample tables' columns
        row["turns"] = [
            {**turn, "start": x.start, "end": x.end, "token_ids": ids[i][x.start:x.end],
             "logprobs": [round(v, 6) for v in logps[i][x.start:x.end]] if x.role == MODEL
             else []}
            for turn, x in zip(row["turns"], e.spans)]
        out.append(row)
    return out
