"""Prompts longer than the model can take (``task.long_prompts``).

A prompt of P tokens followed by ``rollout.max_new_tokens`` new ones needs P + T
positions. Past the model's context, a model with learned absolute positions (GPT-2)
fails with an index error in the middle of a run, and a rotary one (Llama, Qwen, Gemma)
silently runs at positions it was never trained on. So once the prompts are rendered for
the model's tokenizer, ``limit_prompts`` counts every prompt's tokens exactly as the sampler
encodes them (``tokenizer(prompt)``, special tokens included, after the chat template)
and applies the task's ``long_prompts`` option to the prompts over the limit:

- ``skip``: they are left out of both splits, and counted (``LongPromptCounts.line``);
- ``truncate_left``: only their last ``max_tokens`` tokens are kept (the tokenizer's own
  special tokens, e.g. a BOS, stay in front), as verl's ``truncation=left``; the reward
  still sees the whole prompt (``Example.fields[RAW_PROMPT]``);
- ``error``: the first one is refused, naming its row and the limits.

``rlctl.tasks.prompt_budget.prepare`` applies it to the rendered prompts of both splits
and keeps the result (the task itself is not changed), so it works for any task.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from rlctl.tasks.base import RAW_PROMPT, SOURCE
from rlctl.types import Example

_CHUNK = 512   # prompts per tokenizer call


@dataclass
class LongPromptCounts:
    """What ``limit_prompts`` did: per split, (prompts over the limit, prompts)."""
    mode: str
    limits: str                    # e.g. "rollout.max_prompt_tokens=16 (...)"
    counts: Dict[str, Tuple[int, int]] = field(default_factory=dict)

    def line(self) -> Optional[str]:
        """One line for stderr when any prompt was over the limit (None otherwise)."""
        if not any(n for n, _ in self.counts.values()):
            return None
        verb = "skipped" if self.mode == "skip" else "truncated on the left"
        parts = [f"{n} of {total} {split} prompts" for split, (n, total) in self.counts.items()]
        return f"task.long_prompts={self.mode}: {verb} {' and '.join(parts)} longer than {self.limits}"


def token_counts(tokenizer, prompts: Sequence[str]) -> List[int]:
    """Tokens of each prompt as the sampler encodes it (special tokens included)."""
    out: List[int] = []
    for start in range(0, len(prompts), _CHUNK):
        out.extend(len(ids) for ids in tokenizer(list(prompts[start:start + _CHUNK]))["input_ids"])
    return out


def upper_bounds(tokenizer, prompts: Sequence[str]) -> List[int]:
    """A bound on each prompt's token count without tokenizing it: every token of a
    byte-level BPE, WordPiece/WordLevel or byte-fallback SentencePiece vocabulary covers at
    least one UTF-8 byte, plus the special tokens the tokenizer adds and one for a
    SentencePiece dummy prefix. (20k sorting prompts: tokenizing them all takes ~1 s.)"""
    specials = len(tokenizer("")["input_ids"]) + 1
    return [len(p.encode("utf-8")) + specials for p in prompts]


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


def _where(example: Example, split: str, index: int) -> str:
    return str(example.fields.get(SOURCE) or f"{split} prompt {index + 1}")


def _apply(mode: str, tokenizer, examples: List[Example], max_tokens: int, split: str,
           limits: str) -> Tuple[List[Example], int]:
    """(the examples kept, how many were over the limit) for one split."""
    lengths = upper_bounds(tokenizer, [ex.prompt for ex in examples])              # most fit surely
    maybe = [i for i, n in enumerate(lengths) if n > max_tokens]
    for i, n in zip(maybe, token_counts(tokenizer, [examples[i].prompt for i in maybe])):
        lengths[i] = n                                                             # exact
    kept, over = [], 0
    for i, (ex, n) in enumerate(zip(examples, lengths)):
        if n <= max_tokens:
            kept.append(ex)
            continue
        over += 1
        if mode == "error":
            raise ValueError(f"task.long_prompts=error: {_where(ex, split, i)}: the prompt has {n} "
                             f"tokens, more than {limits}; shorten it, or use "
                             "task.long_prompts=skip or truncate_left")
        if mode == "truncate_left":
            fields = {**ex.fields, RAW_PROMPT: ex.fields.get(RAW_PROMPT, ex.prompt)}
            kept.append(Example(prompt=truncate_left(tokenizer, ex.prompt, max_tokens), fields=fields))
    if examples and not kept:
        raise ValueError(f"task.long_prompts=skip: all {len(examples)} {split} prompts are longer "
                         f"than {limits}; use task.long_prompts=truncate_left or shorter prompts")
    return kept, over


def limit_prompts(mode: str, tokenizer, splits: Dict[str, List[Example]], max_tokens: int,
                  limits: str) -> Tuple[Dict[str, List[Example]], LongPromptCounts]:
    """(each split's prompts kept under ``mode`` = ``task.long_prompts``, what was done) for
    prompts over ``max_tokens`` tokens (``limits``: how the limit is named in messages).
    ``splits`` is not changed. ValueError: one line (mode error, or a split left with no
    prompts)."""
    report, kept = LongPromptCounts(mode, limits), {}
    for split, examples in splits.items():
        kept[split], over = _apply(mode, tokenizer, examples, max_tokens, split, limits)
        report.counts[split] = (over, len(examples))
    return kept, report
