"""Throughput of rlctl's step against a hand-written floor, on the default tiny config.

    OMP_NUM_THREADS=1 python bench/throughput.py [--steps 30] [--warmup 5] [--repeats 1] [--t90]
                                                 [--modes floor,sync,async] [--out bench/throughput.md]

floor and sync run interleaved step by step in one subprocess (the same background
load for both; their peak RSS is that process's), async in its own subprocess:
- floor: plain ``model.generate`` (sampling, B*G prompts, same max_new_tokens) + one
  forward / backward / AdamW step on the generated batch (no scoring, no advantages);
- sync: rlctl's ``Trainer.step`` (default config: GRPO, single pass, no reference);
- async: rlctl's asynchronous mode (trainer.async_rollout.enabled=true), 1 actor + 1 learner.
Reported: steps/s, completion tokens/s, each as a ratio to the floor, the per-phase
breakdown (medians of time/generate_s, score_s, logprob_s, update_s) and peak RSS.
``--t90`` also trains sync and async through ``rlctl train`` and reports the wall time
at which held-out greedy exact-match first reached 0.9.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import markdown, run_rlctl  # noqa: E402

PHASES = ("time/generate_s", "time/score_s", "time/logprob_s", "time/update_s")


def _setup(overrides):
    import torch
    from omegaconf import OmegaConf

    from rlctl.config.compose import compose
    from rlctl.train.build import model_from_config, prepare_task, task_from_config, quiet_libraries

    cfg = compose(["trainer.eval_every=0", "logger=none", *overrides]).cfg
    OmegaConf.resolve(cfg)
    quiet_libraries(cfg)
    built = task_from_config(cfg)
    model, critic, tok, ref = model_from_config(cfg)
    task = prepare_task(cfg, tok, model, built, quiet=True)     # the prepared task
    torch.manual_seed(cfg.seed * 1000)
    return cfg, task, model, tok


def floor_stepper(cfg, task, model, tok):
    """One floor step per call -> completion tokens."""
    import torch

    n = cfg.trainer.prompts_per_step * cfg.algo.group_size
    examples = list(task.train)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.trainer.lr)
    count = iter(range(1 << 30))

    def one() -> float:
        i = next(count)
        prompts = [examples[(i * n + j) % len(examples)].prompt for j in range(n)]
        enc = tok(prompts, return_tensors="pt", padding=True)
        model.eval()
        with torch.no_grad():
            seqs = model.generate(**enc, do_sample=True, temperature=cfg.rollout.temperature,
                                  top_k=None, top_p=1.0, max_new_tokens=cfg.rollout.max_new_tokens,
                                  pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)  # [N, P+T]
        P = enc["input_ids"].shape[1]
        mask = (seqs[:, P:] != tok.pad_token_id).float()                                 # [N, T]
        attn = torch.cat([enc["attention_mask"], mask.long()], 1)                        # [N, P+T]
        model.train()
        logits = model(input_ids=seqs[:, :-1], attention_mask=attn[:, :-1]).logits[:, P - 1:]  # [N, T, V]
        logp = torch.log_softmax(logits, -1).gather(-1, seqs[:, P:, None]).squeeze(-1)   # [N, T]
        adv = torch.randn(n, 1)
        loss = -(logp * adv * mask).sum() / mask.sum().clamp(min=1)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.max_grad_norm)
        opt.step()
        return float(mask.sum())
    return one


def run_modes(modes, steps: int, warmup: int, overrides) -> dict:
    """Steps of each mode interleaved round-robin in this process (fair under a noisy,
    shared CPU: every mode sees the same background load)."""
    import copy

    from rlctl.train.sources import build_source
    from rlctl.train.trainer import Trainer
    from rlctl.sinks import NullSink

    cfg, task, model, tok = _setup(overrides)
    steppers = {}
    for mode in modes:
        if mode == "floor":
            steppers[mode] = floor_stepper(cfg, task, copy.deepcopy(model), tok)
        else:
            policy = copy.deepcopy(model)
            steppers[mode] = Trainer.from_config(cfg, policy, tok, task, NullSink(),
                                                 source=build_source(cfg, policy, tok, task))
    res = {m: {"times": [], "tokens": [], **{k: [] for k in PHASES}} for m in modes}
    for i in range(1, warmup + steps + 1):
        for mode, st in steppers.items():
            t0 = time.perf_counter()
            values = st.step(i) if mode != "floor" else {"tokens": st()}
            dt = time.perf_counter() - t0
            if i <= warmup:
                continue
            r = res[mode]
            r["times"].append(dt)
            r["tokens"].append(values.get("tokens") or values["perf/tokens_per_s"]
                               * (values["time/rollout_s"] + values["time/update_s"]))
            for k in PHASES:
                if k in values:
                    r[k].append(values[k])
    out = {}
    for mode, r in res.items():
        out[mode] = {"step_s": statistics.median(r["times"]), "tokens": statistics.mean(r["tokens"]),
                     **{k: statistics.median(r[k]) for k in PHASES if r[k]}}
    return out


def run_trainer(steps: int, warmup: int, overrides) -> dict:
    from rlctl.train.sources import build_source
    from rlctl.train.trainer import Trainer
    from rlctl.sinks import NullSink

    cfg, task, model, tok = _setup(overrides)
    trainer = Trainer.from_config(cfg, model, tok, task, NullSink(), source=build_source(cfg, model, tok, task))
    times, tokens, phases = [], [], {k: [] for k in PHASES}
    try:
        for i in range(1, warmup + steps + 1):
            t0 = time.perf_counter()
            values = trainer.step(i)
            if i > warmup:
                times.append(time.perf_counter() - t0)
                tokens.append(values["perf/tokens_per_s"] * (values["time/rollout_s"] + values["time/update_s"]))
                for k in PHASES:
                    phases[k].append(values.get(k, float("nan")))
    finally:
        getattr(trainer, "close", lambda: None)()
    out = {"step_s": statistics.median(times), "tokens": statistics.mean(tokens)}
    out.update({k: statistics.median(v) for k, v in phases.items()})
    return out


def child(mode: str, steps: int, warmup: int, overrides) -> None:
    if mode == "floor+sync":
        res = run_modes(["floor", "sync"], steps, warmup, overrides)
    else:
        extra = ["trainer.async_rollout.enabled=true"] if mode == "async" else []
        res = run_trainer(steps, warmup, overrides + extra)
    res["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(res), flush=True)


def measure(mode: str, steps: int, warmup: int, overrides) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, "--steps", str(steps), "--warmup", str(warmup),
           *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not line:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(line[-1][7:])


def time_to_90(mode: str, steps: int, out_dir: Path, overrides) -> str:
    extra = ["trainer.async_rollout.enabled=true"] if mode == "async" else []
    try:
        _, rows = run_rlctl([f"trainer.steps={steps}", *overrides, *extra], out_dir, f"t90-{mode}")
    except RuntimeError as exc:
        return f"error: {exc}"
    hit = next((r["time/elapsed_s"] for r in rows if r.get("eval/exact_match", 0) >= 0.9 and r["step"] > 0), None)
    return f"{hit:.1f}" if hit is not None else f"not reached in {steps} steps"


def _median_round(rounds: list) -> dict:
    """One whole round, so that every ratio in the table compares measurements made
    together: the round with the median async/sync ratio (else median sync step time)."""
    def key(r):
        s, a = r.get("sync", {}), r.get("async", {})
        if "step_s" in s and "step_s" in a:
            return s["step_s"] / a["step_s"]
        return s.get("step_s", a.get("step_s", 0.0))
    return sorted(rounds, key=key)[len(rounds) // 2]


def report(results: dict, t90: dict) -> str:
    floor = results.get("floor", {})
    head = ["mode", "steps/s", "compl. tokens/s", "step s vs floor", "tokens/s vs floor",
            "generate s", "score s", "logprob s", "update s", "peak RSS MB", "s to 0.9 exact"]
    rows = []
    for mode, r in results.items():
        if "error" in r:
            rows.append([mode, "error: " + r["error"]] + [""] * (len(head) - 2))
            continue
        tps = r["tokens"] / r["step_s"]
        rel = lambda a, b: f"{a / b:.2f}x" if b else "-"  # noqa: E731
        rows.append([mode, f"{1 / r['step_s']:.2f}", f"{tps:.0f}",
                     rel(r["step_s"], floor.get("step_s", 0)),
                     rel(tps, floor["tokens"] / floor["step_s"]) if "tokens" in floor else "-",
                     *[f"{r[k]:.3f}" if k in r else "-" for k in PHASES],
                     f"{r['peak_rss_mb']:.0f}", t90.get(mode, "-")])
    text = markdown(head, rows)
    sync, asyn = results.get("sync", {}), results.get("async", {})
    if "step_s" in sync and "step_s" in asyn:
        text += f"\n\nasync / sync steps/s: {sync['step_s'] / asyn['step_s']:.2f}x"
        if "step_s" in floor:
            text += f"; sync step / floor step: {sync['step_s'] / floor['step_s']:.2f}x"
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--modes", default="floor,sync,async")
    ap.add_argument("--repeats", type=int, default=1,
                    help="measure every mode this many times, in rounds; report the median")
    ap.add_argument("--t90", action="store_true", help="also time-to-0.9 exact-match, sync vs async")
    ap.add_argument("--t90-steps", type=int, default=300)
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="config overrides for every mode")
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.steps, args.warmup, args.overrides)
    t90 = {}
    modes = args.modes.split(",")
    rounds = []        # the modes one after another, --repeats times (noise hits all modes)
    for _ in range(args.repeats):
        results = {}
        if "floor" in modes and "sync" in modes:     # interleaved in one process (shared RSS)
            pair = measure("floor+sync", args.steps, args.warmup, args.overrides)
            rss = pair.pop("peak_rss_mb", float("nan"))
            for m in ("floor", "sync"):
                results[m] = {**pair[m], "peak_rss_mb": rss} if m in pair else pair
                print(m, json.dumps(results[m]), flush=True)
        for mode in [m for m in modes if m not in results]:
            results[mode] = measure(mode, args.steps, args.warmup, args.overrides)
            print(mode, json.dumps(results[mode]), flush=True)
        rounds.append(results)
    results = _median_round(rounds)
    if args.t90:
        with tempfile.TemporaryDirectory() as tmp:
            for mode in ("sync", "async"):
                t90[mode] = time_to_90(mode, args.t90_steps, Path(tmp), args.overrides)
                print(mode, "t90", t90[mode], flush=True)
    text = report(results, t90)
    ratios = [r["sync"]["step_s"] / r["async"]["step_s"] for r in rounds
              if "step_s" in r.get("sync", {}) and "step_s" in r.get("async", {})]
    if len(ratios) > 1:
        text += (f"\n\nAll modes measured in {len(ratios)} rounds; the table is the round with the "
                 "median async / sync ratio. Per round: " + ", ".join(f"{x:.2f}x" for x in ratios))
    print("\n" + text)
    if args.out:
        cmd = "OMP_NUM_THREADS=1 python bench/throughput.py " + " ".join(sys.argv[1:])
        Path(args.out).write_text(f"`{cmd}`\n\n{text}\n")


if __name__ == "__main__":
    main()
