"""Environment calls run concurrently, each under a time limit, none able to hang the run.

``run_calls(calls, timeout_s, concurrency)`` runs the zero-argument callables ``calls``
(an episode's ``env.reset`` / ``env.step``), at most ``concurrency`` at once, and returns
one ``Outcome`` per call, in order: its value, or the exception it raised, or a timeout
when it ran past ``timeout_s`` seconds (measured from its own start).

Each call runs in a daemon thread of its own (started as a slot frees, so ``concurrency``
bounds the running calls). A thread cannot be stopped, so a call past its deadline is
abandoned: it keeps running in the background, its slot is given to the next call, and,
being a daemon, it never blocks the interpreter's exit (``concurrent.futures`` joins its
workers at exit, so a step that loops forever would hang it; that is why its pool is not
used). The caller must not touch an environment whose call is still running: ``busy``
says whether it is.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence


@dataclass
class Outcome:
    """What one call gave: ``value``, or ``error`` (an exception, or a timeout)."""
    value: Any = None
    error: Optional[BaseException] = None
    timed_out: bool = False
    thread: Optional[threading.Thread] = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def busy(self) -> bool:
        """Whether the call is still running (abandoned past its deadline)."""
        return self.thread is not None and self.thread.is_alive()


class StepTimeout(TimeoutError):
    pass


def run_calls(calls: Sequence[Callable[[], Any]], timeout_s: float, concurrency: int
              ) -> List[Outcome]:
    """Run ``calls`` (see the module docstring); returns one Outcome per call, in order."""
    outcomes = [Outcome() for _ in calls]
    done: "queue.Queue[int]" = queue.Queue()
    started, running = 0, {}                    # running: index -> deadline
    while started < len(calls) or running:
        while started < len(calls) and len(running) < max(1, concurrency):
            i = started
            outcomes[i].thread = threading.Thread(target=_call, args=(calls[i], outcomes[i], done, i),
                                                  daemon=True, name=f"rlctl-env-{i}")
            running[i] = time.monotonic() + timeout_s
            outcomes[i].thread.start()
            started += 1
        try:
            i = done.get(timeout=max(0.0, min(running.values()) - time.monotonic()))
            running.pop(i, None)
        except queue.Empty:
            now = time.monotonic()
            for i in [i for i, deadline in running.items() if deadline <= now]:
                del running[i]               # abandoned: its thread may run on
                outcomes[i].timed_out = True
                outcomes[i].error = StepTimeout(f"no answer within {timeout_s:g} s")
    return outcomes


def _call(fn: Callable[[], Any], outcome: Outcome, done: "queue.Queue[int]", i: int) -> None:
    try:
        value = fn()
        if not outcome.timed_out:
            outcome.value = value
    except BaseException as exc:  # noqa: BLE001 - any failure of user code is an outcome
        if not outcome.timed_out:
            outcome.error = exc
    done.put(i)
