"""The audit's signs for rows that are episodes (a `turns` list: `rlctl rollout` of a task
played as episodes, or the sample rows of such a run), each with a count and the first
example (its line in a rollout file, or its index among the audited sample rows and its
step; the prompt, the turns as one line, reward, status):

    tool_never_called        episodes of a tool task (tool_task true) that never called a
                             tool; flagged when >= 50% of them: the policy answers without
                             its tool (the call format lost, or never learned)
    tool_errors_rewarded     episodes with a failed tool call (tool_errors > 0) that still
                             got reward > 0; flagged at any: failed calls are not penalised
    observations_truncated   episodes with an observation cut to
                             rollout.episode.max_obs_tokens; flagged at any: the model acts
                             on text it never saw in full
    episodes_at_turn_limit   episodes ended by rollout.episode.max_turns; flagged when >= 25%
    episodes_at_token_limit  episodes ended by rollout.episode.max_tokens or the model's
                             context (token_limit, length_limit); flagged when >= 25%

Value: the share of the episodes the sign is about (of the tool task's for the first).
"""
from __future__ import annotations

from collections import Counter
from typing import Callable, Dict, List, Optional

from rlctl.commands.audit_checks import is_number
from rlctl.sinks.base import cell_text
from rlctl.types import LENGTH_LIMIT, TOKEN_LIMIT, TURN_LIMIT

TOOL_IDLE_FLAG, LIMIT_FLAG = 0.5, 0.25
EXAMPLE_CHARS = 300


def _count(row: dict, key: str) -> int:
    return int(row[key]) if is_number(row.get(key)) else 0


# sign -> whether an episode's row counts for it
TESTS: Dict[str, Callable[[dict], bool]] = {
    "tool_never_called": lambda r: bool(r.get("tool_task")) and _count(r, "tool_calls") == 0,
    "tool_errors_rewarded": lambda r: _count(r, "tool_errors") > 0 and float(r["reward"]) > 0,
    "observations_truncated": lambda r: _count(r, "obs_truncated") > 0,
    "episodes_at_turn_limit": lambda r: r.get("status") == TURN_LIMIT,
    "episodes_at_token_limit": lambda r: r.get("status") in (TOKEN_LIMIT, LENGTH_LIMIT),
}
WHY = {
    "tool_never_called": f"share of a tool task's episodes that never called a tool (>= {TOOL_IDLE_FLAG} "
                         "flags): the policy answers without its tool",
    "tool_errors_rewarded": "share of episodes with a failed tool call that still got reward > 0 "
                            "(any flags): failed calls are not penalised",
    "observations_truncated": "share of episodes with an observation cut to "
                              "rollout.episode.max_obs_tokens (any flags): the model acts on cut text",
    "episodes_at_turn_limit": f"share of episodes ended by rollout.episode.max_turns (>= {LIMIT_FLAG} flags)",
    "episodes_at_token_limit": "share of episodes ended by rollout.episode.max_tokens or the model's "
                               f"context (>= {LIMIT_FLAG} flags)",
}


def is_episode(row: dict) -> bool:
    return isinstance(row.get("turns"), list)


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
        for sign, test in TESTS.items():
            if test(row):
                self.counts[sign] += 1
                self.examples.setdefault(sign, _example(lineno, row))

    def statistics(self) -> dict:
        return {"episodes": self.episodes, "status": dict(self.status),
                "tool_task_episodes": self.tool_episodes}

    def signs(self) -> List[dict]:
        out = []
        for sign in TESTS:
            n = self.counts[sign]
            of = self.tool_episodes if sign == "tool_never_called" else self.episodes
            value: Optional[float] = n / of if of else None
            out.append({"sign": sign, "value": value, "flagged": _flagged(sign, n, value),
                        "why": WHY[sign] if of else "n/a: no row has tool_task true (not a tool task)",
                        "count": n, "example": self.examples.get(sign)})
        return out


def _flagged(sign: str, n: int, value: Optional[float]) -> bool:
    if value is None or n == 0:
        return False
    if sign == "tool_never_called":
        return value >= TOOL_IDLE_FLAG
    if sign.startswith("episodes_at_"):
        return value >= LIMIT_FLAG
    return True


def _example(lineno: int, row: dict) -> dict:
    return {"line": lineno, "step": row.get("step"), "prompt": str(row.get("prompt", ""))[:200],
            "turns": cell_text(row["turns"])[:EXAMPLE_CHARS], "reward": row.get("reward"),
            "status": row.get("status")}
