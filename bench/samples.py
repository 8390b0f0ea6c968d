"""What sample tables cost: one `rlctl train` configuration run both ways, samples on
(logger.samples at its defaults, or --every N) and off (logger.samples.every=0).

    OMP_NUM_THREADS=1 python bench/samples.py [--steps 100] [--repeats 3] [--every 25] [OVERRIDES...]

The runs are `rlctl train` in this process (run_training: the default config and logger,
W&B offline + metrics.jsonl + samples.jsonl; the console off, as without a terminal), the
same seed and steps both ways, alternating on, off, on, off, ... after one run that is
not counted (the process's first run pays its warm-up). A run's steps/s is
trainer.steps over its training time (summary.json train_seconds: the loop with its
held-out evals). Printed: every run's steps/s, each way's median, the cost (off/on - 1)
and each way's spread (max/min - 1: the noise of a shared machine). Because that noise
can exceed the cost, every run also times what samples can add to: the sample path (the
train tables: drawing, reading back, decoding and every sink's samples(); the eval
tables: the sinks' samples()) and the sinks' log() (W&B serialises a table when the
step's row is committed, at the next log()). The median of (on runs' timed seconds -
off runs' timed seconds) over the off runs' training time is the cost measured directly.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rlctl.train.trainer import Trainer# noqa: E402
from rlctl.train.run import run_training# noqa: E402
from rlctl.sinks.sink import MultiSink# noqa: E402


class SamplePathTimer:
    """Seconds spent in the sample path and the sinks' log() while installed (wraps the
    real methods)."""

    def __init__(self):
        self.seconds = 0.0

    @contextlib.contextmanager
    def installed(self):
        log_samples, sink_samples, sink_log = Trainer._log_samples, MultiSink.samples, MultiSink.log

        def timed_train(trainer, batch, step):
            t0 = time.perf_counter()
            try:
                return log_samples(trainer, batch, step)
            finally:
                self.seconds += time.perf_counter() - t0

        def timed_eval(sink, rows, step, table="train"):
            t0 = time.perf_counter()
            try:
                return sink_samples(sink, rows, step, table)
            finally:
                if table == "eval":        # the train tables are inside timed_train
                    self.seconds += time.perf_counter() - t0
        def timed_log(sink, metrics, step):
            t0 = time.perf_counter()
            try:
                return sink_log(sink, metrics, step)
            finally:
                self.seconds += time.perf_counter() - t0
        Trainer._log_samples, MultiSink.samples, MultiSink.log = timed_train, timed_eval, timed_log
        try:
            yield self
        finally:
            Trainer._log_samples, MultiSink.samples, MultiSink.log = log_samples, sink_samples, sink_log


def one_run(overrides: List[str], out_dir: Path, name: str) -> Tuple[float, float, float]:
    """(steps/s, training seconds, seconds timed: sample path and log()) of one run."""
    timer = SamplePathTimer()
    with timer.installed(), contextlib.redirect_stdout(io.StringIO()):
        summary = run_training(["logger.console=false", "run.save_model=false",
                                f"run.output_dir={out_dir}", f"run.name={name}", *overrides])
    return summary["steps"] / summary["train_seconds"], summary["train_seconds"], timer.seconds


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--every", type=int, default=None, help="logger.samples.every when on (default: its default)")
    args, overrides = ap.parse_known_args(argv)
    os.environ.setdefault("WANDB_SILENT", "true")
    base = [f"trainer.steps={args.steps}", *overrides]
    ways = {"on": base + ([f"logger.samples.every={args.every}"] if args.every else []),
            "off": base + ["logger.samples.every=0"]}
    rates, timed, trained = {"on": [], "off": []}, {"on": [], "off": []}, []
    with tempfile.TemporaryDirectory(prefix="rlctl-bench-samples-") as tmp:
        one_run(ways["off"], Path(tmp), "warmup")
        for r in range(args.repeats):
            for way, extra in ways.items():
                rate, seconds, in_sinks = one_run(extra, Path(tmp), f"{way}{r}")
                rates[way].append(rate)
                timed[way].append(in_sinks)
                if way == "off":
                    trained.append(seconds)
                print(f"run {r + 1} samples {way}: {rate:.2f} steps/s ({1000 * in_sinks:.0f} ms "
                      f"of {seconds:.1f} s in the sample path and log())", flush=True)
    med = {w: statistics.median(v) for w, v in rates.items()}
    spread = {w: max(v) / min(v) - 1 for w, v in rates.items()}
    every = args.every or "25, the default"
    print(f"samples on (every {every}): {med['on']:.2f} steps/s; off: {med['off']:.2f} steps/s; "
          f"cost {100 * (med['off'] / med['on'] - 1):+.1f}% (medians of {args.repeats} runs; spread "
          f"on {100 * spread['on']:.0f}%, off {100 * spread['off']:.0f}%); measured directly "
          f"{100 * statistics.median(on - off for on, off in zip(timed['on'], timed['off'])) / statistics.median(trained):+.2f}% "
          f"(sample path and log(): on {1000 * statistics.median(timed['on']):.0f} ms, off "
          f"{1000 * statistics.median(timed['off']):.0f} ms a run)")


if __name__ == "__main__":
    main()
