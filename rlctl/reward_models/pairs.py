"""Preference pairs for a reward-model fit: read (``prompt``, ``chosen``, ``rejected``
columns), split, the fit's length limit, and the pairs whose texts read as the same
tokens once cut to it."""
from __future__ import annotations

import math
import random
import sys
from typing import Dict, List, Optional, Sequence, Tuple

from rlctl.errors import ConfigError, DataError
from rlctl.reward_models.config import RMConfig
from rlctl.reward_models.fit import Pair
from rlctl.reward_models.scoring import keep_end, length_limit, render, token_rows
from rlctl.tasks.data import load_records

COLUMNS = ("prompt", "chosen", "rejected")


def read_pairs(path: str, key: str) -> List[Pair]:
    """Preference rows (prompt, chosen, rejected text; an optional numeric margin)."""
    rows = load_records(path, "auto", key, located=True)
    pairs = []
    for where, row in rows:
        missing = [c for c in COLUMNS if c not in row]
        if missing:
            raise DataError(f"{key}: {where} has no '{missing[0]}' column; a preference row "
                            f"needs {', '.join(COLUMNS)} (and optionally margin); it has "
                            f"{', '.join(map(str, row)) or 'none'}")
        bad = next((c for c in COLUMNS if not isinstance(row[c], str)), None)
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
                          None if margin in (None, "") else margin))
    return pairs


def hold_out(pairs: List[Pair], frac: float, seed: int) -> Tuple[List[Pair], List[Pair]]:
    """(train, held out): a seeded ``frac`` of the pairs held out (at least 1, never all)."""
    if len(pairs) < 2:
        raise DataError("PREFS has one pair: nothing to hold out; pass --eval PREFS_EVAL")
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    held = set(order[:min(len(pairs) - 1, max(1, round(frac * len(pairs))))])
    return ([p for i, p in enumerate(pairs) if i not in held],
            [p for i, p in enumerate(pairs) if i in held])


def fit_limit(rm: RMConfig, tokenizer, model_config) -> Optional[int]:
    """The fit's tokens per text: ``rm.max_length``, saved on the tokenizer (so the
    scorer reads it), or the model's context; ConfigError above that context."""
    context = length_limit(tokenizer, model_config)
    if rm.max_length is None:
        return context
    if context is not None and rm.max_length > context:
        raise ConfigError(f"invalid rm.max_length '{rm.max_length}'; must be <= {context}, "
                          "the model's context (null: the whole context)")
    tokenizer.model_max_length = rm.max_length
    return rm.max_length


def note_truncation(limit: Optional[int], what: str, counts: Dict[str, Tuple[int, int]],
                    stream=None) -> None:
    """One line on stderr when any pair (split: (over the limit, pairs)) is too long."""
    if not any(n for n, _ in counts.values()):
        return
    parts = " and ".join(" ".join(filter(None, (f"{n} of {total}", split, "pairs")))
                         for split, (n, total) in counts.items())
    print(f"rlctl: {what}: {parts} have a text (prompt + answer) longer than {limit} tokens; "
          f"each such text keeps its last {limit} tokens (a leading BOS stays first), the end "
          "of the answer, where the score is read", file=stream or sys.stderr, flush=True)


def same_tokens(tokenizer, pairs: Sequence[Pair], limit: Optional[int]) -> int:
    """How many pairs read the same for chosen and rejected: the same tokens once rendered
    and cut to ``limit`` (what the model reads), so both score alike whatever the model."""
    if not pairs:
        return 0
    rows = token_rows(tokenizer, [render(tokenizer, p.prompt, x)
                                  for p in pairs for x in (p.chosen, p.rejected)])
    rows = [keep_end(r, limit, tokenizer.bos_token_id) for r in rows]
    return sum(rows[2 * i] == rows[2 * i + 1] for i in range(len(pairs)))


def check_identical(tokenizer, limit: Optional[int], train: Sequence[Pair],
                    held: Sequence[Pair], held_key: str, stream=None) -> Dict[str, int]:
    """DataError when every training pair's chosen and rejected read the same (the loss
    cannot move from log 2); one line on stderr counting them when only some do."""
    n_train, n_held = same_tokens(tokenizer, train, limit), same_tokens(tokenizer, held, limit)
    if n_train == len(train):
        raise DataError(f"PREFS: all {len(train)} training pairs have chosen and rejected "
                        "reading as the same tokens (once rendered and cut to the length "
                        "limit): nothing can be learned from them (the loss stays at log 2); "
                        "give pairs whose chosen and rejected answers differ")
    if n_train or n_held:
        print(f"rlctl: {n_train} of {len(train)} training pairs and {n_held} of {len(held)} "
              f"held-out pairs ({held_key}) have chosen == rejected (the same tokens once "
              "rendered): they carry no preference (loss log 2 whatever the model) and a "
              "held-out tie counts as wrong in pairwise accuracy",
              file=stream or sys.stderr, flush=True)
    return {"train_pairs_identical": n_train, "eval_pairs_identical": n_held}
