"""Preference pairs (prompt, chosen, rejected): the one reader of pairs files, shared by
`rlctl reward-model train` and ``task=preferences`` (preference optimisation, docs/rlhf.md)."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

from rlctl.errors import DataError
from rlctl.tasks.data import check_messages, load_records, prompt_example
from rlctl.tasks.task import SOURCE, build_task, register_task
from rlctl.types import Example

COLUMNS = ("prompt", "chosen", "rejected")


@dataclass
class Pair:
    prompt: Any                        # text, or chat messages (``read_pairs(messages=True)``)
    chosen: str
    rejected: str
    margin: Optional[float] = None     # per-pair margin (a `margin` column); None: the default
    where: str = ""                    # e.g. "prefs.jsonl:3"


def _answer(value: Any) -> Any:
    """An answer given as chat messages: the last message's content; else as given."""
    if isinstance(value, list) and value and all(isinstance(m, dict) and "content" in m for m in value):
        return value[-1]["content"]
    return value


def read_pairs(path: str, key: str, fmt: str = "auto", messages: bool = False) -> List[Pair]:
    """Preference rows (prompt, chosen, rejected text; an optional numeric margin); with
    ``messages`` the prompt may be chat messages and an answer the messages ending in it."""
    rows = load_records(path, fmt, key, located=True)
    pairs = []
    for where, row in rows:
        missing = [c for c in COLUMNS if c not in row]
        if missing:
            raise DataError(f"{key}: {where} has no '{missing[0]}' column; a preference row "
                            f"needs {', '.join(COLUMNS)} (and optionally margin); it has "
                            f"{', '.join(map(str, row)) or 'none'}")
        if messages:
            row = dict(row, chosen=_answer(row["chosen"]), rejected=_answer(row["rejected"]))
        bad = next((c for c in COLUMNS if not isinstance(row[c], str) and not (
            messages and c == "prompt" and _answer(row[c]) is not row[c])), None)
        if bad:
            raise DataError(f"{key}: {where}: '{bad}' must be text, got "
                            f"{type(row[bad]).__name__}")
        margin = row.get("margin")
        if margin is not None and margin != "":
            try:
                margin = float(margin)
            except (TypeError, ValueError):
                margin = float("nan")
            if not math.isfinite(margin):
                raise DataError(f"{key}: {where}: 'margin' must be a finite number, got "
                                f"'{row.get('margin')}'")
        pairs.append(Pair(row["prompt"], row["chosen"], row["rejected"],
                          None if margin in (None, "") else margin, where))
    return pairs


def hold_out(pairs: List[Pair], frac: float, seed: int, key: str = "PREFS",
             instead: str = "pass --eval PREFS_EVAL") -> Tuple[List[Pair], List[Pair]]:
    """(train, held out): a seeded ``frac`` of the pairs held out (at least 1, never all)."""
    if len(pairs) < 2:
        raise DataError(f"{key} has one pair: nothing to hold out; {instead}")
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    held = set(order[:min(len(pairs) - 1, max(1, round(frac * len(pairs))))])
    return ([p for i, p in enumerate(pairs) if i not in held],
            [p for i, p in enumerate(pairs) if i in held])


@register_task("preferences")
class PreferenceTask:
    """Pairs for preference optimisation (``algo=dpo``): read from ``train_path`` (held out:
    ``eval_path`` or a seeded ``eval_frac``), or made by the task ``pairs_from`` (its
    ``preference_pairs``: ``num_pairs`` training pairs, ``num_eval`` held out). A generation
    scores by ``pairs_from``'s reward and check, else 1 when it is the chosen answer."""

    name = "preferences"

    def __init__(self, train_path: Optional[str] = None, eval_path: Optional[str] = None,
                 format: str = "auto", eval_frac: float = 0.1, num_eval: Optional[int] = None,
                 seed: int = 1234, pairs_from: Optional[str] = None, num_pairs: int = 2048,
                 num_digits: Optional[int] = None):
        self.scoring = None
        if pairs_from:
            opts = {} if num_digits is None else {"num_digits": num_digits}
            self.scoring = build_task(pairs_from, **opts)
            make = getattr(self.scoring, "preference_pairs", None)
            if make is None:
                raise DataError(f"task.pairs_from={pairs_from}: that task makes no preference "
                                "pairs (it has no preference_pairs method); valid: sorting")
            train = make(self.scoring.train_examples(), num_pairs, seed)
            held = make(self.scoring.eval_examples(), num_eval or 256, seed + 1)
        elif not train_path:
            raise DataError("task=preferences needs task.train_path=PATH (rows of prompt, "
                            "chosen, rejected) or task.pairs_from=sorting")
        else:
            train = read_pairs(train_path, "task.train_path", format, messages=True)
            if eval_path:
                held = read_pairs(eval_path, "task.eval_path", format, messages=True)
            else:
                train, held = hold_out(train, eval_frac, seed, "task.train_path",
                                       "set task.eval_path")
            held = held[:num_eval]
        held_key = "task.eval_path" if eval_path else "task.train_path"
        self._train = [self._example(p, "task.train_path") for p in train]
        self._eval = [self._example(p, held_key) for p in held]

    @staticmethod
    def _example(p, key: str) -> Example:
        """A pair as an Example (fields chosen, rejected); a task's own pairs come as Examples."""
        if isinstance(p, Example):
            return p
        return prompt_example(p.prompt, {"chosen": p.chosen, "rejected": p.rejected, SOURCE: p.where},
                              p.where, key)

    def train_examples(self) -> List[Example]:
        check_messages(self, self._train[:1] + self._eval[:1], "prompt")
        return list(self._train)

    def eval_examples(self) -> List[Example]:
        check_messages(self, self._train[:1] + self._eval[:1], "prompt")
        return list(self._eval)

    def reward(self, example: Example, completion: str) -> float:
        if self.scoring is not None:
            return self.scoring.reward(example, completion)
        return float(isinstance(completion, str) and completion.strip() == example.fields["chosen"].strip())

    def is_correct(self, example: Example, completion: str) -> bool:
        if self.scoring is not None:
            return self.scoring.is_correct(example, completion)
        return self.reward(example, completion) == 1.0
