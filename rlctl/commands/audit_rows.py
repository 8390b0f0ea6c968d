"""A rollout JSONL file read for the audit: one streaming pass into compact per-row
columns (the alignment checks applied on the way; unreadable lines counted), and the
few sampled lines re-read for their texts."""
from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Dict, List, Optional

from rlctl.commands.audit_checks import Checker, is_number
from rlctl.commands.audit_episodes import EXAMPLE_CHARS, EpisodeTally, is_episode
from rlctl.errors import UserError
from rlctl.sinks.base import cell_text


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
        for name, value in (row.get("rewards") or {}).items():
            if is_number(value):
                self.designs[name].append(float(value))
        if is_episode(row):
            self.episodes.add(lineno, row)


def _repetitive(text: str, prompt: str) -> bool:
    """One token makes up >= 60% of >= 4 tokens, and occurs more often than in the prompt
    (so sorting "9 9 9 3 9" for that prompt is not repetition, "1 1 1 1 1" is)."""
    toks = text.split()
    if len(toks) < 4:
        return False
    tok, count = Counter(toks).most_common(1)[0]
    return count / len(toks) >= 0.6 and count > max(prompt.split().count(tok), 1)


def _usable(row) -> bool:
    """A row the audit can count: a mapping with a numeric reward and a length (or token_ids)."""
    return isinstance(row, dict) and is_number(row.get("reward")) and (
        is_number(row.get("length")) or isinstance(row.get("token_ids"), list))


def read_rows(path: Path):
    """(Rows, numbers of unreadable lines, Checker with every row's checks applied)."""
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
                bad.append(lineno)
                continue
            if not _usable(row):
                bad.append(lineno)
                continue
            checker.row(lineno, row)
            rows.add(lineno, row)
    return rows, bad, checker


def read_samples(path: Path, picks: Dict[int, str], buckets: List[str]) -> Dict[str, List[dict]]:
    """The rows at the line numbers of ``picks`` (line -> bucket name), truncated texts,
    grouped by bucket in file order; every name of ``buckets`` is a key."""
    out: Dict[str, List[dict]] = {name: [] for name in buckets}
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if lineno in picks:
                row = json.loads(line)
                sample = {
                    "line": lineno, "prompt": str(row.get("prompt", ""))[:200],
                    "completion": str(row.get("completion", ""))[:200],
                    "reward": row["reward"], "length": row.get("length"),
                    "truncated": row.get("truncated"), "correct": row.get("correct")}
                if is_episode(row):     # the turns as one line: model turns and observations
                    sample["turns"] = cell_text(row["turns"])[:EXAMPLE_CHARS]
                out[picks[lineno]].append(sample)
    return out
