"""Scoring completions with a task's reward(s): batches under a time limit, the error
policy (``task.on_reward_error``), and per-reward components for ``reward/<name>``.

Split from ``rlctl.tasks.base`` (which re-exports these names); the runners that keep
the time limit are in ``rlctl.tasks.reward_runners``.
"""
from __future__ import annotations

import logging
import math
import multiprocessing
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from rlctl.errors import RewardError
from rlctl.tasks.base import ON_REWARD_ERROR, assistant_text, task_options
from rlctl.tasks.reward_runners import (InlineRunner, ProcessRunner, ThreadRunner,
                                        describe_sample)
from rlctl.types import Example

log = logging.getLogger(__name__)


FROM_TASK = object()  # RewardScorer's default: the task's own reward_timeout_s


class RewardScorer:
    """Scores batches with the task's reward(s) under ``task.reward_timeout_s``.

    ``score_batch`` never raises with ``on_reward_error=zero``: a sample whose reward
    raised or is not finite scores 0 and counts in ``errors``; samples left unscored at
    the deadline score 0 and count in ``timeouts`` (and a warning names the sample). With
    ``on_reward_error=raise`` either raises ``RewardError`` naming the sample.
    ``last_components`` holds each named reward of the last batch, one value per sample
    (``reward/<name>`` in the logs; ``metrics()`` gives the means).

    ``markers``: chat end-of-turn markers (``rlctl.tasks.prompt_budget.Prepared``; None
    for raw prompts): the task's ``reward``/``is_correct`` then see the assistant's reply only
    (``assistant_text``), the reward models and the logged samples the whole completion.

    ``learned``: reward models (``rlctl.reward_models.learned.LearnedRewards``) that score
    the whole batch in this process, after the task's own rewards: their raw scores join the
    components, their shaped scores the total (with ``task.reward_model`` the total is
    theirs alone: the task's rewards are logged, and eval correctness still comes from
    them). The first scorer built with them updates the running reward statistics and
    carries them in ``state()``; later ones (eval) read them.
    """

    def __init__(self, task, learned=None, markers: Optional[Sequence[str]] = None, timeout_s: Any = FROM_TASK,
                 on_error: Optional[str] = None, norm_owner: Optional[bool] = None):
        opts = task_options(task)
        self.task, self.markers = task, markers
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
        self.learned = learned
        # norm_owner None: the first scorer of the reward models (training's) updates the running
        # statistics; False: never (held-out scoring reads them: `rlctl eval`, `rollout`)
        self._owns_norm = (self.learned.claim(self) if norm_owner is None else norm_owner) \
            if self.learned is not None else False
        self._last_gold: List[float] = []     # the task's own totals of the last batch
        self.last_raw_totals: List[float] = []   # the last batch's totals, models' raw scores
        if not self.timeout_s:
            self._runner = InlineRunner(task)
        elif "fork" in multiprocessing.get_all_start_methods():
            self._runner = ProcessRunner(task)
        else:
            self._runner = ThreadRunner(task)

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

        replies = self._replies(examples, completions)
        status = self._runner.run(examples, replies, self.timeout_s, on_item) if n else None
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
        self.last_raw_totals = list(out)
        if self.learned is not None and n:
            out = self._learned_totals(examples, completions, out, comps)
        names = sorted({k for c in comps for k in c})
        self.last_components = {k: [c.get(k, 0.0) for c in comps] for k in names}
        for k, v in self.last_components.items():
            self._sums[k] = self._sums.get(k, 0.0) + sum(v)
        self._count += n
        return out

    def _replies(self, examples: Sequence[Example], completions: Sequence[str]) -> Sequence[str]:
        """What the task's own rewards see: with chat markers, the assistant's reply only."""
        if self.markers is None:
            return completions
        return [assistant_text(c, self.markers, ex.prompt) for ex, c in zip(examples, completions)]

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
        """False for a task with no reward of its own: a data task scored by reward models
        alone (no reward function, ``rewards == []``), whose own total would read 0 for
        every sample; then no reward/<task> component and no correctness are reported."""
        rewards = getattr(self.task, "rewards", None)
        return not (self.learned is not None and isinstance(rewards, list) and not rewards)

    @property
    def shapes(self) -> bool:
        """True when training totals differ from the raw ones (task.reward_norm or
        task.reward_clip on the reward models' scores)."""
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
        """Eval correctness: from the total reward where the task defines it that way
        (data tasks: reward >= task.correct_threshold; no user code runs again), else
        ``task.is_correct``."""
        from_reward = getattr(self.task, "correct_from_reward", None)
        if self.learned is not None and len(self._last_gold) == len(rewards):
            rewards = self._last_gold       # the task's own reward, not the proxy
        if from_reward is not None:
            return [bool(from_reward(ex, r)) for ex, r in zip(examples, rewards)]
        return [bool(self.task.is_correct(ex, c))
                for ex, c in zip(examples, self._replies(examples, completions))]

    def metrics(self) -> Dict[str, float]:
        """reward/errors and reward/timeouts (cumulative counts) and reward/<name>: each
        named reward's mean over the samples scored since the previous ``metrics()`` call
        (a failed sample counts 0). Resets those means."""
        out = {"reward/errors": float(self.errors), "reward/timeouts": float(self.timeouts)}
        sums, count = self.named_sums()
        for k, v in sums.items():
            out[f"reward/{k}"] = v / max(count, 1)
        return out

    def named_sums(self) -> Tuple[Dict[str, float], int]:
        """(each named reward's sum over the samples scored since the previous call, how
        many samples that is); resets both. ``metrics`` gives their means; the trainer
        pools them over ranks (``rlctl.learner.trainer.named_reward_metrics``)."""
        out = (self._sums, self._count)
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
