"""How a batch of completions is scored under ``task.reward_timeout_s``: the task's
reward run sample by sample (or in one batched call), in a forked worker process killed
at a deadline, a daemon thread where fork is missing, or inline without a limit.
``rlctl.tasks.scoring.RewardScorer`` picks one and applies the error policy."""
from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import threading
import time
from typing import Any, Dict, Iterator, Optional, Sequence, Tuple

from rlctl.tasks.base import RAW_PROMPT
from rlctl.types import Example


def _one_line(text: Any, limit: int = 60) -> str:
    s = " ".join(str(text).split())
    return s if len(s) <= limit else s[:limit - 3] + "..."


def describe_sample(i: int, n: int, example: Example, completion: str) -> str:
    raw = example.fields.get(RAW_PROMPT, example.prompt)
    return (f"sample {i} of {n} (prompt {_one_line(raw)!r}, "
            f"completion {_one_line(completion)!r})")


def _total(task, comps: Dict[str, float]) -> float:
    weights = getattr(task, "reward_weights", None) or {}
    return float(sum(weights.get(k, 1.0) * v for k, v in comps.items()))


def _score_one(task, example: Example, completion: str) -> Tuple[float, Dict[str, float]]:
    comp_fn = getattr(task, "reward_components", None)
    if comp_fn is not None:
        comps = {str(k): float(v) for k, v in comp_fn(example, completion).items()}
        return _total(task, comps), comps
    return float(task.reward(example, completion)), {}


def score_stream(task, examples: Sequence[Example], completions: Sequence[str]
                 ) -> Iterator[Tuple]:
    """("ok", i, total, components) or ("err", i, message) for each sample, in order.

    A task's ``reward_components_batch`` is tried first; if it raises, the batch is
    scored sample by sample so that the failing sample can be named."""
    batch_fn = getattr(task, "reward_components_batch", None)
    if batch_fn is not None and len(examples) > 1 and getattr(task, "score_in_batches", True):
        try:
            rows = batch_fn(list(examples), list(completions))
            if len(rows) != len(examples):
                raise ValueError(f"returned {len(rows)} scores for {len(examples)} samples")
            parsed = [{str(k): float(v) for k, v in r.items()} for r in rows]
        except Exception:  # noqa: BLE001 - retried per sample below, to name the culprit
            parsed = None
        if parsed is not None:
            for i, comps in enumerate(parsed):
                yield ("ok", i, _total(task, comps), comps)
            return
    for i, (ex, c) in enumerate(zip(examples, completions)):
        try:
            total, comps = _score_one(task, ex, c)
        except BaseException as exc:  # noqa: BLE001 - SystemExit from user code included
            if isinstance(exc, KeyboardInterrupt):
                raise
            yield ("err", i, f"{type(exc).__name__}: {_one_line(exc, 200)}")
            continue
        yield ("ok", i, total, comps)


def _worker_main(task, conn, parent_pid: int) -> None:  # runs in the forked child
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the trainer's stop handler (forked)
    os.setpgrp()   # nor do signals sent to the run's process group (a terminal, `timeout`) reach it
    while True:
        try:
            # A forked child holds copies of its parent's descriptors (the pipe's other
            # end, distributed sockets): it must leave by itself when the parent dies.
            while not conn.poll(1.0):
                if os.getppid() != parent_pid:
                    return
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        examples, completions = msg
        try:
            for item in score_stream(task, examples, completions):
                conn.send(item)
        except BaseException as exc:  # noqa: BLE001 - e.g. an unpicklable value
            conn.send(("fatal", f"{type(exc).__name__}: {_one_line(exc, 200)}"))
        conn.send(("done",))


class ProcessRunner:
    """One forked worker, kept between batches, killed at a deadline."""

    def __init__(self, task):
        self.task, self.proc, self.conn = task, None, None

    def _start(self) -> None:
        ctx = multiprocessing.get_context("fork")
        parent, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(self.task, child, os.getpid()), daemon=True,
                                name="rlctl-reward")
        self.proc.start()
        child.close()
        self.conn = parent

    def run(self, examples, completions, timeout_s: float, on_item) -> Optional[str]:
        """Feed each result to ``on_item``; return None, "timeout" or "died"."""
        if self.proc is None or not self.proc.is_alive():
            self.close()
            self._start()
        deadline = time.monotonic() + timeout_s
        try:
            self.conn.send((list(examples), list(completions)))
        except (OSError, ValueError):
            self.close()
            return "died"
        while True:
            remaining = deadline - time.monotonic()
            try:
                ready = remaining > 0 and self.conn.poll(remaining)
                if not ready:
                    self.close()
                    return "timeout"
                msg = self.conn.recv()
            except (EOFError, OSError):
                self.close()
                return "died"
            if msg[0] == "done":
                return None
            on_item(msg)

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.is_alive():
                self.proc.kill()
            self.proc.join(5)
            self.proc = None
        if self.conn is not None:
            self.conn.close()
            self.conn = None


class ThreadRunner:
    """Without fork: a daemon thread per batch, abandoned at the deadline."""

    def __init__(self, task):
        self.task = task

    def run(self, examples, completions, timeout_s: float, on_item) -> Optional[str]:
        q: "queue.Queue" = queue.Queue()

        def work():
            try:
                for item in score_stream(self.task, examples, completions):
                    q.put(item)
            except BaseException as exc:  # noqa: BLE001
                q.put(("fatal", f"{type(exc).__name__}: {_one_line(exc, 200)}"))
            q.put(("done",))

        threading.Thread(target=work, daemon=True, name="rlctl-reward").start()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                msg = q.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                return "timeout"
            if msg[0] == "done":
                return None
            on_item(msg)

    def close(self) -> None:
        pass


class InlineRunner:
    def __init__(self, task):
        self.task = task

    def run(self, examples, completions, timeout_s, on_item) -> Optional[str]:
        for item in score_stream(self.task, examples, completions):
            on_item(item)
        return None

    def close(self) -> None:
        pass
