"""Rule rewards (docs/extending.md): the user's functions by import path, weighted, and the
verifier behind the built-in ``math`` and ``exact`` (``answers_equivalent``). A reward is
``fn(prompt, completion, **fields) -> float`` or, batched, ``fn(prompts, completions, **fields)
-> list[float]``; a function without ``**fields`` gets the fields it names."""
from __future__ import annotations

import inspect
import logging
import math
import re
import threading
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, Dict, List, Optional, Sequence

from rlctl.registry import load_object
from rlctl.tasks.task import RESERVED_REWARD_NAMES

BUILTIN_REWARDS = {"math": "rlctl.tasks.rewards:math_reward",
                   "exact": "rlctl.tasks.rewards:exact_reward"}
_BOXED = re.compile(r"\\boxed\s*\{")
_MARKERS = re.compile(r"####|answer\s*(?:is|:)|answer\s*=", re.IGNORECASE)
_SPACED_DIGITS = re.compile(r"(?<=\d) (?=\d)")
_SIGN_SPACE = re.compile(r"(?<![\w)])([-+]) (?=\d)")
_NUMBER = re.compile(
    r"(?<![\w.])[-+]?(?:\d{1,3}(?:,\d{3})+|\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
    r"(?:\s*/\s*[-+]?\d+(?:\.\d+)?)?")


def _last_boxed(text: str) -> Optional[str]:
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    i, depth = starts[-1], 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return text[i:]


def normalize_spacing(text: str) -> str:
    """Join digits written with single spaces ("4 6" -> "46", "- 1 2" -> "-12")."""
    return _SIGN_SPACE.sub(r"\1", _SPACED_DIGITS.sub("", text))


def final_answer_text(text: str) -> str:
    """The part of a completion that holds the final answer: the last ``\\boxed{}``, else after the
    last "####" / "answer is" / "answer:", else the text."""
    if not isinstance(text, str):
        return ""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    marks = list(_MARKERS.finditer(text))
    return text[marks[-1].end():] if marks else text


def _to_fraction(token: str) -> Optional[Fraction]:
    token = token.replace(",", "").replace(" ", "")
    try:
        if "/" in token:
            num, den = token.split("/", 1)
            d = Fraction(den)
            return Fraction(num) / d if d != 0 else None
        return Fraction(token)
    except (ValueError, ZeroDivisionError):
        return None


def numbers_in(text: str) -> List[Fraction]:
    """Every number written in ``text``, read as ``parse_number`` reads one ("1,000", "60.0",
    "4.6e1", "92/2"), as exact rationals."""
    return [f for f in map(_to_fraction, _NUMBER.findall(text)) if f is not None]


def parse_number(text: Any) -> Optional[Fraction]:
    """The final answer as an exact rational number, or None."""
    if not isinstance(text, str):
        return plain_number(text)
    part = normalize_spacing(final_answer_text(text)).replace("$", " ")
    found = _NUMBER.findall(part)
    return _to_fraction(found[-1]) if found else None


def _math_verify(completion: str, answer: str) -> bool:
    try:   # only for math answers (reward_fn=math), and slow to import (about 0.4 s)
        from math_verify import parse, verify
    except ImportError:  # pragma: no cover - math-verify is a dependency
        return False
    main = threading.current_thread() is threading.main_thread()
    if not main:
        logging.getLogger("math_verify").setLevel(logging.ERROR)
    limit = {} if main else {"parsing_timeout": None}
    try:
        gold = parse(answer, **limit)
        pred = parse(completion, **limit)
        if not gold or not pred:
            return False
        return bool(verify(gold, pred, **({} if main else {"timeout_seconds": None})))
    except Exception:  # noqa: BLE001 - a verifier never raises on bad text
        return False


def plain_number(answer: Any) -> Optional[Fraction]:
    """``answer`` as a rational number when it is one ("46", "-1,234", "0.5", "1/2", 46)."""
    if isinstance(answer, bool):
        return None
    if isinstance(answer, float):
        return Fraction(repr(answer))     # 0.1 means 1/10, not the binary float's exact value
    if isinstance(answer, (int, Fraction)):
        return Fraction(answer)
    if not isinstance(answer, str):
        return None
    text = normalize_spacing(answer.strip().strip("$").strip())
    return _to_fraction(text) if _NUMBER.fullmatch(text or "x") else None


def answers_equivalent(completion: Any, answer: Any) -> bool:
    """Is the completion's final answer equal to ``answer``, as a rational ("4.6e1", "92/2",
    "1,234", "4 6") or by math-verify?"""
    if not isinstance(completion, str) or not completion.strip():
        return False
    target = plain_number(answer)
    if target is not None:
        got = parse_number(completion)
        if got == target:
            return True
        if got is not None and not any(ch in completion for ch in "\\{}^"):
            return False  # a plain number that differs: math-verify cannot disagree
    gold = answer if isinstance(answer, str) else str(answer)
    return _math_verify(normalize_spacing(completion), gold)


def whole_answer(completion: Any) -> str:
    """The completion stripped of whitespace and one final period ("" for a non-string)."""
    if not isinstance(completion, str):
        return ""
    text = completion.strip()
    return text[:-1].rstrip() if text.endswith(".") else text


def is_just_answer(completion: Any, answer: Any) -> bool:
    """Is the whole completion ``answer`` as written, after stripping whitespace and one final
    period ("46", " 46.\n"; not "46.0", "The answer is 46", "46. 46.")?"""
    return isinstance(completion, str) and whole_answer(completion) == str(answer).strip()


def math_reward(prompt: Any, completion: str, answer: Any = None, **_fields) -> float:
    """``task.reward_fn=math``: 1.0 when the final answer equals the ``answer`` field."""
    if answer is None:
        raise ValueError("the math reward needs an 'answer' field in the data")
    return float(answers_equivalent(completion, answer))


def exact_reward(prompt: Any, completion: str, answer: Any = None, **_fields) -> float:
    """``task.reward_fn=exact``: 1.0 when the stripped completion is the ``answer`` field."""
    if answer is None:
        raise ValueError("the exact reward needs an 'answer' field in the data")
    return float(isinstance(completion, str) and completion.strip() == str(answer).strip())


SPEC_KEYS = ("fn", "weight", "name", "batched")
MODEL_KEYS = ("model", "weight", "name")
DEFAULT_MODEL_NAME = "reward_model"


def is_model_entry(item: Any) -> bool:
    """A ``{model: PATH, ...}`` entry of ``task.rewards`` (a learned reward model)."""
    return isinstance(item, dict) and "model" in item


@dataclass(frozen=True)
class ModelEntry:
    """One learned reward model of the config; ``key`` names it in error messages."""
    path: str
    weight: float
    name: str
    key: str


def check_name_chars(name: str, key: str) -> None:
    """A reward name is letters, digits, _ or - (it becomes the metric key reward/<name>)."""
    if not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"{key}: reward name '{name}' must be letters, digits, _ or -")


def _weight(item: Dict[str, Any], key: str) -> float:
    weight = 1.0 if item.get("weight") is None else item["weight"]
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
        raise ValueError(f"{key}: weight must be a finite number, got {weight!r}")
    return float(weight)


def model_entries(rewards: Optional[Sequence[Any]], reward_model: Optional[str] = None
                  ) -> List[ModelEntry]:
    """The learned reward models of ``task.reward_model`` or the ``{model: ...}`` entries
    of ``task.rewards`` (not both); ValueError, one line."""
    items = [(i, item) for i, item in enumerate(rewards or []) if is_model_entry(item)]
    if reward_model and items:
        raise ValueError("set task.reward_model or {model: ...} entries in task.rewards, not both")
    if reward_model:
        return [ModelEntry(str(reward_model), 1.0, DEFAULT_MODEL_NAME, "task.reward_model")]
    out = []
    for i, item in items:
        key = f"task.rewards[{i}]"
        unknown = sorted(set(item) - set(MODEL_KEYS))
        if unknown:
            raise ValueError(f"{key}: unknown key '{unknown[0]}' for a reward model; valid: "
                             f"{', '.join(MODEL_KEYS)}")
        out.append(ModelEntry(item["model"], _weight(item, key),
                              str(item.get("name") or DEFAULT_MODEL_NAME), f"{key}.model"))
    return out


def load_function(spec: Any, key: str) -> Callable:
    """The callable named by ``spec`` (an import path); ValueError naming ``key``."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"{key} must be 'package.module:function', 'path/file.py:function' "
                         f"or one of {', '.join(BUILTIN_REWARDS)}; got {spec!r}")
    spec = BUILTIN_REWARDS.get(spec.strip(), spec.strip())
    if ":" not in spec:
        raise ValueError(f"{key} '{spec}' must look like package.module:function (or "
                         f"path/file.py:function, or one of {', '.join(BUILTIN_REWARDS)})")
    return load_object(spec, key)


@dataclass
class RewardFn:
    """One reward function with its weight and how it is called."""
    name: str
    fn: Callable
    weight: float
    batched: bool
    accepts: Optional[frozenset]   # field names it takes; None: **fields (all)
    required: frozenset            # field names it cannot do without

    def _select(self, fields: Dict[str, Any]) -> Dict[str, Any]:
        return fields if self.accepts is None else {k: v for k, v in fields.items()
                                                    if k in self.accepts}

    def call_one(self, prompt: Any, completion: str, fields: Dict[str, Any]) -> float:
        if self.batched:
            out = list(self.fn([prompt], [completion],
                               **{k: [v] for k, v in self._select(fields).items()}))
            if len(out) != 1:
                raise ValueError(f"batched reward '{self.name}' returned {len(out)} values for 1")
            return float(out[0])
        return float(self.fn(prompt, completion, **self._select(fields)))

    def call_batch(self, prompts: Sequence[Any], completions: Sequence[str],
                   fields: Sequence[Dict[str, Any]]) -> List[float]:
        if not self.batched:
            return [self.call_one(p, c, f) for p, c, f in zip(prompts, completions, fields)]
        names = set().union(*(f.keys() for f in fields)) if fields else set()
        cols = {k: [f.get(k) for f in fields] for k in names}
        out = [float(v) for v in self.fn(list(prompts), list(completions), **self._select(cols))]
        if len(out) != len(prompts):
            raise ValueError(f"batched reward '{self.name}' returned {len(out)} values "
                             f"for {len(prompts)} samples")
        return out

    def check_fields(self, available: Sequence[str], key: str) -> None:
        missing = sorted(self.required - set(available))
        if missing:
            raise ValueError(f"{key}: reward '{self.name}' needs field(s) {', '.join(missing)} "
                             f"that the data does not provide; available: "
                             f"{', '.join(sorted(available)) or '(none)'} (see task.fields)")


def _describe(fn: Callable, name: str, weight: float, batched: Optional[bool], key: str) -> RewardFn:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: pass everything
        return RewardFn(name, fn, weight, bool(batched), None, frozenset())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    var_pos = any(p.kind is p.VAR_POSITIONAL for p in params)
    if len(positional) < 2 and not var_pos:
        raise ValueError(f"{key}: reward '{name}' must take (prompt, completion, **fields); "
                         f"its signature is {inspect.signature(fn)}")
    if batched is None:
        batched = [p.name for p in positional[:2]] == ["prompts", "completions"]
    rest = [p for p in params[2:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    accepts = None if var_kw else frozenset(p.name for p in rest)
    required = frozenset(p.name for p in rest if p.default is inspect.Parameter.empty)
    return RewardFn(name, fn, weight, bool(batched), accepts, required)


def parse_rewards(reward_fn: Optional[str], rewards: Optional[Sequence[Any]],
                  reward_model: Optional[str] = None) -> List[RewardFn]:
    """The reward functions of ``task.reward_fn`` / ``task.rewards`` (exactly one set);
    none when reward models (``{model: ...}`` entries, ``task.reward_model``) score alone."""
    items = [(i, r) for i, r in enumerate(rewards or []) if not is_model_entry(r)]
    if reward_fn and items:
        raise ValueError("set task.reward_fn or task.rewards, not both")
    if not reward_fn and not items:
        if reward_model or rewards:       # rewards: {model: ...} entries only
            return []
        raise ValueError("a data task needs a reward: task.reward_fn=package.module:function "
                         "(or task.rewards=[{fn: ..., weight: ...}])")
    out: List[RewardFn] = []
    for i, item in [(0, {"fn": reward_fn})] if reward_fn else items:
        key = "task.reward_fn" if reward_fn else f"task.rewards[{i}]"
        if isinstance(item, str):
            item = {"fn": item}
        if not isinstance(item, dict):
            raise ValueError(f"{key} must be 'module:function' or a mapping with keys "
                             f"{', '.join(SPEC_KEYS)}; got {item!r}")
        unknown = sorted(set(item) - set(SPEC_KEYS))
        if unknown:
            raise ValueError(f"{key}: unknown key '{unknown[0]}'; valid: {', '.join(SPEC_KEYS)}")
        if "fn" not in item:
            raise ValueError(f"{key}: missing 'fn' (package.module:function)")
        weight = _weight(item, key)
        batched = item.get("batched")
        if batched is not None and not isinstance(batched, bool):
            raise ValueError(f"{key}: batched must be true, false or null, got {batched!r}")
        fn = load_function(item["fn"], f"{key}.fn" if not reward_fn else key)
        name = str(item.get("name") or (item["fn"] if item["fn"] in BUILTIN_REWARDS
                                        else getattr(fn, "__name__", f"reward{i}")))
        check_name_chars(name, key)
        if name in RESERVED_REWARD_NAMES:
            raise ValueError(f"{key}: reward name '{name}' is taken by the engine's own "
                             f"reward/{name} metric; set name: to another")
        if any(r.name == name for r in out):
            raise ValueError(f"{key}: two rewards are named '{name}'; give one a name:")
        out.append(_describe(fn, name, float(weight), batched, key))
    return out
