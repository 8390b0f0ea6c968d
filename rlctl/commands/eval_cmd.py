"""`rlctl eval`: greedy and sampled held-out metrics, every reward design and pass@j."""
from __future__ import annotations

import re
import time
from collections import defaultdict
from pathlib import Path
from typing import List, Optional, Sequence

import torch
from omegaconf import OmegaConf
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
from rich.table import Table

from rlctl.commands.files import write_json
from rlctl.commands.targets import (held_out_scorer, learned_names, open_target, reward_label,
                                   reward_parts)
from rlctl.envs.environment import is_episodic
from rlctl.errors import UserError
from rlctl.train.evaluate import EPISODE_KEYS, evaluate, means
from rlctl.models.stop_ids import stop_ids
from rlctl.rollout.episodes.loop import EpisodePlayer

# The first metrics of each column (then reward/<design>, well_formed, pass@k).
METRIC_KEYS = ("exact_match", "reward", "length_mean", "truncated_frac")


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt with c of n samples correct (Chen et al. 2021,
    eq. 1, in the stable form of Fig. 3): 1 - C(n-c, k) / C(n, k)
    = 1 - prod_{i=n-c+1}^{n} (1 - k / i)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:          # every k-subset holds a correct sample
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def mean_pass_at_k(n: int, correct_counts: Sequence[int], k: int) -> float:
    """Mean over prompts of pass@k, each prompt having n samples."""
    if not correct_counts:
        return 0.0
    return sum(pass_at_k(n, c, k) for c in correct_counts) / len(correct_counts)


def report_ks(n: int) -> List[int]:
    """The k reported for n samples: 1, 2, 4, ... below n, and n."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def _extras(task, scorer, cfg):
    """The chunk's sums of every named reward (``reward_parts``) and well_formed."""
    name, well_formed = str(cfg.task.get("reward", None) or "reward"), getattr(task, "is_well_formed", None)

    def extra(rows, texts, rewards):
        sums = defaultdict(float)
        for i, (ex, text) in enumerate(zip(rows, texts)):
            for k, value in reward_parts(task, scorer, i, ex, text, name, rewards[i]).items():
                sums[f"reward/{k}"] += value
            if callable(well_formed):
                sums["well_formed"] += bool(well_formed(ex, text))
        return sums
    return extra


def run_eval(target_arg: Optional[str], overrides: Sequence[str], samples: int = 1,
             out: Optional[str] = None, batch_size: Optional[int] = None,
             quiet: bool = False) -> dict:
    if samples < 1:
        raise UserError(f"--samples must be >= 1 (got {samples})")
    if batch_size is not None and batch_size < 1:
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
    player = None                                   # open_target resolved the stop ids
    if is_episodic(task):
        player = EpisodePlayer(tokenizer, task, cfg.rollout, int(cfg.algo.group_size),
                               stop_ids(model, tokenizer))
    common = dict(scorer=scorer, player=player, max_new_tokens=int(ro.max_new_tokens),
                  batch_size=batch_size, extra=None if player else _extras(task, scorer, cfg))
    with scorer, Progress("[progress.description]{task.description}", BarColumn(),
                          MofNCompleteColumn(), TimeElapsedColumn(), console=err,
                          transient=True) as bar:
        g = bar.add_task("greedy", total=len(examples))
        greedy = evaluate(model, tokenizer, examples, on_chunk=lambda n: bar.advance(g, n),
                          **common)
        s = bar.add_task("sampled", total=len(examples))
        torch.manual_seed(cfg.seed)
        sampled = evaluate(model, tokenizer, examples, greedy=False, samples=samples,
                           temperature=float(ro.temperature), top_k=top_k, seed=int(cfg.seed),
                           on_chunk=lambda n: bar.advance(s, n), **common)
    cols = []    # the first metrics, then the rest sorted (reward/<design>, well_formed, pass@k)
    for ev in (greedy, sampled):
        metrics = means({**ev.sums, **ev.extra})
        keys = EPISODE_KEYS if player is not None else METRIC_KEYS
        first = {k: metrics[k] for k in keys if k in metrics}
        cols.append({**first, **{k: v for k, v in sorted(metrics.items()) if k not in first}})
    if player is not None or scorer.has_gold:
        for k in report_ks(samples):
            cols[1][f"pass@{k}"] = mean_pass_at_k(samples, sampled.correct, k)
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
        "overrides": list(overrides), "greedy": cols[0], "sampled": cols[1],
        "eval": {f"eval/{k}": v for k, v in means(greedy.sums).items()},   # as the trainer logs
        "seconds": round(time.perf_counter() - t0, 3),
    }
    if not out and target.kind == "config":
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", str(cfg.model.name_or_path or cfg.model.name))
        out = Path.cwd() / f"eval-{slug.strip('-.') or 'model'}.json"
    path = write_json(Path(out) if out else target.path / "eval.json", result)
    result["path"] = str(path)
    if not quiet:
        print_eval(result)
    return result


def print_eval(result: dict) -> None:
    greedy, sampled = result["greedy"], result["sampled"]
    table = Table(title=f"rlctl eval: {result['model']}")
    table.add_column("metric")
    table.add_column("greedy", justify="right")
    table.add_column(f"sampled (n={result['samples']}, T={result['temperature']:g})",
                     justify="right")
    models = result.get("reward_models") or []
    for key in list(greedy) + [k for k in sampled if k not in greedy]:
        label = key
        if key == "reward":
            label = f"reward ({result.get('reward_label') or result['reward_name']})"
        elif key == "reward_raw":
            label = "reward_raw (from the reward models' raw scores)"
        elif key.startswith("reward/") and key[len("reward/"):] in models:
            label = f"{key} (reward model, raw score)"
        table.add_row(label, *("" if key not in d else f"{d[key]:.4f}" for d in (greedy, sampled)))
    console = Console()
    console.print(table)
    console.print(f"{result['num_prompts']} prompts (split {result['split']}); "
                  f"wrote {result['path']}", soft_wrap=True)
