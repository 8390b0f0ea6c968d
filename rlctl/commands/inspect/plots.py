"""Training curves as PNG files (matplotlib, Agg); series a run did not log are left out."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

# (file stem, title, series; the first present series is the one overlaid across runs)
PLOTS: Tuple[Tuple[str, str, Tuple[str, ...]], ...] = (
    ("reward", "Reward (train rollouts; eval = greedy, held-out)", ("reward/mean", "eval/reward")),
    ("pairs", "Preference pairs: chosen-beats-rejected accuracy, implicit reward margin",
     ("rewards/accuracy", "rewards/margins")),
    ("eval_exact_match", "Held-out exact match (greedy)", ("eval/exact_match",)),
    ("kl", "KL: policy vs reference (kl_ref), vs rollout policy (approx_kl)",
     ("policy/kl_ref", "policy/approx_kl")),
    ("clip_frac", "PPO ratio clip fraction", ("policy/clip_frac", "policy/clip_frac_low",
                                              "policy/clip_frac_high")),
    ("entropy", "Policy entropy (nats/token)", ("policy/entropy",)),
    ("length", "Completion length (tokens); dashed: truncated fraction",
     ("length/mean", "length/truncated_frac")),
)
# `rlctl reward-model train` runs: the Bradley-Terry fit's figures (rlctl/rm/fit.py)
REWARD_MODEL_PLOTS: Tuple[Tuple[str, str, Tuple[str, ...]], ...] = (
    ("rm_loss", "Bradley-Terry loss (train batches)", ("train/loss", "train/bt_loss")),
    ("rm_accuracy", "Pairwise accuracy (train batches; eval = held-out pairs)",
     ("eval/pairwise_accuracy", "train/accuracy")),
    ("rm_margin", "Mean r_chosen - r_rejected (train batches; eval = held-out)",
     ("eval/margin", "train/margin")),
)
BANDS = {"reward/mean": ("reward/std",), "length/mean": ("length/min", "length/max")}
BAND_LABELS = {"reward/mean": "reward/mean (band: +- std)",
               "length/mean": "length/mean (band: min..max)"}


def series(rows: Sequence[dict], key: str) -> Tuple[List[float], List[float]]:
    """(steps, values) of one metric; rows without it or with null are skipped."""
    xs, ys = [], []
    for row in rows:
        value = row.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            xs.append(row["step"])
            ys.append(float(value))
    return xs, ys


def pyplot():
    # matplotlib is optional and slow to import (about a second): only when plotting
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _band(ax, rows, key, color):
    extra = BANDS.get(key)
    if not extra:
        return
    xs, ys = series(rows, key)
    if len(extra) == 1:  # mean +- std
        sx, sd = series(rows, extra[0])
        lo, hi = [y - s for y, s in zip(ys, sd)], [y + s for y, s in zip(ys, sd)]
        aligned = sx == xs
    else:
        (lx, lo), (hx, hi) = series(rows, extra[0]), series(rows, extra[1])
        aligned = lx == hx == xs
    if aligned and xs and all(math.isfinite(v) for v in lo + hi):
        ax.fill_between(xs, lo, hi, color=color, alpha=0.15, linewidth=0)


def plot_curves(runs: Dict[str, Sequence[dict]], out_dir: Path, plots=PLOTS,
                compare: bool = False) -> Tuple[List[Path], List[str]]:
    """(written, skipped) ``inspect_<stem>.png`` files of one run, or ``inspect_compare_<stem>.png``."""
    plt = pyplot()
    written, skipped = [], []
    for stem, title, keys in plots:
        present = [k for k in keys if any(series(rows, k)[0] for rows in runs.values())]
        if not present:
            skipped.append(stem)
            continue
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        twin = None
        if compare:
            title = present[0]
            for i, (label, rows) in enumerate(runs.items()):
                xs, ys = series(rows, title)
                if xs:
                    ax.plot(xs, ys, color=f"C{i % 10}", markersize=3, label=label,
                            marker="o" if title.startswith("eval/") else None)
        else:
            (rows,) = runs.values()
            for i, key in enumerate(present):
                xs, ys = series(rows, key)
                if key == "length/truncated_frac":
                    twin = twin or ax.twinx()
                    twin.plot(xs, ys, "--", color=f"C{i}", label=key)
                    twin.set_ylabel("truncated fraction")
                    twin.set_ylim(0, 1)
                    continue
                ax.plot(xs, ys, color=f"C{i}", marker="o" if key.startswith("eval/") else None,
                        markersize=3, label=BAND_LABELS.get(key, key))
                _band(ax, rows, key, f"C{i}")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        if twin is not None:
            h2, l2 = twin.get_legend_handles_labels()
            handles, labels = handles + h2, labels + l2
        ax.legend(handles, labels, fontsize=7 if compare else 8)
        prefix = "inspect_compare_" if compare else "inspect_"
        written.append(_save(plt, fig, out_dir / f"{prefix}{stem}.png"))
    return written, skipped


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


GOLD_KEYS = ("reward/exact", "eval/exact_match")   # the task's own check, logged beside a proxy
KL_KEYS = ("kl/k1", "policy/kl_ref")


def plot_proxy_gold(rows: Sequence[dict], proxy_keys: Sequence[str], path: Path):
    """Proxy and gold reward over steps and against KL(pi||ref), or None without both."""
    proxies = [k for k in proxy_keys if series(rows, k)[0]]
    golds = [k for k in GOLD_KEYS if series(rows, k)[0]]
    if not proxies or not golds:
        return None
    kl_key = next((k for k in KL_KEYS if series(rows, k)[0]), None)
    plt = pyplot()
    fig, axes = plt.subplots(1, 2 if kl_key else 1, figsize=(11 if kl_key else 6.4, 4.0),
                             squeeze=False)
    _proxy_gold_axes(axes[0][0], rows, proxies, golds, "step", lambda r: r["step"], True)
    if kl_key:
        kl_at = {r["step"]: r[kl_key] for r in rows if isinstance(r.get(kl_key), (int, float))}
        _proxy_gold_axes(axes[0][1], [r for r in rows if r["step"] in kl_at], proxies, golds,
                         f"{kl_key} (KL(pi||ref) per token)", lambda r: kl_at[r["step"]], False)
    fig.suptitle("Proxy (reward model) vs gold (task's own check)", fontsize=10)
    return _save(plt, fig, path)


def _proxy_gold_axes(ax, rows, proxies, golds, xlabel, x_of, lines: bool) -> None:
    """Proxy series on the left axis, gold on the right; points only when x is the noisy KL."""
    twin = ax.twinx()
    for i, (axis, keys) in enumerate(((ax, proxies), (twin, golds))):
        for j, key in enumerate(keys):
            pts = sorted((x_of(r), float(r[key])) for r in rows
                         if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool))
            marker = "o" if key.startswith("eval/") else "" if lines else "."
            style = marker + ("-" if lines else "")
            axis.plot([p[0] for p in pts], [p[1] for p in pts], style, markersize=3,
                      color=f"C{2 * i + j}", label=key, alpha=0.9)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("proxy score")
    twin.set_ylabel("gold (fraction correct)")
    twin.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = twin.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=7)
