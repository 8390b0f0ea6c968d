"""The Task protocol, the task registry and what every task shares: the common options, chat
prompts, the disjoint splits of generated tasks. A task is never changed once built."""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

from rlctl.registry import Registry
from rlctl.types import Example


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

    # Optional: reward_components(example, completion) -> {name: v} (reward() == sum of
    # reward_weights.get(name, 1.0) * v), reward_components_batch, correct_from_reward.


# factory(**task options) -> Task, by @register_task(name) or as "package.module:factory"
TASKS = Registry("task")
register_task = TASKS.register
ENV_TASKS = ("calculator", "guess_number", "running_sum")   # rlctl.envs.builtin


register_task("jsonl")("rlctl.tasks.data:DataTask")      # imported when first looked up
register_task("preferences")("rlctl.tasks.preference:PreferenceTask")
for _name in ENV_TASKS:
    register_task(_name)(f"rlctl.envs.builtin:{_name}")


PROMPT_FORMATS = ("raw", "chat")
ON_REWARD_ERROR = ("zero", "raise")
RESERVED_REWARD_NAMES = ("mean", "std", "errors", "timeouts", "frac_zero_std_groups")
LONG_PROMPTS = ("skip", "truncate_left", "error")   # rlctl.tasks.prompt_budget


@dataclass
class TaskOptions:
    """The keys every task YAML sets (see config/conf/task/*.yaml)."""
    prompt_format: str = "raw"            # raw | chat
    system_prompt: Optional[str] = None   # chat only
    reward_timeout_s: Optional[float] = 60.0  # per batch; 0/None: in-process, no limit
    on_reward_error: str = "zero"         # zero: score 0 and count; raise: stop the run
    long_prompts: str = "skip"            # prompts over rollout.max_prompt_tokens: skip | truncate_left | error


COMMON_OPTIONS = tuple(TaskOptions.__dataclass_fields__)


def check_options(opts: TaskOptions) -> TaskOptions:
    for key, valid in (("prompt_format", PROMPT_FORMATS), ("on_reward_error", ON_REWARD_ERROR),
                       ("long_prompts", LONG_PROMPTS)):
        if getattr(opts, key) not in valid:
            raise ValueError(f"invalid task.{key} '{getattr(opts, key)}'; valid: {', '.join(valid)}")
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


def build_task(name: str, **options) -> Task:
    """The task ``name`` built from ``TaskConfig``'s keys: ``None`` for an option it does not
    take is dropped, another value refused; common options go to ``task.rlctl_options``."""
    factory = TASKS.get(name)
    common = {k: options.pop(k) for k in COMMON_OPTIONS if k in options}
    opts = check_options(TaskOptions(**{k: v for k, v in common.items()
                                        if v is not None or k in ("reward_timeout_s",
                                                                  "system_prompt")}))
    try:
        sig = dict(inspect.signature(factory).parameters)
    except (TypeError, ValueError):
        sig = None   # no signature: every option goes to the factory
    var_kw = sig is None or any(p.kind is p.VAR_KEYWORD for p in sig.values())
    params = {k: p for k, p in (sig or {}).items()
              if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
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
    needs = ("train_examples", "eval_examples")
    if not all(callable(getattr(task, m, None)) for m in needs) or not any(
            callable(getattr(task, m, None)) for m in ("reward", "make_env")):
        raise ValueError(f"its factory returned {type(task).__name__}, not a task: "
                         "an object with train_examples(), eval_examples() and reward() "
                         "(docs/extending.md), or an EnvTask (docs/agents.md)")
    try:
        task.rlctl_options = opts
    except AttributeError:  # a slotted class: the defaults apply
        pass
    if not task.train_examples():
        raise ValueError("it has no training rows: its train_examples() returned none")
    return task


RAW_PROMPT = "_raw_prompt"   # Example.fields key: the prompt before the chat template (or truncation)
SOURCE = "_source"           # Example.fields key: where the prompt came from, e.g. "d.jsonl:3"


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
    """The prompt through the tokenizer's chat template, ending with the assistant header;
    a BOS the template writes is dropped when encoding adds one (never doubled)."""
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
    cut = min((i for i in map(completion.find, markers) if i != -1), default=len(completion))
    return completion[:cut].strip()


def disjoint_splits(draw: Callable[[Any], Any], rng, num_eval: int, max_train: int, space: int,
                    enumerate_all: Callable[[], Any]) -> Tuple[List[Any], List[Any]]:
    """(eval, train) items, disjoint: ``num_eval`` distinct draws, then every other item of
    a small ``space`` (shuffled) or ``max_train`` more distinct draws; seeded by ``rng``."""
    seen: set = set()

    def distinct(n: int) -> List[Any]:
        out = []
        while len(out) < n:
            item = draw(rng)
            if item not in seen:
                seen.add(item)
                out.append(item)
        return out

    eval_list = distinct(num_eval)
    if space - num_eval <= max_train:
        train = [item for item in enumerate_all() if item not in seen]
        rng.shuffle(train)
        return eval_list, train
    return eval_list, distinct(max_train)
