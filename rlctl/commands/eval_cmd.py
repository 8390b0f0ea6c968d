"""`rlctl eval`: held-out metrics of a run, a checkpoint, an adapter or the starting model.

On the task's eval split:
    greedy   exact_match, reward (the configured design) and reward/<design> for every
             design the task defines (sorting: exact, positional, inclusion_order),
             length_mean (tokens, EOS included), truncated_frac (no EOS within
             rollout.max_new_tokens), well_formed (tasks that define a format)
    sampled  the same over k = --samples completions per prompt at rollout.temperature
             (the behaviour policy of training), plus pass@j for j = 1, 2, 4, ..., k from
             the unbiased estimator (rlctl.commands.passk).
The greedy numbers match `eval/*` of `rlctl train` for the same model and config.

With reward models (``task.reward_model``, ``{model: ...}`` entries), ``reward`` is the
training reward as the run used it, the table's label says which: the reward models'
scores normalised with the run's *saved* statistics (``task.reward_norm=running``: the
newest checkpoint's, never the evaluated batch's own) and clipped (``task.reward_clip``);
``reward_raw`` the same total from the raw scores, and ``reward/<model name>`` each model's
raw score, beside the task's own designs (the gold reward).
"""
from __future__ import annotations

import re
import time
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch
from omegaconf import OmegaConf
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
from rich.table import Table

from rlctl.commands.eval_episodes import episode_splits
from rlctl.commands.files import write_json
from rlctl.commands.held_out import held_out_scorer, reward_label
from rlctl.commands.passk import mean_pass_at_k, report_ks
from rlctl.commands.targets import open_target, task_scores
from rlctl.core.logprobs import completion_mask
from rlctl.envs.base import is_episodic
from rlctl.errors import UserError
from rlctl.models.stop_ids import stop_ids
from rlctl.rollout.generate import decode_completions, generate

# The first metrics of each column (then reward/<design>, well_formed, pass@k).
METRIC_KEYS = ("exact_match", "reward", "length_mean", "truncated_frac")


def score_split(model, tokenizer, task, examples, samples: int, do_sample: bool,
                temperature: float, top_k: int, max_new_tokens: int, batch_size: int,
                reward_name: str, scorer, on_chunk=None) -> Dict[str, float]:
    """Mean metrics over ``samples`` completions of each example, plus pass@k."""
    well_formed = getattr(task, "is_well_formed", None)
    sums: Dict[str, float] = defaultdict(float)
    correct_counts: List[int] = []
    per_chunk = max(1, batch_size // samples)
    stops = stop_ids(model, tokenizer)     # open_target resolved rollout.stop_token_ids
    for start in range(0, len(examples), per_chunk):
        chunk = examples[start:start + per_chunk]
        prompts = [ex.prompt for ex in chunk for _ in range(samples)]   # N = B*k, grouped
        with torch.no_grad():
            seqs, _, plen = generate(model, tokenizer, prompts, max_new_tokens, do_sample=do_sample,
                                     temperature=temperature, top_k=top_k, stops=stops)
        mask, truncated = completion_mask(seqs[:, plen:], stops)         # [N, T], [N]
        texts = decode_completions(tokenizer, seqs[:, plen:], mask, stops)
        sums["length_mean"] += mask.sum().item()
        sums["truncated_frac"] += truncated.float().sum().item()
        counts = [0] * len(chunk)
        per_row = [chunk[i // samples] for i in range(len(texts))]
        rewards = scorer.score_batch(per_row, texts)         # user code: under the time limit
        raw, learned = scorer.last_raw_totals, learned_names(scorer)
        oks = scorer.correct_batch(per_row, texts, rewards)
        for i, text in enumerate(texts):
            ex, ok = per_row[i], bool(oks[i])
            counts[i // samples] += ok
            sums["exact_match"] += ok
            sums["reward"] += float(rewards[i])
            if scorer.shapes:
                sums["reward_raw"] += float(raw[i])
            for name in learned:                               # each model's raw score
                sums[f"reward/{name}"] += scorer.last_components[name][i]
            designs = task_scores(task, ex, text, reward_name, rewards[i]) if scorer.has_gold else {}
            for design, value in designs.items():
                sums[f"reward/{design}"] += value
            if callable(well_formed):
                sums["well_formed"] += bool(well_formed(ex, text))
        correct_counts.extend(counts)
        if on_chunk is not None:
            on_chunk(len(chunk))
    total = max(len(examples) * samples, 1)
    if not scorer.has_gold:          # reward models alone: no gold reward to report
        sums.pop("exact_match", None)
    keys = [k for k in METRIC_KEYS if scorer.has_gold or k != "exact_match"]
    metrics = {k: sums.get(k, 0.0) / total for k in keys}
    metrics.update({k: v / total for k, v in sorted(sums.items()) if k not in metrics})
    if do_sample and scorer.has_gold:
        for k in report_ks(samples):
            metrics[f"pass@{k}"] = mean_pass_at_k(samples, correct_counts, k)
    return metrics


def _completion_splits(cfg, model, tokenizer, task, examples, samples: int, batch_size: int,
                       reward_name: str, scorer, err):
    """(greedy metrics, sampled metrics) of single completions (``score_split``)."""
    ro = cfg.rollout
    top_k = int(ro.get("top_k", 0) or 0)
    common = dict(max_new_tokens=ro.max_new_tokens, batch_size=batch_size,
                  reward_name=reward_name, scorer=scorer)
    with scorer, Progress("[progress.description]{task.description}", BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn(), console=err, transient=True) as bar:
        g = bar.add_task("greedy", total=len(examples))
        greedy = score_split(model, tokenizer, task, examples, 1, False, 1.0, 0,
                             on_chunk=lambda n: bar.advance(g, n), **common)
        s = bar.add_task("sampled", total=len(examples))
        torch.manual_seed(cfg.seed)
        sampled = score_split(model, tokenizer, task, examples, samples, True, ro.temperature,
                              top_k, on_chunk=lambda n: bar.advance(s, n), **common)
    return greedy, sampled


def default_out(target, cfg) -> Path:
    if target.kind in ("run", "model", "adapter"):
        return target.path / "eval.json"
    label = cfg.model.name_or_path or cfg.model.name
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", str(label)).strip("-.") or "model"
    return Path.cwd() / f"eval-{slug}.json"


def run_eval(target_arg: Optional[str], overrides: Sequence[str], samples: int = 1,
             out: Optional[str] = None, batch_size: int = 256, quiet: bool = False) -> dict:
    if samples < 1:
        raise UserError(f"--samples must be >= 1 (got {samples})")
    if batch_size < 1:
        raise UserError(f"--batch-size must be >= 1 (got {batch_size})")
    t0 = time.perf_counter()
    target, cfg, prepared, model, tokenizer, what = open_target(target_arg, overrides)
    task, examples = prepared.task, list(prepared.eval)
    if not examples:
        raise UserError("the task's eval split is empty; set task.num_eval=N")
    reward_name = str(cfg.task.get("reward", None) or "reward")
    ro = cfg.rollout
    top_k = int(ro.get("top_k", 0) or 0)

    err = Console(stderr=True, quiet=quiet)
    err.print(f"evaluating {what} on {len(examples)} held-out prompts "
              f"(greedy, and {samples} sample(s) at temperature {ro.temperature})", soft_wrap=True)
    scorer, saved = held_out_scorer(prepared, target)
    if saved is not None:
        err.print(saved.note, soft_wrap=True)
    if is_episodic(task):          # played as episodes: success, turns, tool calls
        scorer.close()            # the environments give the rewards: nothing to score
        greedy, sampled = episode_splits(cfg, model, tokenizer, task, examples, samples, batch_size)
    else:
        greedy, sampled = _completion_splits(cfg, model, tokenizer, task, examples, samples,
                                             batch_size, reward_name, scorer, err)
    result = {
        "target": None if target.path is None else str(target.path),
        "target_kind": target.kind, "model": what,
        "run_dir": None if target.run_dir is None else str(target.run_dir),
        "task": OmegaConf.to_container(cfg.task), "reward_name": reward_name, "split": "eval",
        "reward_label": reward_label(scorer, reward_name, saved),
        "reward_models": learned_names(scorer),
        "reward_norm": None if saved is None else {"checkpoint": saved.checkpoint,
                                                   "step": saved.step, "note": saved.note},
        "num_prompts": len(examples), "samples": samples, "temperature": float(ro.temperature),
        "top_k": top_k, "max_new_tokens": int(ro.max_new_tokens), "seed": int(cfg.seed),
        "stop_token_ids": list(stop_ids(model, tokenizer)),
        "overrides": list(overrides), "greedy": greedy, "sampled": sampled,
        "seconds": round(time.perf_counter() - t0, 3),
    }
    path = write_json(Path(out) if out else default_out(target, cfg), result)
    result["path"] = str(path)
    if not quiet:
        print_eval(result)
    return result


def learned_names(scorer) -> List[str]:
    """The reward models' names (their raw scores are the components reward/<name>)."""
    return [m.name for m in scorer.learned.models] if scorer.learned is not None else []


def row_label(key: str, result: dict) -> str:
    if key == "reward":
        return f"reward ({result.get('reward_label') or result['reward_name']})"
    if key == "reward_raw":
        return "reward_raw (from the reward models' raw scores)"
    models = result.get("reward_models") or []
    if key.startswith("reward/") and key[len("reward/"):] in models:
        return f"{key} (reward model, raw score)"
    return key


def print_eval(result: dict) -> None:
    greedy, sampled = result["greedy"], result["sampled"]
    table = Table(title=f"rlctl eval: {result['model']}")
    table.add_column("metric")
    table.add_column("greedy", justify="right")
    table.add_column(f"sampled (n={result['samples']}, T={result['temperature']:g})",
                     justify="right")
    keys = list(greedy) + [k for k in sampled if k not in greedy]
    for key in keys:
        fmt = lambda d: "" if key not in d else f"{d[key]:.4f}"  # noqa: E731
        table.add_row(row_label(key, result), fmt(greedy), fmt(sampled))
    console = Console()
    console.print(table)
    console.print(f"{result['num_prompts']} prompts (split {result['split']}); "
                  f"wrote {result['path']}", soft_wrap=True)
