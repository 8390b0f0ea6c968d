"""Bind a task to the loaded model: chat prompts through its template, and prompts kept
within the context (``rollout.max_prompt_tokens``, ``task.long_prompts``).

``rlctl train`` (every rank and the local engine processes), ``rlctl eval`` and
``rlctl rollout`` all call ``bind_task`` once the model and tokenizer are loaded, so all
of them see the same prompts for the same config (``PromptBudget.from_config``). The limit is
``rollout.max_prompt_tokens``, by default the model's context (``max_position_embeddings``,
or GPT-2's ``n_positions``) minus ``rollout.max_new_tokens``; an explicit value must
leave room for the completion in the context too.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Optional, Tuple

from rlctl.errors import UserError
from rlctl.tasks.base import bind_tokenizer
from rlctl.tasks.long_prompts import limit_prompts

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


def bind_task(budget: PromptBudget, task, tokenizer, model, stream=None, quiet: bool = False) -> None:
    """Bind ``task`` to the model's tokenizer and keep its prompts within ``budget``; the
    count of prompts skipped or truncated goes to stderr in one line (on rank 0, unless
    ``quiet``). UserError, one line: no chat template, a limit with no room, a prompt
    over the limit under ``task.long_prompts=error``, or a split left empty."""
    try:
        bind_tokenizer(task, tokenizer)      # chat prompts render with the model's template
    except ValueError as exc:
        raise UserError(f"task.prompt_format: {exc}") from None
    limit = prompt_limit(budget, model)
    if limit is None:
        return
    try:
        report = limit_prompts(task, tokenizer, *limit)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    line = report.line()
    if line and not quiet and os.environ.get("RANK", "0") == "0":
        print(f"rlctl: {line}", file=stream or sys.stderr, flush=True)
