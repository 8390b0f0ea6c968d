"""Scoring completions with a task's reward(s), in a forked worker under a time limit."""
from __future__ import annotations

import logging
import math
import multiprocessing
import os
import signal
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from rlctl.errors import RewardError
from rlctl.tasks.task import ON_REWARD_ERROR, RAW_PROMPT, assistant_text, task_options
from rlctl.types import Example

log = logging.getLogger(__name__)
FROM_TASK = object()  # RewardScorer's default: the task's own reward_timeout_s


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


def score_stream(task, examples: Sequence[Example], completions: Sequence[str]
                 ) -> Iterator[Tuple]:
    """("ok", i, total, components) or ("err", i, message) for each sample, in order; a
    task's ``reward_components_batch`` first, sample by sample if it raises (to name one)."""
    batch_fn = getattr(task, "reward_components_batch", None)
    if batch_fn is not None and len(examples) > 1 and getattr(task, "score_in_batches", True):
        try:
            parsed = [{str(k): float(v) for k, v in r.items()}
                      for r in batch_fn(list(examples), list(completions))]
        except Exception:  # noqa: BLE001 - retried per sample below, to name the culprit
            parsed = []
        if len(parsed) == len(examples):   # else (or a wrong count) per sample below
            yield from (("ok", i, _total(task, comps), comps) for i, comps in enumerate(parsed))
            return
    comp_fn = getattr(task, "reward_components", None)
    for i, (ex, c) in enumerate(zip(examples, completions)):
        try:
            if comp_fn is None:
                total, comps = float(task.reward(ex, c)), {}
            else:
                comps = {str(k): float(v) for k, v in comp_fn(ex, c).items()}
                total = _total(task, comps)
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
            # it holds copies of the parent's descriptors: it leaves when the parent dies
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


class InlineRunner:
    """Scores in this process; ``run``: (``score_stream`` items, None/"timeout"/"died")."""

    def __init__(self, task):
        self.task = task

    def run(self, examples, completions, timeout_s) -> Tuple[List[Tuple], Optional[str]]:
        return list(score_stream(self.task, examples, completions)), None

    def close(self) -> None:
        pass


class ProcessRunner(InlineRunner):
    """One forked worker, kept between batches, killed at a deadline."""

    def __init__(self, task):
        self.task, self.proc, self.conn = task, None, None

    def run(self, examples, completions, timeout_s: float) -> Tuple[List[Tuple], Optional[str]]:
        if self.proc is None or not self.proc.is_alive():
            self.close()
            ctx = multiprocessing.get_context("fork")
            self.conn, child = ctx.Pipe()
            self.proc = ctx.Process(target=_worker_main, args=(self.task, child, os.getpid()),
                                    daemon=True, name="rlctl-reward")
            self.proc.start()
            child.close()
        deadline, items = time.monotonic() + timeout_s, []
        try:
            self.conn.send((list(examples), list(completions)))
            while True:
                remaining = deadline - time.monotonic()
                if not (remaining > 0 and self.conn.poll(remaining)):
                    self.close()
                    return items, "timeout"
                msg = self.conn.recv()
                if msg[0] == "done":
                    return items, None
                items.append(msg)
        except (EOFError, OSError, ValueError):
            self.close()
            return items, "died"

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.is_alive():
                self.proc.kill()
            self.proc.join(5)
            self.proc = None
        if self.conn is not None:
            self.conn.close()
            self.conn = None


class RewardScorer:
    """Scores batches with the task's reward(s), ``on_reward_error`` zero (counted in ``errors``
    or ``timeouts``) or raise (``RewardError``); ``markers`` (chat): the task sees the reply only;
    ``learned``: reward models scored after the task (the first scorer owns their statistics)."""

    def __init__(self, task, learned=None, markers: Optional[Sequence[str]] = None, timeout_s: Any = FROM_TASK,
                 on_error: Optional[str] = None, norm_owner: Optional[bool] = None):
        opts = task_options(task)
        self.task, self.markers, self.learned = task, markers, learned
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
        # norm_owner None: the first scorer (training's) updates the statistics; False: never
        self._owns_norm = (self.learned.claim(self) if norm_owner is None else norm_owner) \
            if self.learned is not None else False
        self._last_gold: List[float] = []     # the task's own totals of the last batch
        self.last_raw_totals: List[float] = []   # the last batch's totals, models' raw scores
        self._runner = ProcessRunner(task) if self.timeout_s else InlineRunner(task)

    def __call__(self, example: Example, completion: str) -> float:
        return self.score_batch([example], [completion])[0]

    def score_batch(self, examples: Sequence[Example], completions: Sequence[str]
                    ) -> List[float]:
        t0, n = time.perf_counter(), len(examples)
        if len(completions) != n:
            raise ValueError(f"{n} examples but {len(completions)} completions")
        self.calls += n
        replies = completions if self.markers is None else [
            assistant_text(c, self.markers, ex.prompt) for ex, c in zip(examples, completions)]
        items, status = self._runner.run(examples, replies, self.timeout_s) if n else ([], None)
        totals: List[Optional[float]] = [None] * n
        comps: List[Dict[str, float]] = [{} for _ in range(n)]
        failed, fatal = set(), None
        for msg in items:
            if msg[0] == "fatal":
                fatal = fatal or msg[1]
                continue
            i, why = msg[1], msg[2] if msg[0] == "err" else f"the reward is {msg[2]}"
            if msg[0] == "ok" and math.isfinite(msg[2]):
                totals[i], comps[i] = msg[2], msg[3]
                continue
            failed.add(i)
            self._fail(describe_sample(i, n, examples[i], completions[i]), why, "error")
        missing = [i for i in range(n) if totals[i] is None and i not in failed]
        if missing:
            where = describe_sample(missing[0], n, examples[missing[0]], completions[missing[0]])
            if status == "timeout":
                why = (f"the reward did not finish within task.reward_timeout_s="
                       f"{self.timeout_s:g} s ({len(missing)} sample(s) unscored)")
                self._fail(where, why, "timeout", count=len(missing))
            else:
                self._fail(where, fatal or "the reward worker process died", "error",
                           count=len(missing))
        out = [t if t is not None else 0.0 for t in totals]
        self.last_raw_totals = list(out)
        if self.learned is not None and n:
            out = self._learned_totals(examples, completions, out, comps)
        names = sorted(set().union(*comps))
        self.last_components = {k: [c.get(k, 0.0) for c in comps] for k in names}
        for k, v in self.last_components.items():
            self._sums[k] = self._sums.get(k, 0.0) + sum(v)
        self._count += n
        self.seconds += time.perf_counter() - t0
        return out

    def _learned_totals(self, examples, completions, gold: List[float],
                        comps: List[Dict[str, float]]) -> List[float]:
        """The training totals with the reward models' scores; ``comps`` gains their raw
        scores (and, for a task without named rewards, its own total as reward/<its name>)."""
        self._last_gold = list(gold)
        own = str(getattr(self.task, "reward_name", None) or "task")
        for g, c in zip(gold, comps):
            if not c and self.has_gold:
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
        weights = {m.name: m.weight for m in self.learned.models}
        self.last_raw_totals = [(0.0 if self.learned.replace_task else gold[i])
                                + sum(weights[k] * raw[k][i] for k in raw)
                                for i in range(len(totals))]
        return totals

    @property
    def has_gold(self) -> bool:
        """False for a data task scored by reward models alone: no reward/<task>, no correctness."""
        rewards = getattr(self.task, "rewards", None)
        return not (self.learned is not None and isinstance(rewards, list) and not rewards)

    @property
    def shapes(self) -> bool:
        """Training totals differ from the raw ones (task.reward_norm or task.reward_clip)."""
        return self.learned is not None and (self.learned.norm != "none"
                                             or self.learned.clip is not None)

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
        """Eval correctness: the task's ``correct_from_reward`` on its own total (no user code
        runs again), else ``task.is_correct``."""
        from_reward = getattr(self.task, "correct_from_reward", None)
        if self.learned is not None and len(self._last_gold) == len(rewards):
            rewards = self._last_gold       # the task's own reward, not the proxy
        if from_reward is not None:
            return [bool(from_reward(ex, r)) for ex, r in zip(examples, rewards)]
        if self.markers is not None:
            completions = [assistant_text(c, self.markers, ex.prompt)
                           for ex, c in zip(examples, completions)]
        return [bool(self.task.is_correct(ex, c)) for ex, c in zip(examples, completions)]

    def metrics(self) -> Dict[str, float]:
        """reward/errors and reward/timeouts (cumulative counts) and reward/<name>: each
        named reward's mean since the previous call (a failed sample counts 0)."""
        out = {"reward/errors": float(self.errors), "reward/timeouts": float(self.timeouts)}
        sums, count = self.named_sums()
        for k, v in sums.items():
            out[f"reward/{k}"] = v / max(count, 1)
        return out

    def named_sums(self) -> Tuple[Dict[str, float], int]:
        """(each named reward's sum since the previous call, how many samples); resets both."""
        out = (self._sums, self._count)
        self._sums, self._count = {}, 0
        return out

    def state(self) -> Dict[str, Any]:
        """The counters (and the running reward statistics it owns), for a checkpoint."""
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
