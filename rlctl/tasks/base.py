"""The Task protocol, the registry, and what every task shares: option checking, chat
prompts, and reward scoring under a time limit.

A task gives prompts (``train_examples``/``eval_examples``) and scores completions
(``reward``, ``is_correct``). ``build_task(name, **options)`` is the only constructor the
engine uses. It takes the keys every task has (``COMMON_OPTIONS``: ``prompt_format``,
``system_prompt``, ``reward_timeout_s``, ``on_reward_error``) out of ``options``, drops
``None`` values of keys the task does not take (``TaskConfig`` is shared by all tasks),
rejects a non-``None`` value for such a key with a one-line ``ValueError``, builds the
task and attaches the common options to it as ``task.rlctl_options``.

Chat (``prompt_format=chat``): ``bind_tokenizer(task, tokenizer)`` must be called once the
model's tokenizer is loaded; the task's prompts are then rendered with
``tokenizer.apply_chat_template([system?, user], add_generation_prompt=True)`` and its
``reward``/``is_correct``/``reward_components`` see the assistant text only (cut at the
first end-of-turn marker). This is done on the task *instance*, so it works for any
registered task, built-in or the user's own.

Rewards: ``RewardScorer(task).score_batch(examples, completions)`` scores a batch within
``reward_timeout_s`` seconds. Why a process: a thread cannot be stopped, so a reward
stuck in a pure-Python loop (or in C code that holds the GIL, e.g. a catastrophic regex)
would keep a core, or the whole interpreter, busy for ever. The scorer therefore runs the
reward in one persistent worker process forked from the trainer (copy-on-write, so the
task and the user's imported functions are already there; only examples, completions and
floats cross the pipe). When the deadline passes the worker is killed and a fresh one is
forked for the next batch. ``reward_timeout_s`` of 0 or null scores in-process without a
limit; on a platform without ``fork`` the limit is kept by a daemon thread that is
abandoned at the deadline (it cannot be killed there).
"""
from __future__ import annotations

import inspect
import logging
import math
import multiprocessing
import queue
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Protocol, Sequence, Tuple

from rlctl.errors import UserError
from rlctl.types import Example

log = logging.getLogger(__name__)


class Task(Protocol):
    name: str

    def train_examples(self) -> List[Example]:
        """Training prompts (sampled with replacement by the engine)."""

    def eval_examples(self) -> List[Example]:
        """Held-out prompts, disjoint from the training prompts."""

    def reward(self, example: Example, completion: str) -> float:
        """Score one decoded completion. Must not raise on malformed text (score 0)."""

    def is_correct(self, example: Example, completion: str) -> bool:
        """Exact correctness, for the eval metric ``eval/exact_match``."""

    # Optional, used by RewardScorer when present:
    #   reward_components(example, completion) -> Dict[str, float]   raw named rewards;
    #       the total is sum(reward_weights.get(name, 1.0) * value), equal to reward().
    #   reward_components_batch(examples, completions) -> List[Dict[str, float]]
    #       (used unless the task sets score_in_batches = False)
    #   reward_weights: Dict[str, float]
    #   correct_from_reward(example, reward) -> bool   eval correctness from the total.


TaskFactory = Callable[..., Task]
TASKS: Dict[str, TaskFactory] = {}


def register_task(name: str):
    def deco(factory: TaskFactory) -> TaskFactory:
        TASKS[name] = factory
        return factory
    return deco


# ---- options every task has ------------------------------------------------------------
PROMPT_FORMATS = ("raw", "chat")
ON_REWARD_ERROR = ("zero", "raise")
RESERVED_REWARD_NAMES = ("mean", "std", "errors", "timeouts", "frac_zero_std_groups")


@dataclass
class TaskOptions:
    """The keys every task YAML sets (see conf/task/*.yaml)."""
    prompt_format: str = "raw"            # raw | chat
    system_prompt: Optional[str] = None   # chat only
    reward_timeout_s: Optional[float] = 60.0  # per batch; 0/None: in-process, no limit
    on_reward_error: str = "zero"         # zero: score 0 and count; raise: stop the run


COMMON_OPTIONS = tuple(TaskOptions.__dataclass_fields__)


def check_options(opts: TaskOptions) -> TaskOptions:
    if opts.prompt_format not in PROMPT_FORMATS:
        raise ValueError(f"invalid task.prompt_format '{opts.prompt_format}'; valid: "
                         f"{', '.join(PROMPT_FORMATS)}")
    if opts.on_reward_error not in ON_REWARD_ERROR:
        raise ValueError(f"invalid task.on_reward_error '{opts.on_reward_error}'; valid: "
                         f"{', '.join(ON_REWARD_ERROR)}")
    t = opts.reward_timeout_s
    if t is not None and (not isinstance(t, (int, float)) or isinstance(t, bool) or t < 0
                          or not math.isfinite(t)):
        raise ValueError(f"invalid task.reward_timeout_s '{t}'; must be >= 0 seconds "
                         "(0 or null: no limit)")
    if opts.system_prompt is not None and opts.prompt_format != "chat":
        raise ValueError("task.system_prompt needs task.prompt_format=chat")
    return opts


def task_options(task) -> TaskOptions:
    return getattr(task, "rlctl_options", None) or TaskOptions()


def _factory_params(factory) -> Tuple[Dict[str, inspect.Parameter], bool]:
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return {}, True
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    return {k: p for k, p in params.items()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}, var_kw


def build_task(name: str, **options) -> Task:
    """The task ``name`` built from config keys (all of ``TaskConfig`` but ``name``)."""
    if name not in TASKS:
        raise ValueError(f"unknown task '{name}'; valid: {', '.join(sorted(TASKS))}")
    common = {k: options.pop(k) for k in COMMON_OPTIONS if k in options}
    opts = check_options(TaskOptions(**{k: v for k, v in common.items()
                                        if v is not None or k in ("reward_timeout_s",
                                                                  "system_prompt")}))
    factory = TASKS[name]
    params, var_kw = _factory_params(factory)
    kwargs = {}
    for key, value in options.items():
        if key in params:
            default = params[key].default
            if value is None and default is not inspect.Parameter.empty and default is not None:
                raise ValueError(f"task.{key} must be set for task '{name}' (got null)")
            kwargs[key] = value
        elif var_kw:
            kwargs[key] = value
        elif value is not None:
            valid = ", ".join(sorted(list(params) + list(COMMON_OPTIONS)))
            raise ValueError(f"task.{key} does not apply to task '{name}'; its options: {valid}")
    task = factory(**kwargs)
    try:
        task.rlctl_options = opts
    except AttributeError:  # a slotted class: the defaults apply
        pass
    if opts.prompt_format == "chat":
        _enable_chat(task)
    return task


# ---- chat prompts ----------------------------------------------------------------------
RAW_PROMPT = "_raw_prompt"   # Example.fields key: the prompt before the chat template


def chat_messages(prompt: Any, system_prompt: Optional[str]) -> List[Dict[str, str]]:
    """A user prompt (text or a list of {role, content} messages) as chat messages."""
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, (list, tuple)) and all(
            isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
        messages = [dict(m) for m in prompt]
    else:
        raise ValueError("a chat prompt must be a string or a list of {role, content} "
                         f"messages, got {type(prompt).__name__}")
    if system_prompt and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def render_chat(tokenizer, prompt: Any, system_prompt: Optional[str] = None) -> str:
    """The prompt through the tokenizer's chat template, ending with the assistant header.

    A leading BOS that the template writes is dropped when the tokenizer adds BOS itself
    on encoding (the engine tokenizes prompts with special tokens), so it is not doubled.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("task.prompt_format=chat needs a tokenizer with a chat template; "
                         "this model's tokenizer has none (use task.prompt_format=raw)")
    text = tokenizer.apply_chat_template(chat_messages(prompt, system_prompt), tokenize=False,
                                         add_generation_prompt=True)
    bos = getattr(tokenizer, "bos_token", None)
    if bos and text.startswith(bos):
        ids = tokenizer("x")["input_ids"]
        if ids and ids[0] == tokenizer.bos_token_id:
            text = text[len(bos):]
    return text


def end_of_turn_markers(tokenizer) -> List[str]:
    """Special-token strings that end an assistant turn: EOS and every special or added
    token that the chat template writes (e.g. <|im_end|>, <|eot_id|>, <|user|>)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = " ".join(template.values())
    specials = set(getattr(tokenizer, "all_special_tokens", []) or [])
    specials |= set((getattr(tokenizer, "get_added_vocab", lambda: {})() or {}).keys())
    markers = {t for t in specials if t and t in template}
    if getattr(tokenizer, "eos_token", None):
        markers.add(tokenizer.eos_token)
    markers.discard(getattr(tokenizer, "pad_token", None) or "\0")
    return sorted(markers, key=len, reverse=True)


def assistant_text(completion: str, markers: Sequence[str] = (), prompt: str = "") -> str:
    """The assistant's reply only: after the rendered prompt if the text repeats it, up to
    the first end-of-turn marker."""
    if not isinstance(completion, str):
        return completion
    if prompt and completion.startswith(prompt):
        completion = completion[len(prompt):]
    cut = len(completion)
    for m in markers:
        i = completion.find(m)
        if i != -1:
            cut = min(cut, i)
    return completion[:cut].strip()


def _enable_chat(task) -> None:
    """Render prompts and strip completions on this task instance (see the module doc)."""
    state: Dict[str, Any] = {"tokenizer": None, "markers": (), "cache": {}}
    task._rlctl_chat = state
    orig_train, orig_eval = task.train_examples, task.eval_examples
    system = task_options(task).system_prompt

    def render(kind: str, make: Callable[[], List[Example]]) -> List[Example]:
        tok = state["tokenizer"]
        if tok is None:
            raise ValueError("task.prompt_format=chat: no tokenizer was bound to the task "
                             "(the engine must call rlctl.tasks.bind_tokenizer(task, tokenizer))")
        if kind not in state["cache"]:
            out = []
            for ex in make():
                raw = ex.fields.get(RAW_PROMPT, ex.prompt)
                out.append(Example(prompt=render_chat(tok, raw, system),
                                   fields={**ex.fields, RAW_PROMPT: raw}))
            state["cache"][kind] = out
        return list(state["cache"][kind])

    task.train_examples = lambda: render("train", orig_train)
    task.eval_examples = lambda: render("eval", orig_eval)
    for meth in ("reward", "is_correct", "reward_components"):
        fn = getattr(task, meth, None)
        if fn is not None:
            setattr(task, meth, _strip_wrapper(fn, state))
    batch_fn = getattr(task, "reward_components_batch", None)
    if batch_fn is not None:
        task.reward_components_batch = lambda exs, cs: batch_fn(
            exs, [assistant_text(c, state["markers"], ex.prompt) for ex, c in zip(exs, cs)])


def _strip_wrapper(fn, state):
    def wrapped(example, completion, *args, **kwargs):
        return fn(example, assistant_text(completion, state["markers"], example.prompt),
                  *args, **kwargs)
    wrapped.__wrapped__ = fn
    return wrapped


def bind_tokenizer(task, tokenizer) -> None:
    """Give the task the model's tokenizer (needed for prompt_format=chat; harmless
    otherwise). Call before ``train_examples()``/``eval_examples()``. Raises ValueError
    when chat is asked for and the tokenizer has no chat template."""
    state = getattr(task, "_rlctl_chat", None)
    if state is None:
        return
    render_chat(tokenizer, "x")  # fails early, one line, without a chat template
    state.update(tokenizer=tokenizer, markers=end_of_turn_markers(tokenizer), cache={})


# ---- scoring ---------------------------------------------------------------------------
class RewardError(UserError):
    """A reward function failed or ran out of time with task.on_reward_error=raise."""


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


def _worker_main(task, conn) -> None:  # runs in the forked child
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    while True:
        try:
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
        self.proc = ctx.Process(target=_worker_main, args=(self.task, child), daemon=True,
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
        self.seconds = 0.0            # wall time spent scoring
        self.last_components: Dict[str, List[float]] = {}
        self._sums: Dict[str, float] = {}   # per-reward sums since the last metrics()
        self._count = 0
        self._warned = 0
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
        missing = [i for i in range(n) if totals[i] is None and i not in dict(failures)]
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
        names = sorted({k for c in comps for k in c})
        self.last_components = {k: [c.get(k, 0.0) for c in comps] for k in names}
        for k, v in self.last_components.items():
            self._sums[k] = self._sums.get(k, 0.0) + sum(v)
        self._count += n
        return [t if t is not None else 0.0 for t in totals]

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

    def state(self) -> Dict[str, float]:
        """The counters, for a checkpoint (``load_state`` restores them)."""
        return {"errors": self.errors, "timeouts": self.timeouts}

    def load_state(self, state: Dict[str, float]) -> None:
        self.errors = int(state.get("errors", 0))
        self.timeouts = int(state.get("timeouts", 0))

    def close(self) -> None:
        self._runner.close()

    def __del__(self):  # best effort; the worker is a daemon anyway
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass
