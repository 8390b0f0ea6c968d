"""rlctl against TRL's GRPOTrainer on a real pretrained chat model, one run, one thread each.

    OMP_NUM_THREADS=1 python bench/trl_real.py --model DIR --trl-python /path/to/trl-venv/bin/python \
        [--steps 3] [--modes lora full] [--precision fp32] [--repeats 1] [--rlctl-args KEY=VALUE ...]

Same model (a float32 HF directory, e.g. SmolLM2-135M-Instruct from scripts/get-smollm2), the
same chat prompts ("Which number is larger, A or B? Answer with just the number.", drawn
with a fixed seed), the same exact-answer reward, 4 prompts x 8 samples, 32 new tokens at
temperature 1 over the full vocabulary, GRPO's group-normalised advantages, the
sequence-mean of token means, clip 0.2, no KL term (TRL's beta default 0), one optimizer
step per rollout, AdamW at a constant learning rate, gradient clipping 1.0; LoRA r 8 on every
Linear but the head (alpha 16, lr 5e-4) or full fine-tuning (lr 2e-5). Each side runs in
its own process (peak RSS is that process's, from wait4); the first step is a warm-up and
is not timed; each step is timed in wall and in CPU seconds (one thread: equal on a quiet
machine, and the CPU figure holds on a shared one). ``--precision bf16``: float32 weights, bfloat16 autocast on both sides (rlctl's
learner and sampler; TRL's ``bf16=True``, its default). Tokens/s counts completion tokens. Settings that differ are printed.
TRL is never a dependency of rlctl: it lives in the interpreter given by --trl-python.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
QUESTION = "Which number is larger, {a} or {b}? Answer with just the number."
B, G, T = 4, 8, 32
LR = {"lora": 5e-4, "full": 2e-5}
UNMATCHED = [
    "prompt order: each trainer draws from the same prompt file with its own sampler",
    "TRL: generation through transformers' generate (KV cache per sequence); rlctl: its own "
    "sampler (each group's prompt run once)",
    "TRL: the step also logs its own metrics (entropy, clip ratios); rlctl: its metric schema",
    "update: TRL one micro-batch of 32 rows (gradient_accumulation_steps=1, as configured "
    "here); rlctl its CPU default, even micro-batches within trainer.activation_mb (exact "
    "accumulation, the same update)",
    "allocator: rlctl keeps freed memory for reuse on the CPU (glibc mallopt); TRL glibc's defaults",
    "set on TRL to match rlctl (its defaults differ): loss_type=grpo (dapo), a constant "
    "learning rate (linear decay), bf16 per --precision (bf16=True), dropout off (kept); "
    "equal defaults: beta 0, token-level importance ratio, one iteration, group std scaling",
]


def make_prompts(n: int, seed: int = 0) -> list:
    """``n`` rows {prompt, answer}: two distinct 2-digit numbers, the larger is the answer."""
    rng, rows = random.Random(seed), []
    while len(rows) < n:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        if a != b:
            rows.append({"prompt": QUESTION.format(a=a, b=b), "answer": str(max(a, b))})
    return rows


def reward(prompt, completion: str, answer=None, **_fields) -> float:
    """1.0 when the whole stripped completion is the answer (rlctl's reward_fn signature)."""
    return float(completion.strip() == str(answer).strip())


def _env() -> dict:
    one = {k: "1" for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    return dict(os.environ, **one, TOKENIZERS_PARALLELISM="false", WANDB_MODE="offline")


def _wait(cmd: list, log: Path) -> int:
    """Run ``cmd``; its peak RSS in MiB (wait4's ru_maxrss: the process and its waited children)."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=_env())
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        tail = log.read_text().strip().splitlines()[-5:]
        raise RuntimeError(f"{cmd[0]} exited {proc.returncode}: " + " | ".join(tail))
    return usage.ru_maxrss // 1024


def run_rlctl(mode: str, args, data: Path, work: Path) -> dict:
    """seconds per step (after the warm-up), completion tokens/s, peak RSS MiB."""
    lora = mode == "lora"
    over = ["model=hf", f"model.name_or_path={args.model}", "task=jsonl", f"task.train_path={data}",
            f"task.eval_path={data}", "task.prompt_format=chat", f"task.reward_fn={HERE}:reward",
            "task.reward_timeout_s=0", f"trainer.steps={args.steps + 1}", f"trainer.prompts_per_step={B}",
            f"algo.group_size={G}", f"rollout.max_new_tokens={T}", "trainer.eval_every=0",
            "trainer.checkpoint_every=0", "run.save_model=false", "logger=jsonl",
            "logger.console=false", f"run.output_dir={work}", f"run.name=rlctl-{mode}", "seed=0",
            f"model.lora.enabled={str(lora).lower()}", f"model.lora.lr={LR['lora']}",
            f"trainer.lr={LR['full']}", *args.rlctl_args]
    if args.precision == "bf16":
        over += ["hardware.precision=bf16", "rollout.sample_dtype=bfloat16"]
    out = work / f"rlctl-{mode}.json"
    rss = _wait([sys.executable, str(HERE), "--rlctl-worker", str(out), *over], work / f"rlctl-{mode}.log")
    run = sorted(work.glob(f"*rlctl-{mode}"))[-1]
    rows = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if "time/update_s" in r]
    timed = [r for r in rows if r["step"] > 1]
    times = json.loads(out.read_text())
    tokens = sum(r["length/mean"] * B * G for r in timed)
    return dict(times, tokens_per_s=tokens / sum(times["step_s"]), rss_mib=rss,
                phases={k: statistics.median(r[k] for r in timed)
                        for k in ("time/generate_s", "time/logprob_s", "time/update_s")})


def rlctl_worker(out: Path, overrides: list) -> None:
    """``rlctl train`` in this process, each step's wall and CPU seconds (the warm-up dropped)."""
    from rlctl.cli import main as cli
    from rlctl.train.trainer import Trainer

    wall, cpu, step = [], [], Trainer.step

    def timed(self, *a, **k):
        t, c = time.perf_counter(), time.process_time()
        values = step(self, *a, **k)
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
        return values

    Trainer.step = timed
    sys.argv = ["rlctl", "train", *overrides]
    try:
        cli()
    except SystemExit as e:
        if e.code:
            raise
    out.write_text(json.dumps(dict(step_s=wall[1:], cpu_s=cpu[1:])))


def run_trl(mode: str, args, data: Path, work: Path) -> dict:
    out = work / f"trl-{mode}.json"
    cmd = [args.trl_python, str(HERE), "--trl-worker", mode, "--model", args.model,
           "--steps", str(args.steps), "--precision", args.precision, "--data", str(data), "--out", str(out)]
    rss = _wait(cmd, work / f"trl-{mode}.log")
    return dict(json.loads(out.read_text()), rss_mib=rss)


def trl_worker(mode: str, model_dir: str, steps: int, data: Path, out: Path, bf16: bool) -> None:
    """One TRL GRPOTrainer run in this process (imported only here)."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = [json.loads(x) for x in data.read_text().splitlines()]
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}],
                             "answer": r["answer"]} for r in rows])

    def trl_reward(prompts, completions, answer, **_):
        return [reward(None, c[-1]["content"], a) for c, a in zip(completions, answer)]

    times, cpu, lengths = [], [], []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t, self.c = time.perf_counter(), time.process_time()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t)
            cpu.append(time.process_time() - self.c)

        def on_log(self, _args, _state, _control, logs=None, **k):
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])

    cfg = GRPOConfig(output_dir=str(out.parent / f"trl-{mode}"), per_device_train_batch_size=B * G,
                     gradient_accumulation_steps=1, num_generations=G, max_completion_length=T,
                     temperature=1.0, top_p=1.0, top_k=0, learning_rate=LR[mode],
                     lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
                     beta=0.0, loss_type="grpo", scale_rewards="group", epsilon=0.2, num_iterations=1,
                     max_steps=steps + 1, logging_steps=1, save_strategy="no", report_to=[],
                     bf16=bf16, use_cpu=True, disable_dropout=True, seed=0, dataloader_num_workers=0)
    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear",
                      task_type="CAUSAL_LM") if mode == "lora" else None
    trainer = GRPOTrainer(model=model, reward_funcs=trl_reward, args=cfg, train_dataset=ds,
                          processing_class=tok, peft_config=peft, callbacks=[Timer()])
    trainer.train()
    timed, lens = times[1:], lengths[1:]
    out.write_text(json.dumps(dict(step_s=timed, cpu_s=cpu[1:],
                                   tokens_per_s=sum(lens) * B * G / sum(timed), phases={})))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=os.environ.get("RLCTL_SMOLLM2", ""),
                   help="a float32 HF directory of SmolLM2-135M-Instruct (scripts/get-smollm2)")
    p.add_argument("--trl-python", help="an interpreter with trl, peft and datasets installed")
    p.add_argument("--steps", type=int, default=3, help="timed steps per side (after one warm-up)")
    p.add_argument("--modes", nargs="+", default=["lora", "full"], choices=["lora", "full"])
    p.add_argument("--sides", nargs="+", default=["rlctl", "trl"], choices=["rlctl", "trl"])
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                   help="bf16: bfloat16 autocast on both sides (float32 weights)")
    p.add_argument("--repeats", type=int, default=1, help="rounds of every side and mode")
    p.add_argument("--rlctl-args", nargs="*", default=[], help="extra rlctl overrides")
    p.add_argument("--out", help="write every figure as JSON here")
    p.add_argument("--trl-worker", help=argparse.SUPPRESS)
    p.add_argument("--rlctl-worker", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    a, rest = p.parse_known_args()
    if a.rlctl_worker:
        return rlctl_worker(Path(a.rlctl_worker), rest)
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    if a.trl_worker:
        return trl_worker(a.trl_worker, a.model, a.steps, Path(a.data), Path(a.out), a.precision == "bf16")
    if not a.model or not Path(a.model).is_dir():
        sys.exit("trl_real: --model must be a local HF directory (scripts/get-smollm2 prints one)")
    if "trl" in a.sides and not a.trl_python:
        sys.exit("trl_real: --trl-python is needed for the TRL side (or --sides rlctl)")
    work = Path(tempfile.mkdtemp(prefix="trl_real-"))
    data = work / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in make_prompts(256)))
    print(f"{B} prompts x {G} samples, {T} new tokens, {a.steps} timed steps after 1 warm-up, "
          f"{a.precision}, 1 thread; logs in {work}")
    results = []
    for rep in range(a.repeats):
        for mode in a.modes:
            r = {"repeat": rep, "mode": mode}
            for side in a.sides:
                r[side] = (run_rlctl if side == "rlctl" else run_trl)(mode, a, data, work)
                s = r[side]
                print(f"[{rep}] {mode:4s} {side:5s} {statistics.median(s['step_s']):6.2f} s/step "
                      f"(min {min(s['step_s']):.2f}, CPU {statistics.median(s['cpu_s']):.2f})  "
                      f"{s['tokens_per_s']:6.1f} tok/s  "
                      f"{s['rss_mib']:5d} MiB peak  {s.get('phases') or ''}", flush=True)
            if len(a.sides) == 2:
                ratio = {k: statistics.median(r["trl"][k]) / statistics.median(r["rlctl"][k])
                         for k in ("step_s", "cpu_s")}
                r["ratios"] = dict(speed=ratio["step_s"], speed_cpu=ratio["cpu_s"],
                                   rss=r["rlctl"]["rss_mib"] / r["trl"]["rss_mib"])
                print(f"[{rep}] {mode:4s} rlctl/TRL: {ratio['step_s']:.2f}x steps/s (CPU time: "
                      f"{ratio['cpu_s']:.2f}x), {r['ratios']['rss']:.2f}x peak RSS", flush=True)
            results.append(r)
    print("not matched:\n  " + "\n  ".join(UNMATCHED + [f"rlctl extra: {' '.join(a.rlctl_args)}"]
                                           * bool(a.rlctl_args)))
    if a.out:
        Path(a.out).write_text(json.dumps(dict(args=vars(a), results=results), indent=1))


if __name__ == "__main__":
    main()
