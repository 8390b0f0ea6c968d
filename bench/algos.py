"""Every algorithm on the default sorting task for an equal budget; prints a table.

    python bench/algos.py [--steps 300] [--seeds 0] [--algos grpo,ppo,...] [--out bench/algos.md]

Each run is a separate `rlctl train` process (so peak memory is its own), one after the
other (never in parallel: timings on a shared 2-core machine are noisy enough). Columns:
final held-out greedy exact-match, the wall time of training, the step and the time at
which held-out exact-match first reached 0.9 (evaluated every trainer.eval_every steps;
the time includes those evaluations; the step does not depend on the machine's load),
completion tokens per second, and the process's peak RSS.
"""
from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from common import run_rlctl

ALGOS = ["grpo", "dr_grpo", "dapo", "gspo", "cispo", "reinforce", "rloo", "ppo"]


def run_one(algo: str, steps: int, seed: int, out_dir: Path, extra: list[str]) -> dict:
    try:
        summary, rows = run_rlctl([f"algo={algo}", f"trainer.steps={steps}", f"seed={seed}", *extra],
                                  out_dir, f"{algo}-s{seed}")
    except RuntimeError as exc:
        return {"algo": algo, "seed": seed, "error": str(exc)}
    hit = next((r for r in rows if r.get("eval/exact_match", 0) >= 0.9 and r["step"] > 0), None)
    t90 = None if hit is None else hit.get("time/elapsed_s", 0.0)
    return {"algo": algo, "seed": seed, "exact_start": summary["eval_start"]["eval/exact_match"],
            "exact_end": summary["eval_end"]["eval/exact_match"], "train_s": summary["train_seconds"],
            "t90_s": t90, "step90": None if hit is None else hit["step"], "tokens_per_s": summary["tokens_per_s"], "peak_rss_mb": summary["peak_rss_mb"]}


def table(results: list[dict]) -> str:
    head = "| algo | seed | exact start | exact end | train s | step to 0.9 | s to 0.9 | tokens/s | peak RSS MB |"
    lines = [head, "|" + "---|" * 9]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['algo']} | {r['seed']} | error: {r['error']} ||||||")
            continue
        t90 = f"{r['t90_s']:.1f}" if r["t90_s"] is not None else "not reached"
        s90 = str(r["step90"]) if r["step90"] is not None else "-"
        lines.append(f"| {r['algo']} | {r['seed']} | {r['exact_start']:.3f} | {r['exact_end']:.3f} | "
                     f"{r['train_s']:.1f} | {s90} | {t90} | {r['tokens_per_s']:.0f} | {r['peak_rss_mb']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--algos", default=",".join(ALGOS))
    ap.add_argument("--out", default=None, help="also write the table to this file")
    ap.add_argument("extra", nargs="*", help="more overrides for every run")
    args = ap.parse_args()
    results = []
    load0 = os.getloadavg()[0]       # timings on a shared machine: say how busy it was
    with tempfile.TemporaryDirectory() as tmp:
        for algo in args.algos.split(","):
            for seed in [int(s) for s in args.seeds.split(",")]:
                results.append(run_one(algo, args.steps, seed, Path(tmp), args.extra))
                print(table(results[-1:]).splitlines()[-1], flush=True)
    text = table(results) + (f"\n\nload average (1 min) {load0:.2f} at the start, "
                              f"{os.getloadavg()[0]:.2f} at the end")
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
