"""A task prepared for one model: ``prepare`` builds, once per process, the prompts the
model reads and what its scorers are given; the task itself is never changed.

- chat (``task.prompt_format=chat``): each prompt through the model's chat template
  (``rlctl.tasks.base.render_chat``; ``Example.fields[RAW_PROMPT]`` keeps it as written),
  and the end-of-turn markers at which the scorer cuts a completion to the assistant's
  reply;
- the budget: prompts kept within ``rollout.max_prompt_tokens`` under
  ``task.long_prompts`` (``rlctl.tasks.long_prompts``). The limit is by default the
  model's context (``max_position_embeddings``, or GPT-2's ``n_positions``) minus
  ``rollout.max_new_tokens``; an explicit value must leave room for the completion too.

``rlctl train`` (every rank and the local engine processes), ``rlctl eval`` and ``rlctl
rollout`` all prepare through ``rlctl.run.build.prepare_task``, so all of them see the
same prompts for the same config.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, Optional, Tuple

from rlctl.errors import UserError
from rlctl.tasks.base import RAW_PROMPT, end_of_turn_markers, render_chat, task_options
from rlctl.tasks.long_prompts import limit_prompts
from rlctl.tasks.scoring import RewardScorer
from rlctl.types import Example

CONTEXT_KEYS = ("max_position_embeddings", "n_positions")   # GPT2Config maps the first to the second


def context_length(model) -> Optional[int]:
    """Positions the model was built for: the first config among its modules (wrappers:
    value heads, peft, DeepSpeed engines) that names one; None when none does."""
    for module in model.modules():
        config = getattr(module, "config", None)
        for key in CONTEXT_KEYS:
            value = getattr(config, key, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


@dataclass(frozen=True)
class PromptBudget:
    """``rollout.max_new_tokens`` and ``rollout.max_prompt_tokens`` (None: the model's
    context minus the completion)."""
    max_new_tokens: int
    max_prompt_tokens: Optional[int] = None

    @classmethod
    def from_config(cls, cfg) -> "PromptBudget":
        """From the composed config's ``rollout`` section (an older run's config may lack
        ``max_prompt_tokens``: None)."""
        return cls(int(cfg.rollout.max_new_tokens), cfg.rollout.get("max_prompt_tokens"))


def prompt_limit(budget: PromptBudget, model) -> Optional[Tuple[int, str]]:
    """(max prompt tokens, how messages name it), or None: no limit set and none known."""
    new, asked = budget.max_new_tokens, budget.max_prompt_tokens
    ctx = context_length(model)
    if asked is None:
        if ctx is None:
            return None
        if ctx - new <= 0:
            raise UserError(f"rollout.max_new_tokens={new} leaves no room for a prompt in the "
                            f"model's context of {ctx} positions; use rollout.max_new_tokens < {ctx}")
        return ctx - new, (f"rollout.max_prompt_tokens={ctx - new} (the model's context {ctx} "
                           f"minus rollout.max_new_tokens {new})")
    if ctx is not None and asked + new > ctx:
        raise UserError(f"rollout.max_prompt_tokens={asked} plus rollout.max_new_tokens={new} "
                        f"exceeds the model's context of {ctx} positions; use "
                        f"rollout.max_prompt_tokens <= {ctx - new} (or null: {ctx - new})")
    return int(asked), f"rollout.max_prompt_tokens={asked}"


@dataclass(frozen=True)
class Prepared:
    """The task, its prompts as the model reads them (train and eval splits, rendered and
    within the budget), the chat end-of-turn markers (None for raw prompts) and the learned
    reward models (``rlctl.reward_models.learned.LearnedRewards`` or None). ``scorer``
    builds a ``RewardScorer`` given all of them."""
    task: Any
    train: Tuple[Example, ...]
    eval: Tuple[Example, ...]
    markers: Optional[Tuple[str, ...]] = None
    learned: Any = None

    def scorer(self, **options) -> RewardScorer:
        return RewardScorer(self.task, self.learned, self.markers, **options)


def _rendered(ex: Example, tokenizer, system: Optional[str]) -> Example:
    raw = ex.fields.get(RAW_PROMPT, ex.prompt)
    return Example(prompt=render_chat(tokenizer, raw, system), fields={**ex.fields, RAW_PROMPT: raw})


def prepare(task, tokenizer, budget: Optional[PromptBudget] = None, model=None, learned=None,
            stream=None, quiet: bool = False) -> Prepared:
    """``task`` prepared for ``tokenizer`` and (with ``budget`` and ``model``) the model's
    context; the count of prompts skipped or truncated goes to stderr in one line (on
    rank 0, unless ``quiet``). UserError, one line: no chat template, a chat prompt that
    is not text or messages, a limit with no room, a prompt over the limit under
    ``task.long_prompts=error``, or a split left empty."""
    opts = task_options(task)
    try:
        markers: Optional[Tuple[str, ...]] = None
        if opts.prompt_format == "chat":
            render_chat(tokenizer, "x")     # fails early, one line, without a chat template
            markers = tuple(end_of_turn_markers(tokenizer))
    except ValueError as exc:
        raise UserError(f"task.prompt_format: {exc}") from None
    limit = prompt_limit(budget, model) if budget is not None and model is not None else None
    try:
        splits = {"train": task.train_examples(), "eval": task.eval_examples()}
        if markers is not None:
            splits = {k: [_rendered(ex, tokenizer, opts.system_prompt) for ex in v] for k, v in splits.items()}
        if limit is not None:
            splits, report = limit_prompts(opts.long_prompts, tokenizer, splits, *limit)
            line = report.line()
            if line and not quiet and os.environ.get("RANK", "0") == "0":
                print(f"rlctl: {line}", file=stream or sys.stderr, flush=True)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    return Prepared(task, tuple(splits["train"]), tuple(splits["eval"]), markers, learned)
