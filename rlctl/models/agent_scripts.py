"""The scripted policies of the agent warm-ups (rlctl.models.tiny_agents): each plays a
built-in environment with the format of its turns right and the skill mostly wrong, and
``play_scripted`` records the episode as a transcript in the episode loop's layout."""
from __future__ import annotations

import random
from typing import Callable, Dict, List, Sequence, Tuple

from rlctl.envs.calc import spell
from rlctl.types import Turn

# transcript segment roles (the prompt is segment 0): a model turn that ends with <eos>,
# one cut at a stop string (no <eos>), an observation
MODEL, MODEL_CUT, OBS = "model", "model_cut", "obs"
TURNS = (MODEL, MODEL_CUT)
Transcript = List[Tuple[str, str]]   # [(role, text)]: ("prompt", ...), then model/obs turns


def _number(words: Sequence[str]) -> int:
    return int("".join(words))


def _random_like(n: int, rng: random.Random) -> str:
    """A random non-negative number with as many digits as ``n`` (format, not value)."""
    width = len(str(abs(n)))
    return spell(rng.randrange(10 ** (width - 1) if width > 1 else 0, 10 ** width))


# ---- scripted policies: (transcript so far, settings, rng) -> the next model turn's text ----

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
    """One episode of ``policy`` against the task's environment: its transcript. A model
    turn is ``(MODEL, text)``, or ``(MODEL_CUT, text)`` when it ends with one of the
    previous step's ``info["stop"]`` strings (the episode loop cuts it there: no ``<eos>``)."""
    env = task.make_env()
    tr: Transcript = [("prompt", env.reset(example, seed))]
    stops: Tuple[str, ...] = ()      # the first turn has none (as in rlctl.rollout.episodes)
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
