"""Reward over-optimisation from a sweep (docs/rlhf.md, "The RLHF demonstration").

    python bench/overopt_plot.py runs/sweep-<time> [more sweep dirs] [--out PNG]

Reads every finished run directory of one or more `rlctl train -m --recipe rlhf-sorting
algo.kl.coef=... seed=...` sweeps (several when the seeds were split over sweeps run side
by side), groups the runs by ``algo.kl.coef`` and averages over seeds, per window
of ``--window`` steps (the window's mean of each training-rollout metric, and the held-out
``eval/exact_match`` logged at the window's end):

- KL(pi||ref): ``kl/k1``, the per-token mean of log pi - log ref on the rollouts;
- proxy: ``reward/reward_model``, the reward model's raw score of the rollouts (before the
  recipe's clip);
- gold: ``reward/exact`` (rollouts) and ``eval/exact_match`` (greedy, held-out).

Plots proxy and gold against KL, one curve per coefficient (the picture of Gao et al.,
2023, "Scaling laws for reward model overoptimization"), and prints the table docs/rlhf.md
quotes.
"""
from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Dict, List

import yaml

KL, PROXY, GOLD, EVAL = "kl/k1", "reward/reward_model", "reward/exact", "eval/exact_match"


def read_runs(sweeps: List[Path]) -> Dict[float, List[List[dict]]]:
    """{kl coef: [metric rows of each seed's run]} over every sweep directory."""
    runs: Dict[float, List[List[dict]]] = defaultdict(list)
    done = sorted(p for sweep in sweeps for p in sweep.iterdir()
                  if (p / "summary.json").is_file())                             # finished
    for run in done:
        cfg = yaml.safe_load((run / "config.yaml").read_text())
        lines = (run / "metrics.jsonl").read_text().splitlines()
        rows = [r for r in map(json.loads, filter(None, lines)) if "step" in r]
        runs[float(cfg["algo"]["kl"]["coef"])].append(rows)
    if not runs:
        raise SystemExit("no finished run directories (with summary.json) under "
                         + ", ".join(map(str, sweeps)))
    return dict(sorted(runs.items()))


def windows(rows: List[dict], window: int) -> List[dict]:
    """Per window of steps (w-1)*window+1 .. w*window: the mean of KL, proxy and gold over
    its training steps and the eval/exact_match logged at its last step (None without;
    KL is None at beta=0, where the run keeps no reference model)."""
    out = []
    last = max(r["step"] for r in rows)
    for end in range(window, last + 1, window):
        inside = [r for r in rows if end - window < r["step"] <= end and PROXY in r]
        evals = [r[EVAL] for r in rows if r["step"] == end and EVAL in r]
        means = {k: statistics.fmean(r[k] for r in inside) if all(k in r for r in inside)
                 else None for k in (KL, PROXY, GOLD)}
        out.append({"step": end, **means, EVAL: evals[0] if evals else None})
    return out


def seed_mean(runs: List[List[dict]], window: int) -> List[dict]:
    """Windows averaged over the seeds (the windows all seeds reached)."""
    per_seed = [windows(rows, window) for rows in runs]
    n = min(len(w) for w in per_seed)
    return [{k: w0[k] if k == "step" else statistics.fmean(w[i][k] for w in per_seed)
             if w0[k] is not None else None for k in w0}
            for i, w0 in ((i, per_seed[0][i]) for i in range(n))]


def plot(curves: Dict[float, List[dict]], out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for i, (coef, pts) in enumerate(curves.items()):
        for row, x_key in enumerate((KL, "step")):
            pts_x = [p for p in pts if p[x_key] is not None]
            x = [p[x_key] for p in pts_x]
            if not x:
                continue
            axes[row][0].plot(x, [p[PROXY] for p in pts_x], "o-", color=f"C{i}", ms=3,
                              label=f"beta={coef:g}")
            axes[row][1].plot(x, [p[EVAL] for p in pts_x], "o-", color=f"C{i}", ms=3,
                              label=f"beta={coef:g}")
            axes[row][1].plot(x, [p[GOLD] for p in pts_x], ":", color=f"C{i}", alpha=0.7)
    for row, xlabel in enumerate(("KL(pi||ref) per token (kl/k1, window mean; beta=0 logs none)",
                                  "step")):
        axes[row][0].set_ylabel("proxy: reward-model score (rollouts, raw)")
        axes[row][1].set_ylabel("gold: eval/exact_match (solid), reward/exact (dotted)")
        for ax in axes[row]:
            ax.set_xlabel(xlabel)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle("rlhf-sorting: proxy vs gold, mean over seeds", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)


def table(curves: Dict[float, List[dict]]) -> str:
    lines = ["| beta | step | KL/token | proxy | gold reward/exact | gold eval/exact_match |",
             "|---|---|---|---|---|---|"]
    for coef, pts in curves.items():
        for p in pts:
            ev = "-" if p[EVAL] is None else f"{p[EVAL]:.3f}"
            kl = "-" if p[KL] is None else f"{p[KL]:.3f}"
            lines.append(f"| {coef:g} | {p['step']} | {kl} | {p[PROXY]:.3f} | "
                         f"{p[GOLD]:.3f} | {ev} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweeps", type=Path, nargs="+",
                    help="sweep directories (runs/sweep-<time>)")
    ap.add_argument("--out", type=Path, default=Path("docs/rlhf-overoptimisation.png"))
    ap.add_argument("--window", type=int, default=25, help="steps per point (trainer.eval_every)")
    args = ap.parse_args()
    curves = {c: seed_mean(runs, args.window) for c, runs in read_runs(args.sweeps).items()}
    plot(curves, args.out)
    print(table(curves))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
