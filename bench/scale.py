"""Backends and memory side by side, in one run; prints two tables.

    python bench/scale.py [--steps 30] [--out bench/scale.md]

1. Step time (median of rollout + update seconds over the steps after the first 3) for
   plain torch and DeepSpeed ZeRO 0-3, with 1 and 2 processes, same global batch.
2. Peak memory (max RSS over ranks) of full fine-tuning with a separate frozen reference
   copy vs LoRA with the adapter-disabled reference, on a larger tiny-Llama
   (hidden 512, 8 layers) so that the model, not the Python runtime, dominates.
Runs are sequential; on a shared 2-core machine two ranks compete for the cores.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from common import markdown, median_step_s, run_rlctl

LAYOUTS = [("torch", ["hardware=cpu"])] + [
    (f"deepspeed ZeRO-{z}", ["hardware=deepspeed", f"hardware.zero_stage={z}"]) for z in range(4)]
BIG = ["model.hidden_size=512", "model.num_layers=8", "model.num_heads=8"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    common = [f"trainer.steps={args.steps}", "trainer.eval_every=0"]
    timing, memory = [], []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        for label, hw in LAYOUTS:
            row = [label]
            for n in (1, 2):
                try:
                    summary, rows = run_rlctl(common + hw + [f"hardware.num_processes={n}"], out, f"t{n}")
                    row += [f"{1000 * median_step_s(rows):.0f}", f"{summary['peak_rss_mb']:.0f}"]
                except RuntimeError as exc:
                    row += [f"error: {exc}", ""]
            timing.append(row)
            print(markdown(["layout", "1 proc ms/step", "1 proc MiB", "2 proc ms/step", "2 proc MiB"], timing[-1:]).splitlines()[-1], flush=True)
        for label, extra in (("full fine-tune + reference copy", ["algo.kl.coef=0.05"]),
                             ("LoRA r=16 + adapter-disabled reference",
                              ["algo.kl.coef=0.05", "model.lora.enabled=true", "model.lora.r=16"]),
                             ("full fine-tune, no reference (kl 0)", [])):
            summary, rows = run_rlctl(common[:1] + ["trainer.eval_every=0", "trainer.steps=10"] + BIG + extra, out, "m")
            memory.append([label, f"{summary['params_trainable']:,}", f"{summary['params_total']:,}",
                           f"{summary['peak_rss_mb']:.0f}", f"{1000 * median_step_s(rows):.0f}"])
            print(memory[-1], flush=True)
    text = (markdown(["layout", "1 proc ms/step", "1 proc peak MiB", "2 proc ms/step", "2 proc peak MiB"], timing)
            + "\n\n" + markdown(["hidden 512 x 8 layers", "trainable", "total", "peak RSS MiB", "ms/step"], memory))
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
