"""The tiny models of the multi-turn environments (calibration: docs/benchmarks.md)."""
from __future__ import annotations

import hashlib
import json
import logging
import random
from pathlib import Path
from typing import Callable, Dict, List, Sequence, Tuple

from rlctl.envs.calc import TINY_AGENT_WORDS
from rlctl.demo.tiny import (MODEL, MODEL_CUT, OBS, TURNS, Transcript, build_cached,
                             build_params, build_tokenizer, cache_key, transcript_rows,
                             warm_up_and_save)
from rlctl.tasks import build_task
from rlctl.tasks.arithmetic import spaced as spell
from rlctl.types import Turn

log = logging.getLogger(__name__)

AGENT_CODE_VERSION = 1   # bump when a change here alters an agent model
# Per task: scripted-policy settings, warm-up batch, steps = warmup_steps * steps_scale,
# turns per scripted (and measured) episode, new tokens per measured turn.
AGENT_WARMUPS: Dict[str, Dict[str, float]] = {
    "calculator": {"episodes": 2000, "call_frac": 0.3, "batch_size": 64, "steps_scale": 4.0,
                   "max_turns": 2, "max_new_tokens": 12},
    "guess_number": {"episodes": 2000, "narrow_frac": 1.0, "batch_size": 64, "steps_scale": 4.0,
                     "max_turns": 8, "max_new_tokens": 4},
    "running_sum": {"episodes": 2000, "correct_frac": 0.5, "batch_size": 64, "steps_scale": 2.0,
                    "max_turns": 4, "max_new_tokens": 4},
}   # keys: tiny.AGENT_TASKS


def _number(words: Sequence[str]) -> int:
    return int("".join(words))


def _random_like(n: int, rng: random.Random) -> str:
    """A random non-negative number with as many digits as ``n`` (format, not value)."""
    width = len(str(abs(n)))
    return spell(rng.randrange(10 ** (width - 1) if width > 1 else 0, 10 ** width))


# ---- scripted policies: (transcript so far, settings, rng) -> the next model turn's text,
# right (or using the tool) with the probability AGENT_WARMUPS gives

def calculator_policy(tr: Transcript, opts, rng: random.Random) -> str:
    expr = tr[0][1].split()
    expr = expr[:expr.index("=")] if "=" in expr else expr
    if len(tr) == 1:
        if rng.random() < opts["call_frac"]:
            return " ".join(["<call>", "calc", *expr, "</call>"])
        return spell(_apply(*_split_expr(expr)))
    words = tr[-1][1].split()
    inner = [w for w in words if w not in ("<result>", "</result>")]
    if inner and all(w.isdigit() or w == "-" for w in inner):
        return " ".join(inner)
    return _random_like(_apply(*_split_expr(expr)), rng)   # an error result: a guess


def _split_expr(words: Sequence[str]) -> Tuple[int, str, int]:
    at = next(i for i, w in enumerate(words) if i > 0 and w in "+-*")
    return _number(words[:at]), words[at], _number(words[at + 1:])


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def guess_number_policy(tr: Transcript, opts, rng: random.Random) -> str:
    words = tr[0][1].split()
    n = _number(words[1:words.index(":")])
    lo, hi = 1, n
    guesses = [_number(t.split()) for role, t in tr if role in TURNS]
    answers = [t.split() for role, t in tr[1:] if role == OBS]
    for g, a in zip(guesses, answers):
        if "higher" in a:
            lo = max(lo, g + 1)
        elif "lower" in a:
            hi = min(hi, g - 1)
    if lo > hi or rng.random() >= opts["narrow_frac"]:
        lo, hi = 1, n
    return spell(rng.randint(lo, hi))


def running_sum_policy(tr: Transcript, opts, rng: random.Random) -> str:
    words = " ".join(t for _, t in [tr[0]] + [s for s in tr[1:] if s[0] == OBS]).split()
    nums, sign, cur = [], 1, []
    for w in words + ["="]:
        if w.isdigit():
            cur.append(w)
            continue
        if cur:
            nums.append(sign * _number(cur))
            cur = []
        sign = -1 if w == "-" else 1 if w == "+" else sign
    total = sum(nums)
    return spell(total) if rng.random() < opts["correct_frac"] else _random_like(total, rng)


POLICIES: Dict[str, Callable[[Transcript, dict, random.Random], str]] = {
    "calculator": calculator_policy, "guess_number": guess_number_policy,
    "running_sum": running_sum_policy}


def play_scripted(task, example, seed: int, policy, opts, rng, tokenizer) -> Transcript:
    """The transcript of one episode of ``policy``; a turn ending at a stop string is MODEL_CUT."""
    env = task.make_env()
    tr: Transcript = [("prompt", env.reset(example, seed))]
    stops: Tuple[str, ...] = ()      # the first turn has none (as in rlctl.rollout.episodes.loop)
    try:
        for _ in range(int(opts["max_turns"])):
            text = policy(tr, opts, rng)
            cut = any(text.endswith(s) for s in stops)
            ids = tokenizer.convert_tokens_to_ids(text.split()) + ([] if cut else [tokenizer.eos_token_id])
            tr.append((MODEL_CUT if cut else MODEL, text))
            step = env.step(Turn(text, ids))
            if step.done:
                break
            stop = (step.info or {}).get("stop") or ()
            stops = (stop,) if isinstance(stop, str) else tuple(stop)
            if step.observation is not None:
                tr.append((OBS, step.observation))
    finally:
        getattr(env, "close", lambda: None)()
    return tr


def warmup_transcripts(name: str, opts, seed: int, tokenizer) -> List[Transcript]:
    """``opts["episodes"]`` scripted episodes of task ``name`` on its training rows."""
    task, rng = build_task(name), random.Random(seed)
    train = task.train_examples()
    return [play_scripted(task, train[i % len(train)], i, POLICIES[name], opts, rng, tokenizer)
            for i in range(int(opts["episodes"]))]


def agent_params(name: str, hidden_size: int, num_layers: int, num_heads: int,
                 warmup_steps: int, warmup_lr: float, seed: int) -> Dict[str, object]:
    """Everything that determines task ``name``'s agent model, transcripts' digest included."""
    params = build_params(hidden_size, num_layers, num_heads, warmup_steps, warmup_lr, seed)
    for key in ("warmup_num_digits", "warmup_sorted_frac", "warmup_batch_size"):
        del params[key]          # sorting's settings; the agent warm-up has its own
    opts = AGENT_WARMUPS[name]
    tokenizer = build_tokenizer(TINY_AGENT_WORDS)
    params.update({"warmup_task": name, "agent_code_version": AGENT_CODE_VERSION,
                   "agent_words": list(TINY_AGENT_WORDS),
                   **{f"warmup_{k}": v for k, v in opts.items()},
                   "warmup_transcripts": hashlib.sha256(json.dumps(warmup_transcripts(
                       name, opts, int(seed), tokenizer)).encode()).hexdigest()[:16]})
    return params


def _build_agent_into(directory: Path, params: Dict[str, object]) -> Dict[str, object]:
    name = str(params["warmup_task"])
    opts, tokenizer = AGENT_WARMUPS[name], build_tokenizer(TINY_AGENT_WORDS)
    transcripts = warmup_transcripts(name, opts, int(params["seed"]), tokenizer)
    return warm_up_and_save(directory, params, tokenizer,
                            lambda: transcript_rows(tokenizer, transcripts),
                            int(round(params["warmup_steps"] * opts["steps_scale"])),
                            int(opts["batch_size"]))


def build_agent_tiny(name: str, hidden_size: int = 128, num_layers: int = 2,
                     num_heads: int = 4, warmup_steps: int = 0, warmup_lr: float = 1e-3,
                     seed: int = 0, cache_dir=None) -> Path:
    """Directory of task ``name``'s agent tiny model, built on first use (``build_cached``)."""
    params = agent_params(name, hidden_size, num_layers, num_heads, warmup_steps, warmup_lr, seed)
    final, meta = build_cached(cache_dir, cache_key(params),
                               lambda tmp: _build_agent_into(tmp, params))
    if meta is not None:
        log.info("built tiny %s model in %.1f s (%d warm-up steps): %s", name, meta["build_seconds"],
                 int(round(params["warmup_steps"] * params["warmup_steps_scale"])), final)
    return final
