"""The reports of `rlctl inspect` on run directories (as dicts; --json writes them).

One run: the config keys that differ from its command's defaults, a metric summary
(first / last / min / max, and best for the metrics where higher is better) and curves
written as ``<run>/inspect_*.png``.
Several runs: the config keys whose values differ (key x run), the metric summary side
by side and overlaid curves ``inspect_compare_*.png`` in the output directory.
RL runs and reward-model runs summarise their own metrics; mixed, both kinds'.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from rlctl.commands.fmt import MISSING
from rlctl.commands.plots import (PLOTS, REWARD_MODEL_PLOTS, plot_compare, plot_proxy_gold,
                                  plot_run, series)
from rlctl.commands.run_record import Run, default_config, load_run
from rlctl.errors import UserError

SUMMARY_KEYS = ("reward/mean", "eval/exact_match", "eval/reward", "policy/kl_ref",
                "policy/approx_kl", "policy/clip_frac", "policy/entropy", "length/mean",
                "length/truncated_frac", "reward/frac_zero_std_groups")
# a run of `rlctl reward-model train` (its config has rm.* keys)
REWARD_MODEL_SUMMARY_KEYS = ("train/loss", "train/accuracy", "eval/pairwise_accuracy",
                             "eval/margin", "eval/chosen_mean", "eval/rejected_mean",
                             "optim/grad_norm")
HIGHER_IS_BETTER = ("reward/mean", "eval/exact_match", "eval/reward", "train/accuracy",
                    "eval/pairwise_accuracy", "eval/margin")


def kinds_of(runs: Sequence[Run]):
    """(summary keys, plots) for runs of one kind, or both kinds' when they are mixed."""
    rm = {r.reward_model for r in runs}
    keys = (SUMMARY_KEYS if False in rm else ()) + (REWARD_MODEL_SUMMARY_KEYS if True in rm else ())
    plots = (PLOTS if False in rm else ()) + (REWARD_MODEL_PLOTS if True in rm else ())
    return keys, plots


def config_diff(configs: Sequence[Dict[str, Any]]) -> Dict[str, List[Any]]:
    """Keys whose values differ between the configs (MISSING where a key is absent)."""
    keys = sorted(set().union(*configs))
    diff = {}
    for key in keys:
        values = [c.get(key, MISSING) for c in configs]
        if any(_differs(values[0], v) for v in values[1:]):
            diff[key] = values
    return diff


def _differs(a, b) -> bool:
    if a is MISSING or b is MISSING:
        return a is not b
    if isinstance(a, bool) or isinstance(b, bool):
        return a is not b
    return a != b


def metric_summary(rows: Sequence[dict], keys: Sequence[str] = SUMMARY_KEYS
                   ) -> Dict[str, Optional[dict]]:
    out: Dict[str, Optional[dict]] = {}
    for key in keys:
        xs, ys = series(rows, key)
        if not xs:
            out[key] = None
            continue
        entry = {"n": len(ys), "first": ys[0], "last": ys[-1], "min": min(ys), "max": max(ys),
                 "best": None, "best_step": None}
        if key in HIGHER_IS_BETTER:
            i = max(range(len(ys)), key=ys.__getitem__)
            entry["best"], entry["best_step"] = ys[i], xs[i]
        out[key] = entry
    return out


def _ensure_dir(path: Path) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot write to '{path}': {exc.strerror or exc}") from None
    return path


def inspect_run(path: Path, out_dir: Optional[Path], plots: bool) -> dict:
    run = load_run(path)
    defaults = default_config(run.reward_model)
    keys, plot_set = kinds_of([run])
    diff = config_diff([defaults, run.config])
    # keys the run's config lacks were added to the schema after the run: not a choice
    newer = sorted(k for k, v in diff.items() if v[1] is MISSING)
    report = {"kind": "run", "run_dir": str(path), "reward_model_run": run.reward_model,
              "metrics_source": run.metrics_source,
              "steps": len({r["step"] for r in run.rows}),
              "overrides": run.overrides.get("overrides", []),
              "choices": run.overrides.get("choices", {}),
              "config_diff": {k: {"default": v[0], "run": v[1]} for k, v in diff.items()
                              if v[1] is not MISSING},
              "keys_not_in_run": newer,
              "metrics": metric_summary(run.rows, keys), "plots": [], "plots_skipped": []}
    if plots and run.rows:
        written, skipped = plot_run(run.rows, _ensure_dir(out_dir or path), plots=plot_set)
        extra = None if run.reward_model else plot_proxy_gold(
            run.rows, proxy_keys(run.config), (out_dir or path) / "inspect_proxy_gold.png")
        report["plots"], report["plots_skipped"] = [str(p) for p in written + [extra] if p], skipped
    return report


def proxy_keys(config: Dict[str, Any]) -> List[str]:
    """The metrics of a run's reward-model scores: ``reward/<name>`` (name defaults to
    ``reward_model``, as rlctl.reward_models.learned names it: the raw score), and the
    held-out ``eval/reward`` (after task.reward_norm/reward_clip) when ``task.reward_model``
    alone trains."""
    if config.get("task.reward_model"):
        return ["reward/reward_model", "eval/reward"]
    entries = [e for e in config.get("task.rewards") or [] if isinstance(e, dict) and "model" in e]
    return [f"reward/{e.get('name') or 'reward_model'}" for e in entries]


def _labels(paths: Sequence[Path]) -> List[str]:
    names = [p.name for p in paths]
    if len(set(names)) == len(names):
        return names
    return [str(p) for p in paths]


def compare_runs(paths: Sequence[Path], out_dir: Path, plots: bool) -> dict:
    runs = [load_run(p) for p in paths]
    labels = _labels(paths)
    keys, plot_set = kinds_of(runs)
    diff = config_diff([r.config for r in runs])
    partial = sorted(k for k, v in diff.items() if any(x is MISSING for x in v))
    report = {"kind": "compare", "runs": labels, "run_dirs": [str(p) for p in paths],
              "config_diff": {k: dict(zip(labels, v)) for k, v in diff.items()
                              if k not in partial},
              "keys_not_in_every_run": {k: [lb for lb, x in zip(labels, diff[k])
                                            if x is not MISSING] for k in partial},
              "mixed_kinds": len({r.reward_model for r in runs}) > 1,
              "summary_keys": list(keys),
              "metrics": {label: metric_summary(r.rows, keys) for label, r in zip(labels, runs)},
              "plots": [], "plots_skipped": []}
    if plots and any(r.rows for r in runs):
        written, skipped = plot_compare({lb: r.rows for lb, r in zip(labels, runs)},
                                        _ensure_dir(out_dir), plots=plot_set)
        report["plots"], report["plots_skipped"] = [str(p) for p in written], skipped
    return report
