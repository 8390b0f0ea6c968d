"""User reward functions: loaded by import path, several with weights.

A reward function is ``reward(prompt, completion, **fields) -> float``: ``prompt`` is the
data's prompt (text, or the chat messages), ``completion`` the model's decoded reply,
and ``fields`` the data's other columns (``task.fields`` chooses which). A function that
does not take ``**fields`` gets only the fields it names. The batched form takes lists
and returns a list: ``reward(prompts, completions, **fields) -> list[float]`` (each field
a list too); it is recognised by its first two parameters being named ``prompts`` and
``completions``, or by ``batched: true`` in ``task.rewards``.

``task.reward_fn`` is one function; ``task.rewards`` a list of
``{fn: ..., weight: 1.0, name: ..., batched: ...}`` (or plain ``"module:function"``
strings, weight 1). The total reward is ``sum(weight * value)``; each value is logged as
``reward/<name>`` (``name`` defaults to the function's name).

An entry ``{model: PATH, weight: w, name: n}`` is a learned reward model
(``rlctl.reward_models.learned``), scored in the trainer's process beside these functions:
``model_entries`` reads those entries (and ``task.reward_model``, the one model that
replaces the task's own rewards) and ``parse_rewards`` the functions; a task scored by
reward models alone has no function.

``fn`` is ``package.module:function`` (imported; the working directory is searched too),
``path/to/file.py:function``, or a built-in: ``math`` (the completion's final answer
equals the ``answer`` field, equivalent forms accepted, via math-verify) or ``exact``
(the stripped completion equals the ``answer`` field).
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

from rlctl.registry import load_object
from rlctl.tasks.base import RESERVED_REWARD_NAMES

BUILTIN_REWARDS = {"math": "rlctl.tasks.verify:math_reward",
                   "exact": "rlctl.tasks.verify:exact_reward"}
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
    weight = item.get("weight", 1.0)
    weight = 1.0 if weight is None else weight
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
    """The callable named by ``spec`` (see the module doc); ValueError naming ``key``."""
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
        if self.accepts is None:
            return fields
        return {k: v for k, v in fields.items() if k in self.accepts}

    def call_one(self, prompt: Any, completion: str, fields: Dict[str, Any]) -> float:
        if self.batched:
            out = self.fn([prompt], [completion],
                          **{k: [v] for k, v in self._select(fields).items()})
            out = list(out)
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
        name = item.get("name") or (item["fn"] if item["fn"] in BUILTIN_REWARDS
                                    else getattr(fn, "__name__", f"reward{i}"))
        name = str(name)
        check_name_chars(name, key)
        if name in RESERVED_REWARD_NAMES:
            raise ValueError(f"{key}: reward name '{name}' is taken by the engine's own "
                             f"reward/{name} metric; set name: to another")
        if any(r.name == name for r in out):
            raise ValueError(f"{key}: two rewards are named '{name}'; give one a name:")
        out.append(_describe(fn, name, float(weight), batched, key))
    return out
