"""The EOS / mask alignment checks of the rollout audit, applied row by row.

Each check counts violations and names the first offending lines:
    eos_xor_truncated      a row ended with EOS or was truncated, exactly one of the two
    truncated_at_cap       a truncated row has length == max_new_tokens (the mask of a row
                           without EOS covers all T sampled tokens)
    length_within_cap      length <= max_new_tokens
    eos_is_last_token      a row that ended with EOS has token_ids[-1] in the stop set
    no_eos_inside          no stop id before the last counted token (the mask stops at
                           the *first* stop id; a truncated row holds none at all)
    length_matches_tokens  length == len(token_ids)
    logprobs_match_tokens  len(logprobs) == len(token_ids)
    logprobs_valid         every log-prob finite and <= 0
An episode's row (`turns` a list: `rlctl rollout` of a task played as episodes, where stop
ids end every model turn) gets the checks that hold for a transcript instead:
    turns_cover_tokens     the turns' token_ids, in order, are the row's token_ids
    mask_marks_model_turns mask has token_ids' length and is 1 exactly on model turns
    length_is_model_tokens length == sum(mask)
    logprobs_match_tokens, logprobs_valid   as above, on every column (0 on observations)
(shown only for files that hold episodes; there, the checks no row applies to are left out).
"EOS" here is the row's stop set: `stop_token_ids` (the tokenizer's EOS, the model's
generation_config.eos_token_id and rollout.stop_token_ids) or, in files without it,
`eos_token_id` alone. A check whose fields a file lacks is reported as not applicable. Without
max_new_tokens the cap is taken as the longest length in the file.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional

CHECKS = ("eos_xor_truncated", "truncated_at_cap", "length_within_cap", "eos_is_last_token",
          "no_eos_inside", "length_matches_tokens", "logprobs_match_tokens", "logprobs_valid")
EPISODE_CHECKS = ("turns_cover_tokens", "mask_marks_model_turns", "length_is_model_tokens")


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def stop_set(r: dict) -> frozenset:
    """The ids that end row ``r``'s completion: ``stop_token_ids`` if the row lists them
    (any non-numeric entry: none), else ``eos_token_id``; empty when neither is usable."""
    listed = r.get("stop_token_ids")
    if isinstance(listed, list) and listed:
        return frozenset(listed) if all(is_number(v) for v in listed) else frozenset()
    return frozenset([r["eos_token_id"]]) if is_number(r.get("eos_token_id")) else frozenset()


class Checker:
    """The alignment checks, applied row by row while streaming (no row is kept, except
    (line, length, truncated) of rows without max_new_tokens, checked against the longest
    length at the end)."""

    def __init__(self):
        self.checks = {c: {"applicable": 0, "violations": 0, "lines": []}
                       for c in CHECKS + EPISODE_CHECKS}
        self.deferred: List[tuple] = []

    def verdict(self, name: str, ok: bool, lineno: int) -> None:
        c = self.checks[name]
        c["applicable"] += 1
        if not ok:
            c["violations"] += 1
            if len(c["lines"]) < 5:
                c["lines"].append(lineno)

    def _cap(self, lineno: int, length: Optional[int], is_trunc: Optional[bool], cap) -> None:
        if length is None:
            return
        if is_trunc:
            self.verdict("truncated_at_cap", length == cap, lineno)
        self.verdict("length_within_cap", length <= cap, lineno)

    def row(self, lineno: int, r: dict) -> None:
        if isinstance(r.get("turns"), list):
            return self._episode(lineno, r)
        ids = r.get("token_ids") if isinstance(r.get("token_ids"), list) else None
        length = r["length"] if is_number(r.get("length")) else (len(ids) if ids is not None else None)
        ended, trunc = r.get("ended_with_eos"), r.get("truncated")
        if ended is not None and trunc is not None:
            self.verdict("eos_xor_truncated", bool(ended) != bool(trunc), lineno)
        is_trunc = bool(trunc) if trunc is not None else (
            (not ended) if ended is not None else None)
        if is_number(r.get("max_new_tokens")):
            self._cap(lineno, length, is_trunc, r["max_new_tokens"])
        else:
            self.deferred.append((lineno, length, is_trunc))
        if ids is not None:
            self._tokens(lineno, r, ids, ended, is_trunc)

    def _tokens(self, lineno: int, r: dict, ids: list, ended, is_trunc: Optional[bool]) -> None:
        """The checks on token_ids: stop ids where they belong, length and log-probs."""
        verdict = self.verdict
        stops = stop_set(r)
        if stops:
            if ended:
                verdict("eos_is_last_token", bool(ids) and ids[-1] in stops, lineno)
            if is_trunc is not None:
                inside = ids[:-1] if (ids and not is_trunc) else ids
                verdict("no_eos_inside", not stops.intersection(inside), lineno)
        if is_number(r.get("length")):
            verdict("length_matches_tokens", r["length"] == len(ids), lineno)
        lps = r.get("logprobs")
        if isinstance(lps, list):
            verdict("logprobs_match_tokens", len(lps) == len(ids), lineno)
            verdict("logprobs_valid", all(is_number(v) and math.isfinite(v) and v <= 1e-4
                                          for v in lps), lineno)

    def _episode(self, lineno: int, r: dict) -> None:
        """The checks of an episode's row (the module docstring)."""
        ids, mask, turns = r.get("token_ids"), r.get("mask"), r["turns"]
        if not isinstance(ids, list):
            return
        spans = [t for t in turns if isinstance(t, dict)]
        joined = [i for t in spans for i in (t.get("token_ids") or [])]
        self.verdict("turns_cover_tokens", len(spans) == len(turns) and joined == ids, lineno)
        if isinstance(mask, list):
            model = [int(t.get("role") == "model") for t in spans for _ in (t.get("token_ids") or [])]
            self.verdict("mask_marks_model_turns", len(mask) == len(ids) and mask == model, lineno)
            if is_number(r.get("length")):
                self.verdict("length_is_model_tokens", r["length"] == sum(mask), lineno)
        lps = r.get("logprobs")
        if isinstance(lps, list):
            self.verdict("logprobs_match_tokens", len(lps) == len(ids), lineno)
            self.verdict("logprobs_valid", all(is_number(v) and math.isfinite(v) and v <= 1e-4
                                               for v in lps), lineno)

    def finish(self, cap_default: int) -> Dict[str, dict]:
        """Every check's counts; the episode checks only when some row was an episode, and
        then only the checks some row was checked by."""
        for lineno, length, is_trunc in self.deferred:
            self._cap(lineno, length, is_trunc, cap_default)
        self.deferred = []
        mixed = self.checks["turns_cover_tokens"]["applicable"] > 0     # some rows are episodes
        return {k: v for k, v in self.checks.items()
                if v["applicable"] > 0 or not (mixed or k in EPISODE_CHECKS)}
