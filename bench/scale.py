"""Backends and memory side by side, in one run; prints two tables.

    python bench/scale.py [--steps 30] [--out bench/scale.md]
    python bench/scale.py --model DIR [--steps 3]      # a real model: table 1 only

1. Steps per second (1 / median of rollout + update seconds over the steps after the first
   3) and peak RSS per rank (the largest rank's own peak) for plain torch, DeepSpeed ZeRO
   0-3 and FSDP2, with 1 and 2 processes, same global batch, and the 1-minute load average
   when the row ended. With ``--model DIR`` (a Hugging Face directory): plain torch, ZeRO-2,
   ZeRO-3 and FSDP2 on that model, GRPO with 2 prompts x 2 samples, 8 new tokens, no
   reference model, the first step not timed.
2. Peak memory (max RSS over ranks) of full fine-tuning with a separate frozen reference
   copy vs LoRA with the adapter-disabled reference, on a larger tiny-Llama
   (hidden 512, 8 layers) so that the model, not the Python runtime, dominates.
Runs are sequential; on a shared 2-core machine two ranks compete for the cores.
"""
from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from common import markdown, median_step_s, run_rlctl

LAYOUTS = [("torch", ["hardware=cpu"])] + [
    (f"deepspeed ZeRO-{z}", ["hardware=deepspeed", f"hardware.zero_stage={z}"]) for z in range(4)] + [
    ("FSDP2", ["hardware=fsdp2"])]
REAL = ["trainer.prompts_per_step=2", "algo.group_size=2", "rollout.max_new_tokens=8",
        "algo.kl.coef=0", "trainer.checkpoint_every=0"]
HEADER = ["layout", "1 proc steps/s", "1 proc peak MiB/rank", "2 proc steps/s", "2 proc peak MiB/rank", "load"]
BIG = ["model.hidden_size=512", "model.num_layers=8", "model.num_heads=8"]
MEMORY = (("full fine-tune + reference copy", ["algo.kl.coef=0.05"]),
          ("LoRA r=16 + adapter-disabled reference", ["algo.kl.coef=0.05", "model.lora.enabled=true", "model.lora.r=16"]),
          ("full fine-tune, no reference (kl 0)", []))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default 30; 3 with --model)")
    ap.add_argument("--model", default=None, help="a Hugging Face model directory")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    steps = args.steps or (3 if args.model else 30)
    common = [f"trainer.steps={steps}", "trainer.eval_every=0"]
    layouts, skip = LAYOUTS, 3
    if args.model:
        common += ["model=hf", f"model.name_or_path={args.model}", *REAL]
        layouts, skip = [LAYOUTS[i] for i in (0, 3, 4, 5)], 1
    timing, memory = [], []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        for label, hw in layouts:
            row = [label]
            for n in (1, 2):
                try:
                    summary, rows = run_rlctl(common + hw + [f"hardware.num_processes={n}"], out, f"t{n}")
                    row += [f"{1 / median_step_s(rows, skip):.3g}", f"{summary['peak_rss_mb']:.0f}"]
                except RuntimeError as exc:
                    row += [f"error: {exc}", ""]
            timing.append(row + [f"{os.getloadavg()[0]:.1f}"])
            print(markdown(HEADER, timing[-1:]).splitlines()[-1], flush=True)
        for label, extra in () if args.model else MEMORY:
            summary, rows = run_rlctl(common[:1] + ["trainer.eval_every=0", "trainer.steps=10"] + BIG + extra, out, "m")
            memory.append([label, f"{summary['params_trainable']:,}", f"{summary['params_total']:,}",
                           f"{summary['peak_rss_mb']:.0f}", f"{1000 * median_step_s(rows):.0f}"])
            print(memory[-1], flush=True)
    text = markdown(HEADER, timing)
    if memory:
        text += "\n\n" + markdown(["hidden 512 x 8 layers", "trainable", "total", "peak RSS MiB", "ms/step"], memory)
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
