"""Generation off the learner, side by side in one run: local engine processes (a pipe)
against one and two `rlctl serve` processes on loopback (HTTP), and the synchronous loop.

    python bench/engines.py [--steps 300] [--out bench/engines.md]

Each row is one `rlctl train algo=grpo task=sorting` run on the embedded tiny model
(the default config, eval off: 8 prompts x 8 samples = 64 rows a step, which
``rollout.server.chunk_size=64`` sends as one request, so a second server only helps
when requests are smaller). steps/s is measured over the steps after the first 5
(``time/elapsed_s``: start-up, the servers' included, is left out); "wait" is the
learner's mean wait for a rollout per step; "sync" the mean weight-push time per step
(``time/weight_sync_s``: the push happens in the request's worker thread, beside the update).
Runs are sequential; on a 2-core machine the learner, its engines or servers and their
reward workers share the cores, so the ratios, not the absolute figures, carry over.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Dict, List

from common import markdown, run_rlctl

SKIP = 5
ASYNC = ["trainer.async_rollout.enabled=true"]
LAYOUTS = [
    ("synchronous (learner samples)", []),
    ("1 local engine, staleness 1", ASYNC + ["trainer.async_rollout.num_actors=1"]),
    ("2 local engines, staleness 1", ASYNC + ["trainer.async_rollout.num_actors=2"]),
    ("1 server, staleness 0", ["rollout.engine=server", "rollout.server.num_local=1"]),
    ("1 server, staleness 1", ASYNC + ["rollout.engine=server", "rollout.server.num_local=1"]),
    ("2 servers, staleness 1", ASYNC + ["rollout.engine=server", "rollout.server.num_local=2"]),
    ("2 servers, staleness 1, requests of 32 rows", ASYNC + [
        "rollout.engine=server", "rollout.server.num_local=2", "rollout.server.chunk_size=32"]),
]


def _rate(rows: List[Dict]) -> Dict[str, float]:
    later = [r for r in rows if r["step"] > SKIP]
    start = next(r for r in rows if r["step"] == SKIP)["time/elapsed_s"]
    n = len(later)
    return {"steps/s": n / (later[-1]["time/elapsed_s"] - start),
            "wait": sum(r.get("time/learner_wait_s", 0.0) for r in later) / n,
            "sync": sum(r.get("time/weight_sync_s", 0.0) for r in later) / n,
            "reward": sum(r["reward/mean"] for r in later[-5:]) / len(later[-5:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    common = ["algo=grpo", "task=sorting", f"trainer.steps={args.steps}", "trainer.eval_every=0",
              "trainer.checkpoint_every=0"]
    header = ["layout", "steps/s", "vs sync", "learner wait ms/step", "weight push ms/step",
              "reward (last 5)"]
    table, base = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, extra) in enumerate(LAYOUTS):
            try:
                _, rows = run_rlctl(common + extra, Path(tmp), f"e{i}")
            except RuntimeError as exc:
                table.append([label, f"error: {exc}", "", "", "", ""])
                continue
            r = _rate(rows)
            base = base or r["steps/s"]
            table.append([label, f"{r['steps/s']:.2f}", f"{r['steps/s'] / base:.2f}x",
                          f"{1000 * r['wait']:.0f}", f"{1000 * r['sync']:.1f}", f"{r['reward']:.3f}"])
            print(markdown(header, table[-1:]).splitlines()[-1], flush=True)
    text = markdown(header, table)
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
