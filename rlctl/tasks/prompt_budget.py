"""A task prepared for one model (``prepare``): chat template, ``task.long_prompts`` budget."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from rlctl.errors import UserError
from rlctl.tasks.task import RAW_PROMPT, SOURCE, end_of_turn_markers, render_chat, task_options
from rlctl.tasks.scoring import RewardScorer
from rlctl.types import Example

CONTEXT_KEYS = ("max_position_embeddings", "n_positions")   # GPT2Config maps the first to the second
_CHUNK = 512   # prompts per tokenizer call


def context_length(model) -> Optional[int]:
    """Positions the model was built for: the first module config (of wrappers too) naming one."""
    for module in model.modules():
        config = getattr(module, "config", None)
        for key in CONTEXT_KEYS:
            value = getattr(config, key, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def prompt_limit(rollout, model) -> Optional[Tuple[int, str]]:
    """(max prompt tokens, how messages name it) for the config's ``rollout`` section (an
    older run's may lack ``max_prompt_tokens``: None), or None: no limit set and none known."""
    new, asked = int(rollout.max_new_tokens), rollout.get("max_prompt_tokens")
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


def token_lengths(tokenizer, prompts: Sequence[str], max_tokens: int) -> List[int]:
    """Each prompt's tokens as the sampler encodes it, exact for those over ``max_tokens`` by
    a bound first (UTF-8 bytes + specials + a dummy prefix: a token covers at least a byte)."""
    specials = len(tokenizer("")["input_ids"]) + 1
    lengths = [len(p.encode("utf-8")) + specials for p in prompts]
    maybe = [i for i, n in enumerate(lengths) if n > max_tokens]
    for start in range(0, len(maybe), _CHUNK):
        part = maybe[start:start + _CHUNK]
        for i, ids in zip(part, tokenizer([prompts[i] for i in part])["input_ids"]):
            lengths[i] = len(ids)
    return lengths


def truncate_left(tokenizer, prompt: str, max_tokens: int) -> str:
    """The end of ``prompt`` whose encoding is its last tokens, at most ``max_tokens`` with
    the special tokens the tokenizer adds. ValueError when those alone fill the limit."""
    content = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    extra = len(tokenizer(prompt)["input_ids"]) - len(content)     # e.g. a BOS
    keep = max_tokens - extra
    if keep <= 0:
        raise ValueError(f"a limit of {max_tokens} tokens leaves no room for prompt text after the "
                         f"{extra} special tokens the tokenizer adds")
    try:
        enc = tokenizer(prompt, add_special_tokens=False, return_offsets_mapping=True)
        # a token's text starts where the one before it ends (offsets may leave out its space)
        starts = [0] + [end for _, end in enc["offset_mapping"][:-1]]
        candidates = [prompt[s:] for s in starts[-keep:]]
    except (NotImplementedError, TypeError, KeyError):   # slow tokenizers have no offsets
        candidates = [tokenizer.decode(content[-k:]) for k in range(keep, 0, -1)]
    for text in candidates:                 # longest first; re-encoding may merge differently
        if len(tokenizer(text)["input_ids"]) <= max_tokens:
            return text
    raise ValueError(f"no end of the prompt fits in {max_tokens} tokens")


def limit_prompts(mode: str, tokenizer, examples: List[Example], max_tokens: int, limits: str,
                  split: str) -> Tuple[List[Example], int]:
    """(the examples of a split kept under ``mode``, how many were over ``max_tokens``); ValueError."""
    lengths = token_lengths(tokenizer, [ex.prompt for ex in examples], max_tokens)
    kept, over = [], 0
    for i, (ex, n) in enumerate(zip(examples, lengths)):
        if n <= max_tokens:
            kept.append(ex)
            continue
        over += 1
        if mode == "error":
            where = ex.fields.get(SOURCE) or f"{split} prompt {i + 1}"
            raise ValueError(f"task.long_prompts=error: {where}: the prompt has {n} "
                             f"tokens, more than {limits}; shorten it, or use "
                             "task.long_prompts=skip or truncate_left")
        if mode == "truncate_left":
            fields = {**ex.fields, RAW_PROMPT: ex.fields.get(RAW_PROMPT, ex.prompt)}
            kept.append(Example(prompt=truncate_left(tokenizer, ex.prompt, max_tokens), fields=fields))
    if examples and not kept:
        raise ValueError(f"task.long_prompts=skip: all {len(examples)} {split} prompts are longer "
                         f"than {limits}; use task.long_prompts=truncate_left or shorter prompts")
    return kept, over


@dataclass(frozen=True)
class Prepared:
    """A task with its prompts as the model reads them, chat markers, learned reward models, scorer."""
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


def prepare(task, tokenizer, rollout=None, model=None, learned=None,
            stream=None, quiet: bool = False) -> Prepared:
    """``task`` prepared for ``tokenizer`` and (with the config's ``rollout`` section and
    ``model``) its context, skipped or truncated prompts counted on stderr (rank 0, unless
    ``quiet``). UserError, one line, on no chat template, no room or an empty split."""
    opts = task_options(task)
    try:
        markers: Optional[Tuple[str, ...]] = None
        if opts.prompt_format == "chat":
            render_chat(tokenizer, "x")     # fails early, one line, without a chat template
            markers = tuple(end_of_turn_markers(tokenizer))
    except ValueError as exc:
        raise UserError(f"task.prompt_format: {exc}") from None
    limit = prompt_limit(rollout, model) if rollout is not None and model is not None else None
    try:
        splits: Dict[str, List[Example]] = {"train": task.train_examples(),
                                            "eval": task.eval_examples()}
        if markers is not None:
            splits = {k: [_rendered(ex, tokenizer, opts.system_prompt) for ex in v]
                      for k, v in splits.items()}
        if limit is not None:
            counts = []
            for split, examples in list(splits.items()):
                splits[split], over = limit_prompts(opts.long_prompts, tokenizer, examples,
                                                    *limit, split)
                counts.append((over, f"{over} of {len(examples)} {split} prompts"))
            verb = "skipped" if opts.long_prompts == "skip" else "truncated on the left"
            if any(n for n, _ in counts) and not quiet and os.environ.get("RANK", "0") == "0":
                print(f"rlctl: task.long_prompts={opts.long_prompts}: {verb} "
                      f"{' and '.join(p for _, p in counts)} longer than {limit[1]}",
                      file=stream or sys.stderr, flush=True)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    return Prepared(task, tuple(splits["train"]), tuple(splits["eval"]), markers, learned)
