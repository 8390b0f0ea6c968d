"""A rollout JSONL file read for the audit in one streaming pass, checks applied on the way."""
from __future__ import annotations

import json
import math
import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Dict, List, Optional

from rlctl.errors import UserError
from rlctl.sinks.sink import cell_text
from rlctl.types import LENGTH_LIMIT, TOKEN_LIMIT, TURN_LIMIT

CHECKS = ("eos_xor_truncated", "truncated_at_cap", "length_within_cap", "eos_is_last_token",
          "no_eos_inside", "length_matches_tokens", "logprobs_match_tokens", "logprobs_valid")
EPISODE_CHECKS = ("turns_cover_tokens", "mask_marks_model_turns", "length_is_model_tokens")
TOOL_IDLE_FLAG, LIMIT_FLAG = 0.5, 0.25
EXAMPLE_CHARS = 300


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def stop_set(r: dict) -> frozenset:
    """The ids that end row ``r``'s completion: ``stop_token_ids`` if the row lists them
    (any non-numeric entry: none), else ``eos_token_id``; empty when neither is usable."""
    listed = r.get("stop_token_ids")
    if isinstance(listed, list) and listed:
        return frozenset(listed) if all(is_number(v) for v in listed) else frozenset()
    return frozenset([r["eos_token_id"]]) if is_number(r.get("eos_token_id")) else frozenset()


def is_episode(row: dict) -> bool:
    return isinstance(row.get("turns"), list)


class Checker:
    """The alignment checks, applied row by row while streaming."""

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
        ids = r.get("token_ids") if isinstance(r.get("token_ids"), list) else None
        if is_episode(r):
            return self._episode(lineno, r, ids) if ids is not None else None
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
        if ids is None:
            return
        stops = stop_set(r)
        if stops and ended:
            self.verdict("eos_is_last_token", bool(ids) and ids[-1] in stops, lineno)
        if stops and is_trunc is not None:
            inside = ids[:-1] if (ids and not is_trunc) else ids
            self.verdict("no_eos_inside", not stops.intersection(inside), lineno)
        if is_number(r.get("length")):
            self.verdict("length_matches_tokens", r["length"] == len(ids), lineno)
        self._logprobs(lineno, r, ids)

    def _episode(self, lineno: int, r: dict, ids: list) -> None:
        mask, turns = r.get("mask"), r["turns"]
        spans = [t for t in turns if isinstance(t, dict)]
        joined = [i for t in spans for i in (t.get("token_ids") or [])]
        self.verdict("turns_cover_tokens", len(spans) == len(turns) and joined == ids, lineno)
        if isinstance(mask, list):
            model = [int(t.get("role") == "model") for t in spans for _ in (t.get("token_ids") or [])]
            self.verdict("mask_marks_model_turns", len(mask) == len(ids) and mask == model, lineno)
            if is_number(r.get("length")):
                self.verdict("length_is_model_tokens", r["length"] == sum(mask), lineno)
        self._logprobs(lineno, r, ids)

    def _logprobs(self, lineno: int, r: dict, ids: list) -> None:
        lps = r.get("logprobs")
        if isinstance(lps, list):
            self.verdict("logprobs_match_tokens", len(lps) == len(ids), lineno)
            self.verdict("logprobs_valid", all(is_number(v) and math.isfinite(v) and v <= 1e-4
                                               for v in lps), lineno)

    def finish(self, cap_default: int) -> Dict[str, dict]:
        """Every check's counts (the episode checks only those some row was checked by)."""
        for lineno, length, is_trunc in self.deferred:
            self._cap(lineno, length, is_trunc, cap_default)
        mixed = self.checks["turns_cover_tokens"]["applicable"] > 0     # some rows are episodes
        return {k: v for k, v in self.checks.items()
                if v["applicable"] > 0 or not (mixed or k in EPISODE_CHECKS)}


def _count(row: dict, key: str) -> int:
    return int(row[key]) if is_number(row.get(key)) else 0


# sign -> (whether an episode's row counts for it, the share that flags it, why)
EPISODE_SIGNS: Dict[str, tuple] = {
    "tool_never_called": (
        lambda r: bool(r.get("tool_task")) and _count(r, "tool_calls") == 0, TOOL_IDLE_FLAG,
        f"share of a tool task's episodes that never called a tool (>= {TOOL_IDLE_FLAG} "
        "flags): the policy answers without its tool"),
    "tool_errors_rewarded": (
        lambda r: _count(r, "tool_errors") > 0 and float(r["reward"]) > 0, 0.0,
        "share of episodes with a failed tool call that still got reward > 0 "
        "(any flags): failed calls are not penalised"),
    "observations_truncated": (
        lambda r: _count(r, "obs_truncated") > 0, 0.0,
        "share of episodes with an observation cut to "
        "rollout.episode.max_obs_tokens (any flags): the model acts on cut text"),
    "episodes_at_turn_limit": (
        lambda r: r.get("status") == TURN_LIMIT, LIMIT_FLAG,
        f"share of episodes ended by rollout.episode.max_turns (>= {LIMIT_FLAG} flags)"),
    "episodes_at_token_limit": (
        lambda r: r.get("status") in (TOKEN_LIMIT, LENGTH_LIMIT), LIMIT_FLAG,
        "share of episodes ended by rollout.episode.max_tokens or the model's "
        f"context (>= {LIMIT_FLAG} flags)"),
}


class EpisodeTally:
    """The episodes' counts, streamed row by row (only each sign's first example is kept)."""

    def __init__(self):
        self.episodes = self.tool_episodes = 0
        self.status: Counter = Counter()
        self.counts: Counter = Counter()
        self.examples: Dict[str, dict] = {}

    def add(self, lineno: int, row: dict) -> None:
        self.episodes += 1
        self.tool_episodes += bool(row.get("tool_task"))
        self.status[str(row.get("status"))] += 1
        for sign, (test, _, _) in EPISODE_SIGNS.items():
            if test(row):
                self.counts[sign] += 1
                self.examples.setdefault(sign, {
                    "line": lineno, "step": row.get("step"),
                    "prompt": str(row.get("prompt", ""))[:200],
                    "turns": cell_text(row["turns"])[:EXAMPLE_CHARS], "reward": row.get("reward"),
                    "status": row.get("status")})

    def signs(self) -> List[dict]:
        out = []
        for sign, (_, flag, why) in EPISODE_SIGNS.items():
            n = self.counts[sign]
            of = self.tool_episodes if sign == "tool_never_called" else self.episodes
            value: Optional[float] = n / of if of else None
            out.append({"sign": sign, "value": value,
                        "flagged": value is not None and n > 0 and value >= flag,
                        "why": why if of else "n/a: no row has tool_task true (not a tool task)",
                        "count": n, "example": self.examples.get(sign)})
        return out


class Rows:
    """Compact per-row columns (texts are re-read for the few samples shown)."""

    def __init__(self):
        self.line: List[int] = []
        self.reward: List[float] = []
        self.length: List[int] = []
        self.truncated: List[bool] = []
        self.group: List[object] = []
        self.correct: List[Optional[bool]] = []
        self.text_hash: List[int] = []
        self.repetitive: List[bool] = []
        self.step: List[Optional[float]] = []     # a sample row's step (None: a rollout row)
        self.shape: List[str] = []
        self.designs: Dict[str, List[Optional[float]]] = defaultdict(list)
        self.episodes = EpisodeTally()        # rows that are episodes (a turns list)

    def add(self, lineno: int, row: dict) -> None:
        length = int(row["length"]) if is_number(row.get("length")) else len(row["token_ids"])
        ended = row.get("ended_with_eos")
        trunc = row.get("truncated")
        self.line.append(lineno)
        self.reward.append(float(row["reward"]))
        self.length.append(length)
        self.truncated.append(bool(trunc) if trunc is not None else
                              (not ended if ended is not None else None))
        self.group.append(row.get("group"))
        self.correct.append(row.get("correct") if isinstance(row.get("correct"), bool)
                            else None)
        text = str(row.get("completion", ""))
        self.text_hash.append(hash(text))
        self.repetitive.append(_repetitive(text, str(row.get("prompt", ""))))
        self.step.append(row["step"] if is_number(row.get("step")) else None)
        self.shape.append(shape(text))
        for name, value in (row.get("rewards") or {}).items():
            if is_number(value):
                self.designs[name].append(float(value))
        if is_episode(row):
            self.episodes.add(lineno, row)


def shape(text: str) -> str:
    """A completion's format: digits -> 9, letters -> a, whitespace -> one space, other
    characters kept, runs of one character collapsed, then runs of words ("The answer is 94." -> "a 9.",
    "94. 94. 94." -> "9. 9. 9.")."""
    out: List[str] = []
    for ch in text.strip():
        c = "9" if ch.isdigit() else "a" if ch.isalpha() else " " if ch.isspace() else ch
        if not out or out[-1] != c:
            out.append(c)
    return re.sub(r"a( a)+", "a", "".join(out))     # prose of any word count: one shape


def _repetitive(text: str, prompt: str) -> bool:
    """A token (whitespace-split, trailing ``.,;:!?`` dropped) that makes up >= 60% of >= 4
    tokens, or that comes >= 3 times in a row ("94. 94. 94."), more often than the prompt
    holds it (so sorting "9 9 9 3 9" for that prompt is not repetition, "1 1 1 1 1" is)."""
    toks = [t.rstrip(".,;:!?") or t for t in text.split()]
    if len(toks) < 3:
        return False
    held = Counter(t.rstrip(".,;:!?") or t for t in prompt.split())
    tok, count = Counter(toks).most_common(1)[0]
    if len(toks) >= 4 and count / len(toks) >= 0.6 and count > max(held[tok], 1):
        return True
    run = 1
    for a, b in zip(toks, toks[1:]):
        run = run + 1 if a == b else 1
        if run >= 3 and run > held[b]:
            return True
    return False


def read_rows(path: Path):
    """(Rows, numbers of unreadable lines, Checker with every row's checks applied); a
    usable row is a mapping with a numeric reward and a length (or token_ids)."""
    rows, bad, checker = Rows(), [], Checker()
    try:
        fh = path.open(encoding="utf-8")
    except OSError as exc:
        raise UserError(f"cannot read '{path}': {exc.strerror or exc}") from None
    with fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            if not (isinstance(row, dict) and is_number(row.get("reward")) and (
                    is_number(row.get("length")) or isinstance(row.get("token_ids"), list))):
                bad.append(lineno)
                continue
            checker.row(lineno, row)
            rows.add(lineno, row)
    return rows, bad, checker
