"""Scoring completions with a task's reward(s): batches under a time limit, the error
policy (``task.on_reward_error``), and per-reward components for ``reward/<name>``.

Split from ``rlctl.tasks.base`` (which re-exports these names).
"""
from __future__ import annotations

import logging
import math
import multiprocessing
import os
import queue
import signal
import threading
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from rlctl.errors import RewardError
from rlctl.tasks.base import ON_REWARD_ERROR, RAW_PROMPT, task_options
from rlctl.tasks.reward_model import learned_of
from rlctl.types import Example

log = logging.getLogger(__name__)


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


class _ProcessRunner:
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


class _ThreadRunner:
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


class _InlineRunner:
    def __init__(self, task):
        self.task = task

    def run(self, examples, completions, timeout_s, on_item) -> Optional[str]:
        for item in score_stream(self.task, examples, completions):
            on_item(item)
        return None

    def close(self) -> None:
        pass


FROM_TASK = object()  # RewardScorer's default: the task's own reward_timeout_s


class RewardScorer:
    """Scores batches with the task's reward(s) under ``task.reward_timeout_s``.

    ``score_batch`` never raises with ``on_reward_error=zero``: a sample whose reward
    raised or is not finite scores 0 and counts in ``errors``; samples left unscored at
    the deadline score 0 and count in ``timeouts`` (and a warning names the sample). With
    ``on_reward_error=raise`` either raises ``RewardError`` naming the sample.
    ``last_components`` holds each named reward of the last batch, one value per sample
    (``reward/<name>`` in the logs; ``metrics()`` gives the means).

    Reward models attached to the task (``rlctl.tasks.reward_model``) score the whole
    batch in this process, after the task's own rewards: their raw scores join the
    components, their shaped scores the total (with ``task.reward_model`` the total is
    theirs alone: the task's rewards are logged, and eval correctness still comes from
    them). The first scorer built for a task updates the running reward statistics and
    carries them in ``state()``; later ones (eval) read them.
    """

    def __init__(self, task, timeout_s: Any = FROM_TASK, on_error: Optional[str] = None):
        opts = task_options(task)
        self.task = task
        self.timeout_s = opts.reward_timeout_s if timeout_s is FROM_TASK else timeout_s
        self.on_error = on_error or opts.on_reward_error
        if self.on_error not in ON_REWARD_ERROR:
            raise ValueError(f"invalid on_reward_error '{self.on_error}'; valid: "
                             f"{', '.join(ON_REWARD_ERROR)}")
        self.errors = 0               # samples whose reward raised or was not finite
        self.timeouts = 0             # samples left unscored at a deadline
        self.calls = 0                # samples scored (or failed), for the run's summary
        self.seconds = 0.0            # wall time spent scoring
        self.last_components: Dict[str, List[float]] = {}
        self._sums: Dict[str, float] = {}   # per-reward sums since the last metrics()
        self._count = 0
        self._warned = 0
        self.learned = learned_of(task)
        self._owns_norm = self.learned.claim(self) if self.learned is not None else False
        self._last_gold: List[float] = []     # the task's own totals of the last batch
        if not self.timeout_s:
            self._runner = _InlineRunner(task)
        elif "fork" in multiprocessing.get_all_start_methods():
            self._runner = _ProcessRunner(task)
        else:
            self._runner = _ThreadRunner(task)

    # per-sample form, a drop-in for the engine's former SafeScorer
    def __call__(self, example: Example, completion: str) -> float:
        return self.score_batch([example], [completion])[0]

    def score_batch(self, examples: Sequence[Example], completions: Sequence[str]
                    ) -> List[float]:
        t0 = time.perf_counter()
        try:
            return self._score_batch(examples, completions)
        finally:
            self.seconds += time.perf_counter() - t0

    def _score_batch(self, examples: Sequence[Example], completions: Sequence[str]
                     ) -> List[float]:
        n = len(examples)
        if len(completions) != n:
            raise ValueError(f"{n} examples but {len(completions)} completions")
        self.calls += n
        totals: List[Optional[float]] = [None] * n
        comps: List[Dict[str, float]] = [{} for _ in range(n)]
        failures: List[Tuple[int, str]] = []
        fatal: List[str] = []

        def on_item(msg):
            if msg[0] == "ok":
                _, i, total, c = msg
                if not math.isfinite(total):
                    failures.append((i, f"the reward is {total}"))
                else:
                    totals[i], comps[i] = total, c
            elif msg[0] == "err":
                failures.append((msg[1], msg[2]))
            else:
                fatal.append(msg[1])

        status = self._runner.run(examples, completions, self.timeout_s, on_item) if n else None
        for i, why in failures:
            self._fail(describe_sample(i, n, examples[i], completions[i]), why, "error")
        failed = {i for i, _ in failures}
        missing = [i for i in range(n) if totals[i] is None and i not in failed]
        if missing:
            first = missing[0]
            where = describe_sample(first, n, examples[first], completions[first])
            if status == "timeout":
                why = (f"the reward did not finish within task.reward_timeout_s="
                       f"{self.timeout_s:g} s ({len(missing)} sample(s) unscored)")
                self._fail(where, why, "timeout", count=len(missing))
            else:
                why = fatal[0] if fatal else "the reward worker process died"
                self._fail(where, why, "error", count=len(missing))
        out = [t if t is not None else 0.0 for t in totals]
        if self.learned is not None and n:
            out = self._learned_totals(examples, completions, out, comps)
        names = sorted({k for c in comps for k in c})
        self.last_components = {k: [c.get(k, 0.0) for c in comps] for k in names}
        for k, v in self.last_components.items():
            self._sums[k] = self._sums.get(k, 0.0) + sum(v)
        self._count += n
        return out

    def _learned_totals(self, examples, completions, gold: List[float],
                        comps: List[Dict[str, float]]) -> List[float]:
        """The training totals with the reward models' scores; ``comps`` gains their raw
        scores (and, for a task without named rewards, its own total as reward/<its name>)."""
        self._last_gold = list(gold)
        own = str(getattr(self.task, "reward_name", None) or "task")
        for g, c in zip(gold, comps):
            if not c:
                c[own] = g
        proxy, raw = self.learned.score(examples, completions, update=self._owns_norm)
        totals = []
        for i, p in enumerate(proxy):
            if not math.isfinite(p):
                self._fail(describe_sample(i, len(proxy), examples[i], completions[i]),
                           f"the reward model's score is {p}", "error")
                p = 0.0
            totals.append(p if self.learned.replace_task else gold[i] + p)
        for name, values in raw.items():
            for c, v in zip(comps, values):
                c[name] = v
        return totals

    def _fail(self, where: str, why: str, kind: str, count: int = 1) -> None:
        if self.on_error == "raise":
            self.close()
            what = "timed out" if kind == "timeout" else "failed"
            raise RewardError(f"reward {what} on {where}: {why} "
                              "(task.on_reward_error=zero scores such samples 0 instead)")
        if kind == "timeout":
            self.timeouts += count
        else:
            self.errors += count
        if self._warned < 3:
            self._warned += 1
            log.warning("reward %s on %s: %s; scored 0", "timed out" if kind == "timeout"
                        else "failed", where, why)

    def correct_batch(self, examples: Sequence[Example], completions: Sequence[str],
                      rewards: Sequence[float]) -> List[bool]:
        """Eval correctness: from the total reward where the task defines it that way
        (data tasks: reward >= task.correct_threshold; no user code runs again), else
        ``task.is_correct``."""
        from_reward = getattr(self.task, "correct_from_reward", None)
        if self.learned is not None and len(self._last_gold) == len(rewards):
            rewards = self._last_gold       # the task's own reward, not the proxy
        if from_reward is not None:
            return [bool(from_reward(ex, r)) for ex, r in zip(examples, rewards)]
        return [bool(self.task.is_correct(ex, c)) for ex, c in zip(examples, completions)]

    def metrics(self) -> Dict[str, float]:
        """reward/errors and reward/timeouts (cumulative counts) and reward/<name>: each
        named reward's mean over the samples scored since the previous ``metrics()`` call
        (a failed sample counts 0). Resets those means."""
        out = {"reward/errors": float(self.errors), "reward/timeouts": float(self.timeouts)}
        for k, v in self._sums.items():
            out[f"reward/{k}"] = v / max(self._count, 1)
        self._sums, self._count = {}, 0
        return out

    def state(self) -> Dict[str, Any]:
        """The counters (and the running reward statistics this scorer owns), for a
        checkpoint (``load_state`` restores them)."""
        state = {"errors": self.errors, "timeouts": self.timeouts, "calls": self.calls}
        if self._owns_norm:
            state["reward_norm"] = self.learned.state()
        return state

    def load_state(self, state: Dict[str, Any]) -> None:
        if self._owns_norm and "reward_norm" in state:
            self.learned.load_state(state["reward_norm"])
        self.errors = int(state.get("errors", 0))
        self.timeouts = int(state.get("timeouts", 0))
        self.calls = int(state.get("calls", 0))

    def close(self) -> None:
        self._runner.close()

    def __enter__(self) -> "RewardScorer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):  # best effort; the worker is a daemon anyway
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass
