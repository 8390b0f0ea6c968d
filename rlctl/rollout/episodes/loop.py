"""The episode loop (docs/agents.md): B examples x G episodes played with the policy, as one
RolloutBatch: first observation left-padded to P, transcript right-padded to T, ``mask`` 1 on
model tokens, rewards placed by ``rollout.episode.turn_reward`` (``core.turns``)."""
from __future__ import annotations

import contextlib
import functools
import logging
import queue
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch

from rlctl.config.schema import EpisodeConfig, RolloutConfig
from rlctl.core.turns import place_turn_rewards
from rlctl.envs.environment import step_flag, step_reward
from rlctl.errors import TrainingFault, one_line
from rlctl.models.stop_ids import resolve_stop_ids
from rlctl.models.value import PolicyValueModel
from rlctl.rollout.episodes.kv import turn_sampler
from rlctl.rollout.episodes.text import (ERROR_OBSERVATION, EpisodeText, stop_string_cut,
                                        stop_strings, uses_chat)
from rlctl.rollout.source import SEED_RANGE, SyncSource
from rlctl.tasks.task import RAW_PROMPT, task_options
from rlctl.tasks.prompt_budget import context_length
from rlctl.types import (DONE, LENGTH_LIMIT, MODEL, OBSERVATION, TOKEN_LIMIT, TURN_LIMIT, Episode,
                         EpisodePart, Example, LogProbs, RolloutBatch, Span, Step, Turn)

log = logging.getLogger(__name__)
_SAID: Set[Tuple[str, str, str]] = set()     # (environment, call, kind) already said


class EpisodePlayer:
    """Plays a task's rows as episodes: ``play(model, examples, seed)`` -> RolloutBatch."""

    def __init__(self, tokenizer, task, rollout: RolloutConfig, group_size: int,
                 stops: Sequence[int]):
        opts, ep = task_options(task), rollout.episode
        self.tokenizer, self.task, self.stops = tokenizer, task, tuple(stops)
        self.rollout, self.episode, self.group_size = rollout, ep, group_size
        self.text = EpisodeText(tokenizer, uses_chat(tokenizer, opts.prompt_format),
                                opts.system_prompt, ep.max_obs_tokens, ep.obs_truncation)

    @functools.cached_property
    def tool_task(self) -> bool:
        """Whether the task's environment offers tools (a fresh one asked once; a failure: False)."""
        out = run_calls([self.task.make_env], self.episode.step_timeout_s, 1)[0]
        if not out.ok:
            return False
        env = out.value
        tools = getattr(env, "tools", None) and getattr(env, "use_tools", True) is not False
        _close([EpisodeRun(env, "", [], [])], self.episode.step_timeout_s)
        return bool(tools)

    def play(self, model, examples: Sequence[Example], seed: int, greedy: bool = False,
             group_size: Optional[int] = None) -> RolloutBatch:
        """G episodes of each example played with ``model``; ``greedy`` for eval."""
        if isinstance(model, PolicyValueModel):     # sample from the LM alone
            model = model.policy
        ep, G = self.episode, group_size or self.group_size
        rows = [_as_written(ex) for ex in examples for _ in range(G)]
        runs = _reset(self.task.make_env, rows, [seed + i // G for i in range(len(rows))], ep,
                      self.text)
        steps = failed = 0
        budget, weight = _Budget(ep.max_tokens, context_length(model)), next(model.parameters())
        # greedy draws (top-k 1) leave the training's RNG streams as they were
        rng = torch.random.fork_rng(devices=[weight.device] if weight.is_cuda else []) \
            if greedy else contextlib.nullcontext()
        try:
            with rng:
                sampler = turn_sampler(model, _pad_id(self.tokenizer, self.stops), ep.kv_reuse)
                while active := [r for r in runs if not r.ended and not budget.exhausted(r)]:
                    stepping = _model_turns(sampler, self.tokenizer, active, self.rollout,
                                            self.stops, greedy, budget, self.text)
                    n, bad = _step(stepping, ep, self.text, budget)
                    steps, failed = steps + n, failed + bad
        finally:
            _close(runs, ep.step_timeout_s)
        if failed * 2 > steps and not greedy:          # a training batch (eval is greedy)
            log.warning("%d of %d environment steps of this batch failed (episode/env_errors; "
                        "each kind of failure is said once, when first seen)", failed, steps)
        return episode_batch(runs, self.tokenizer, ep.turn_reward, ep.turn_discount, G, self.stops,
                             weight.device,
                             torch.float64 if weight.dtype == torch.float64 else torch.float32)


def _pad_id(tokenizer, stops: Sequence[int]) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else int(stops[0])


def _as_written(example: Example) -> Example:
    """The row with the prompt the task wrote (the player renders chat itself)."""
    raw = example.fields.get(RAW_PROMPT)
    return example if raw is None else Example(prompt=raw, fields=example.fields)


class _Budget:
    """Tokens an episode may still take: its budget and the model's context."""

    def __init__(self, max_tokens: int, context: Optional[int]):
        self.max_tokens, self.context = max_tokens, context

    def left(self, r: EpisodeRun) -> Tuple[int, str]:
        """(tokens left, the status of running out)."""
        tokens = self.max_tokens - len(r.ids)
        if self.context is None:
            return tokens, TOKEN_LIMIT
        ctx = self.context - len(r.prompt_ids) - len(r.ids)
        return (ctx, LENGTH_LIMIT) if ctx < tokens else (tokens, TOKEN_LIMIT)

    def exhausted(self, r: EpisodeRun) -> bool:
        left, status = self.left(r)
        if left <= 0 and not r.ended:
            r.end(status)
        return r.ended


def _reset(make_env, rows: Sequence[Example], seeds: Sequence[int], ep: EpisodeConfig,
           text: EpisodeText) -> List[EpisodeRun]:
    """A fresh environment per row, made and reset under the step time limit; a failure
    stops the run in one line naming the episode, the environment and the call."""
    envs: List[List[Any]] = [[] for _ in rows]      # each filled by its call once made
    calls = [functools.partial(_start, make_env, slot, ex, s)
             for slot, ex, s in zip(envs, rows, seeds)]
    outs = run_calls(calls, ep.step_timeout_s, ep.concurrency)
    for i, out in enumerate(outs):
        if not out.ok or not isinstance(out.value, str):
            why = _why(out, ep.step_timeout_s) if not out.ok else \
                f"returned {type(out.value).__name__}, not the first observation's text"
            call = f"reset() of {type(envs[i][0]).__name__}" if envs[i] else "task.make_env()"
            raise TrainingFault(f"environment {call} failed for episode {i}: {why}")
    envs = [e[0] for e in envs]
    runs = []
    for env, out in zip(envs, outs):
        prompt, ids, messages = text.first(out.value)
        runs.append(EpisodeRun(env=env, prompt=prompt, prompt_ids=ids, messages=messages))
    return runs


def _start(make_env, slot: List[Any], example: Example, seed: int) -> Any:
    slot.append(make_env())
    return slot[0].reset(example, seed)


def _close(runs: List[EpisodeRun], timeout_s: float) -> None:
    """``close()`` of each environment that has one and no call still running, all at once,
    each within ``timeout_s``: a raise or a timeout is an env error of its episode."""
    todo = [r for r in runs if callable(getattr(r.env, "close", None))
            and (r.last is None or not r.last.busy())]    # never close one a thread still runs in
    for r, out in zip(todo, run_calls([r.env.close for r in todo], timeout_s, len(todo))):
        if not out.ok:
            _fail(r, "close()", _kind(out), _why(out, timeout_s))


def _fail(r: EpisodeRun, call: str, kind: str, why: str) -> None:
    """Count an env error of ``r``; its first of (environment, call, kind) is said in one line."""
    r.episode.env_errors += 1
    key = (type(r.env).__name__, call, kind)
    if key not in _SAID:
        _SAID.add(key)
        log.warning("environment %s: %s %s (counted in episode/env_errors; said once)",
                    key[0], call, why)


def _kind(out: Outcome) -> str:
    return "timeout" if out.timed_out else type(out.error).__name__


def _why(out: Outcome, timeout_s: float) -> str:
    if out.timed_out:
        return f"gave no answer within {timeout_s:g} s (rollout.episode.step_timeout_s); abandoned"
    return f"raised {type(out.error).__name__}: {one_line(out.error)[:200]}"


def _model_turns(sampler, tokenizer, active: List[EpisodeRun], ro: RolloutConfig,
                 stops: Sequence[int], greedy: bool, budget: _Budget, text: EpisodeText
                 ) -> List[EpisodeRun]:
    """One model turn for each of ``active`` -> those to step (a turn cut by a budget ends it)."""
    rooms = [min(ro.max_new_tokens, budget.left(r)[0]) for r in active]
    new, logps = sampler([id(r) for r in active], [r.prompt_ids + r.ids for r in active],
                         max(rooms), 1.0 if greedy else ro.temperature,
                         1 if greedy else ro.top_k, stops)
    stepping, stop_set = [], set(int(s) for s in stops)
    for r, room, ids, lp in zip(active, rooms, new, logps):
        k = next((j + 1 for j, t in enumerate(ids) if t in stop_set), len(ids))
        k = min(k, room)
        by_string = stop_string_cut(tokenizer, ids[:k], r.stop_strings)
        k = by_string or k
        turn = ids[:k]
        r.episode.spans.append(Span(MODEL, len(r.ids), len(r.ids) + k, text.turn_text(turn, stop_set)))
        r.ids += turn
        r.logps += lp[:k]
        r.cut = by_string is None and turn[-1] not in stop_set    # a length limit ended it
        finished = not r.cut or k == ro.max_new_tokens
        if finished:
            stepping.append(r)
        else:                               # cut by the episode's budget: not stepped
            r.episode.turn_rewards.append(0.0)
            r.end(budget.left(r)[1])
    return stepping


def _step(runs: List[EpisodeRun], ep: EpisodeConfig, text: EpisodeText, budget: _Budget
          ) -> Tuple[int, int]:
    """Step the environments of ``runs`` with their last turns, concurrently -> (steps, failed)."""
    todo = [r for r in runs if r.last is None or not r.last.busy()]
    calls = [functools.partial(r.env.step, Turn(r.episode.spans[-1].text,
                                                r.ids[r.episode.spans[-1].start:]))
             for r in todo]
    outs = dict(zip(map(id, todo), run_calls(calls, ep.step_timeout_s, ep.concurrency)))
    failed = 0
    for r in runs:
        out, errors = outs.get(id(r)), r.episode.env_errors
        if out is not None:
            r.last = out
        _apply(r, _stepped(r, out, ep.step_timeout_s), ep, text, budget)
        failed += r.episode.env_errors > errors
    return len(runs), failed


def _stepped(r: EpisodeRun, out: Optional[Outcome], timeout_s: float) -> Step:
    """The Step a call returned, else the error observation (the failure counted and said)."""
    if out is not None and out.ok and isinstance(out.value, Step):
        return out.value
    if out is None:
        _fail(r, "step()", "busy", "not called: its previous step is still running past the "
              "time limit")
    elif not out.ok:
        _fail(r, "step()", _kind(out), _why(out, timeout_s))
    elif isinstance(out.value, tuple) and len(out.value) in (4, 5):
        _fail(r, "step()", "tuple", f"returned a {len(out.value)}-tuple (gym's API); a step "
              "must return rlctl.types.Step(observation, reward, done, info) (docs/agents.md)")
    else:
        _fail(r, "step()", "type", f"returned {type(out.value).__name__}; a step must return "
              "rlctl.types.Step(observation, reward, done, info) (docs/agents.md)")
    return Step(observation=ERROR_OBSERVATION)


def _apply(r: EpisodeRun, step: Step, ep: EpisodeConfig, text: EpisodeText,
           budget: _Budget) -> None:
    info = _info(r, step.info)
    reward = _checked(r, step_reward, step.reward, 0.0)   # None, text, NaN, inf in float32: 0
    r.episode.spans[-1].reward = reward
    r.episode.turn_rewards.append(reward)
    r.episode.tool_calls += int(info.get("tool_calls", 0) or 0)
    r.episode.tool_errors += int(info.get("tool_errors", 0) or 0)
    if "success" in info:
        r.episode.success = _checked(r, functools.partial(step_flag, 'info["success"]'),
                                     info["success"], r.episode.success)
    r.stop_strings = stop_strings(info)
    if _checked(r, functools.partial(step_flag, "done"), step.done, False):
        return r.end(DONE)
    if r.episode.turns >= ep.max_turns:
        return r.end(TURN_LIMIT)
    if step.observation is None:
        return None                                   # the model writes again
    if not isinstance(step.observation, str):         # not text: an error, like a bad Step
        _fail(r, "step()", "observation", f"returned observation "
              f"{type(step.observation).__name__}, not text or None")
        step = Step(observation=ERROR_OBSERVATION)
    turn = r.episode.spans[-1]
    ids, cut, kept = text.observation(step.observation, r.prompt_ids + r.ids, r.messages, turn.text)
    left = max(budget.left(r)[0], 0)
    if left == 0:                                     # no room: the episode ends, no empty span
        return r.end(budget.left(r)[1])
    if len(ids) > left:                               # the episode's budget cuts it too
        ids, cut = (ids[:left] if ep.obs_truncation == "right" else ids[len(ids) - left:]), True
    r.episode.spans.append(Span(OBSERVATION, len(r.ids), len(r.ids) + len(ids), kept,
                                truncated=cut))
    r.ids += ids
    r.logps += [0.0] * len(ids)


def _is_count(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0 \
        and float(x).is_integer()


def _is_stop(x) -> bool:
    return isinstance(x, str) or isinstance(x, (list, tuple)) and all(isinstance(s, str) for s in x)


_INFO_FIELDS = (("tool_calls", _is_count, "a count (an integer >= 0)"),
                ("tool_errors", _is_count, "a count (an integer >= 0)"),
                ("stop", _is_stop, "a string or a list of strings"))


def _info(r: EpisodeRun, info) -> Dict[str, Any]:
    """``info`` without the fields of a wrong type, each an env error naming the field."""
    if not isinstance(info, dict):
        if info is not None:
            _fail(r, "step()", "info", f"returned info {type(info).__name__}, not a dict (ignored)")
        return {}
    info = dict(info)
    for key, fits, what in _INFO_FIELDS:
        if info.get(key) is not None and not fits(info[key]):
            _fail(r, "step()", f"info.{key}", f"returned info['{key}'] = "
                  f"{one_line(repr(info.pop(key)))[:80]}, not {what} (ignored)")
    return info


def _checked(r: EpisodeRun, check: Callable[[Any], Any], value, default):
    """``check(value)``; a ValueError is a counted env error naming the field, ``default``."""
    try:
        return check(value)
    except ValueError as exc:
        _fail(r, "step()", str(exc).split(" must ")[0], f"returned {exc} (ignored)")
        return default


class EpisodeSource(SyncSource):
    """LocalSource's multi-turn twin: B rows x G episodes per ``sample``, played with ``policy``."""

    def __init__(self, policy, tokenizer, prepared, rollout: RolloutConfig, group_size: int,
                 seed: int):
        self.policy, self.tokenizer, self.task = policy, tokenizer, prepared.task
        self.examples = list(prepared.train)
        self.prompt_rng = random.Random(seed)
        self.stops = resolve_stop_ids(policy, tokenizer, tuple(rollout.stop_token_ids or ()))
        self.player = EpisodePlayer(tokenizer, prepared.task, rollout, group_size, self.stops)
        self.scorer = prepared.scorer(timeout_s=0)     # counters only: rewards are the env's

    def sample(self, num_groups: int) -> RolloutBatch:
        examples = [self.examples[i] for i in self.draw(num_groups)]
        return self.player.play(self.policy, examples, self.prompt_rng.randrange(SEED_RANGE))


@dataclass
class EpisodeRun:
    """One episode in play."""
    env: Any
    prompt: str
    prompt_ids: List[int]
    messages: List[Dict[str, str]]
    ids: List[int] = field(default_factory=list)        # the transcript (completion columns)
    logps: List[float] = field(default_factory=list)    # per transcript column (0 on observations)
    episode: Episode = field(default_factory=Episode)
    stop_strings: Tuple[str, ...] = ()
    ended: bool = False
    cut: bool = False            # its last model turn ended at a length limit, not a stop
    last: Optional[Outcome] = None                      # the last env call (busy if abandoned)

    def end(self, status: str) -> None:
        self.episode.status, self.ended = status, True


def episode_batch(runs: List[EpisodeRun], tokenizer, turn_reward: str, turn_discount: float,
                  G: int, stops: Sequence[int], device, logp_dtype: torch.dtype = torch.float32
                  ) -> RolloutBatch:
    """The played episodes as a RolloutBatch (module docstring; log-probs 0 off model tokens)."""
    N, pad = len(runs), _pad_id(tokenizer, stops)
    P = max(len(r.prompt_ids) for r in runs)
    T = max(1, max(len(r.ids) for r in runs))           # at least one column
    input_ids = torch.full((N, P + T), pad, dtype=torch.long)                      # [N, P+T]
    attention = torch.zeros(N, P + T, dtype=torch.long)                            # [N, P+T]
    mask = torch.zeros(N, T)                                                       # [N, T]
    old = torch.zeros(N, T, dtype=torch.float64)                                   # [N, T]
    for i, r in enumerate(runs):
        p, t = len(r.prompt_ids), len(r.ids)
        input_ids[i, P - p:P] = torch.tensor(r.prompt_ids, dtype=torch.long)
        input_ids[i, P:P + t] = torch.tensor(r.ids, dtype=torch.long)
        attention[i, P - p:P + t] = 1
        old[i, :t] = torch.tensor(r.logps, dtype=torch.float64)
        for s in r.episode.spans:
            if s.role == MODEL:
                mask[i, s.start:s.end] = 1.0
    ends = [[s.end - 1 for s in r.episode.spans if s.role == MODEL] for r in runs]
    behaviour = (old * mask.double()).to(device, logp_dtype)                         # [N, T]
    rewards, token_rewards = place_turn_rewards([r.episode.turn_rewards for r in runs], ends, T,
                                                turn_reward, turn_discount)
    return RolloutBatch(
        input_ids=input_ids.to(device), attention_mask=attention.to(device), mask=mask.to(device),
        truncated=torch.tensor([r.cut for r in runs], device=device),
        rewards=rewards.to(device), group_ids=torch.arange(N, device=device) // G,
        prompt_len=P, group_size=G, prompts=[r.prompt for r in runs],
        completions=[tokenizer.decode(r.ids, skip_special_tokens=False) for r in runs],
        logprobs=LogProbs(old=behaviour, engine=behaviour),
        episodes=EpisodePart([r.episode for r in runs], token_rewards.to(device)))


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
    """The zero-argument ``calls``, at most ``concurrency`` at once, each in a daemon thread
    (one past ``timeout_s`` is abandoned, never joined) -> one Outcome per call, in order."""
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
