"""Audit a rollout JSONL file (`rlctl rollout --out`, or any file with the same fields).

The file is read by rlctl.commands.audit_rows, with the EOS / mask alignment checks of
rlctl.commands.audit_checks applied to each row; this module turns the rows into the
report: statistics, reward-hacking signs and sample completions.

Statistics: truncation rate, length and reward spread, the fraction of groups (rows
sharing `group`, size >= 2) whose rewards are all equal (zero std: no GRPO/RLOO learning
signal) or whose completions are all identical, and the Pearson correlation of reward
with length, over all rows and within groups (both centred on their group mean, which
removes prompt difficulty), for the reward and each reward design.

Reward-hacking signs (flagged when over the stated threshold):
    reward_rises_with_length   within-group corr(reward, length) > 0.3: longer answers
                               to the same prompt earn more, the reward may pay for length
    truncated_scores_as_well   mean reward of truncated rows >= that of finished rows
                               (>= 3 truncated rows): unfinished answers are not penalised
    top_rewards_at_length_cap  >= 25% of the top-quartile rewards are truncated rows
    wrong_beats_correct        an incorrect completion scores above the best correct one
                               (needs `correct`); e.g. sorting's unclipped inclusion_order
    repetition_rewarded        >= 20% of completions repeat one token for >= 60% of their
                               (>= 4) tokens, more often than the prompt holds it, and
                               they score at least the mean of the rest

Rows that are episodes (a `turns` list) add `episodes` (their count, statuses and tool
task's count) to the statistics and the episode signs of rlctl.commands.audit_episodes
(tool never called, tool errors rewarded, observations truncated, episodes at the turn
or token limit), each with a count and an example.

``audit_samples`` runs the same statistics and signs over a run's sample tables (the
train rows of samples.jsonl, rlctl/learner/metrics.py): a group is (step, group), a row
is truncated when its finish_reason is "length" (an episode: any status but "done"); the
alignment checks need token ids, which sample rows do not hold.
"""
from __future__ import annotations

import math
from collections import Counter, defaultdict
from pathlib import Path
from typing import Dict, List, Optional

from rlctl.commands.audit_rows import Rows, read_rows, read_samples
from rlctl.errors import UserError
from rlctl.types import LENGTH_LIMIT, TOKEN_LIMIT, TURN_LIMIT

CORR_FLAG, CAP_FLAG, REPEAT_FLAG = 0.3, 0.25, 0.2
# a sample row's finish_reason of a truncated row: the length cap, or an episode's budget
TRUNCATED_ENDINGS = ("length", TURN_LIMIT, TOKEN_LIMIT, LENGTH_LIMIT)


def pearson(xs, ys) -> Optional[float]:
    n = len(xs)
    if n < 2:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    if sxx <= 1e-12 or syy <= 1e-12:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / math.sqrt(sxx * syy)


def _groups(rows: Rows) -> Dict[object, List[int]]:
    groups: Dict[object, List[int]] = defaultdict(list)
    for i, g in enumerate(rows.group):
        if g is not None:
            groups[g].append(i)
    return {g: idx for g, idx in groups.items() if len(idx) >= 2}


def _centred(values: List[float], groups: Dict[object, List[int]]) -> List[float]:
    out = []
    for idx in groups.values():
        mean = sum(values[i] for i in idx) / len(idx)
        out.extend(values[i] - mean for i in idx)
    return out


def _mean(xs) -> Optional[float]:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else None


def _spread(xs: List[float]) -> dict:
    n = len(xs)
    mean = sum(xs) / n
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / n)
    return {"mean": mean, "std": std, "min": min(xs), "max": max(xs)}


def _quantile(xs: List[float], q: float) -> float:
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def audit_rollout(path: Path, examples: int = 3) -> dict:
    rows, bad, checker = read_rows(path)
    n = len(rows.reward)
    if n == 0:
        raise UserError(f"'{path}' holds no rollout rows (JSON lines with reward and length, "
                        "as written by rlctl rollout)")
    cap_default = max(rows.length)
    checks = checker.finish(cap_default)
    # rows without truncated / ended_with_eos: truncated means "reached the cap"
    trunc = [bool(t) if t is not None else length >= cap_default
             for t, length in zip(rows.truncated, rows.length)]
    report = {
        "kind": "rollout", "path": str(path), "rows": n, "bad_lines": len(bad),
        "bad_line_numbers": bad[:5], **_statistics(rows, trunc, _groups(rows)),
        "checks": checks,
        "alignment_ok": all(c["violations"] == 0 for c in checks.values()) and not bad,
    }
    _add_episodes(report, rows, trunc)
    report["samples"] = _samples(path, rows, examples)
    return report


def audit_samples(samples: List[dict]) -> dict:
    """The statistics and reward-hacking signs of sample-table rows (train rows: reward,
    length, finish_reason, group, step, prompt, completion, reward/<name>)."""
    rows = Rows()
    for i, r in enumerate(samples):
        designs = {k[len("reward/"):]: v for k, v in r.items() if k.startswith("reward/")}
        rows.add(i, {**r, "group": (r.get("step"), r.get("group")),
                     "truncated": r.get("finish_reason") in TRUNCATED_ENDINGS, "rewards": designs})
    trunc = [bool(t) for t in rows.truncated]
    report = {"rows": len(samples), **_statistics(rows, trunc, _groups(rows))}
    _add_episodes(report, rows, trunc)
    return report


def _add_episodes(report: dict, rows: Rows, trunc: List[bool]) -> None:
    """The reward-hacking signs; with episodes among the rows, their statistics and signs."""
    report["hacking_signs"] = _hacking_signs(rows, trunc, report)
    if rows.episodes.episodes:
        report["episodes"] = rows.episodes.statistics()
        report["hacking_signs"] += rows.episodes.signs()


def _statistics(rows: Rows, trunc: List[bool], groups: Dict[object, List[int]]) -> dict:
    """The report's statistics, in its key order (groups ... mean_reward_finished)."""
    n = len(rows.reward)
    zero_std = sum(max(rows.reward[i] for i in idx) - min(rows.reward[i] for i in idx) <= 1e-9
                   for idx in groups.values())
    identical = sum(len({rows.text_hash[i] for i in idx}) == 1 for idx in groups.values())
    lengths = [float(x) for x in rows.length]
    return {
        "groups": len(groups),
        "group_sizes": dict(Counter(len(idx) for idx in groups.values())),
        "truncation_rate": sum(trunc) / n,
        "length": {"mean": sum(lengths) / n, "min": min(rows.length), "max": max(rows.length)},
        "reward": _spread(rows.reward),
        "frac_zero_std_groups": zero_std / len(groups) if groups else None,
        "frac_identical_groups": identical / len(groups) if groups else None,
        **_length_correlations(rows, lengths, groups),
        "mean_reward_truncated": _mean(r for r, t in zip(rows.reward, trunc) if t),
        "mean_reward_finished": _mean(r for r, t in zip(rows.reward, trunc) if not t),
    }


def _length_correlations(rows: Rows, lengths: List[float],
                         groups: Dict[object, List[int]]) -> dict:
    """corr(reward, length) over all rows and within groups, and the same for each reward
    design that every row holds."""
    def within(values):
        return pearson(_centred(lengths, groups), _centred(values, groups)) if groups else None

    designs = {name: {"all": pearson(lengths, vals), "within_group": within(vals)}
               for name, vals in rows.designs.items() if len(vals) == len(rows.reward)}
    return {"reward_length_corr": pearson(lengths, rows.reward),
            "reward_length_corr_within_group": within(rows.reward),
            "design_length_corr": designs}


def _hacking_signs(rows: Rows, trunc: List[bool], stats: dict) -> List[dict]:
    signs = []

    def sign(name, value, flagged, why):
        signs.append({"sign": name, "value": value, "flagged": bool(flagged), "why": why})

    corr, corr_within = stats["reward_length_corr"], stats["reward_length_corr_within_group"]
    r_trunc, r_eos = stats["mean_reward_truncated"], stats["mean_reward_finished"]
    c = corr_within if corr_within is not None else corr
    sign("reward_rises_with_length", c, c is not None and c > CORR_FLAG,
         f"corr(reward, length){' within groups' if corr_within is not None else ''} "
         f"> {CORR_FLAG}: longer answers earn more, the reward may pay for length")
    both = r_trunc is not None and r_eos is not None
    sign("truncated_scores_as_well", None if not both else r_trunc - r_eos,
         both and sum(trunc) >= 3 and r_trunc >= r_eos,
         "mean reward of truncated minus finished rows >= 0 (with >= 3 truncated): "
         "unfinished answers are not penalised")
    rewards = rows.reward
    thr = _quantile(rewards, 0.75)
    top = [i for i, r in enumerate(rewards) if r >= thr and r > min(rewards)]
    at_cap = sum(trunc[i] for i in top) / len(top) if top else None
    sign("top_rewards_at_length_cap", at_cap, at_cap is not None and at_cap >= CAP_FLAG,
         f"share of top-quartile rewards that are truncated >= {CAP_FLAG}: the best-paid "
         "completions hit the length cap")
    signs.append(_wrong_beats_correct(rows))
    signs.append(_repetition_rewarded(rows))
    return signs


def _wrong_beats_correct(rows: Rows) -> dict:
    known = [(r, ok) for r, ok in zip(rows.reward, rows.correct) if ok is not None]
    best_correct = max((r for r, ok in known if ok), default=None)
    if best_correct is None:
        return {"sign": "wrong_beats_correct", "value": None, "flagged": False,
                "why": "needs rows with correct=true (none in this file)"}
    frac = sum(1 for r, ok in known if not ok and r > best_correct + 1e-9) / len(known)
    return {"sign": "wrong_beats_correct", "value": frac, "flagged": bool(frac > 0),
            "why": "share of incorrect completions scoring above the best correct one: the "
                   "reward is exploitable"}


def _repetition_rewarded(rows: Rows) -> dict:
    rep, rewards = rows.repetitive, rows.reward
    frac_rep = sum(rep) / len(rep)
    r_rep = _mean(r for r, x in zip(rewards, rep) if x)
    r_rest = _mean(r for r, x in zip(rewards, rep) if not x)
    flagged = frac_rep >= REPEAT_FLAG and r_rep is not None and (r_rest is None or r_rep >= r_rest)
    return {"sign": "repetition_rewarded", "value": frac_rep, "flagged": bool(flagged),
            "why": f"share of completions repeating one token (>= {REPEAT_FLAG} flags when "
                   "they score at least the mean of the rest)"}


def _samples(path: Path, rows: Rows, per_bucket: int) -> Dict[str, List[dict]]:
    """Up to ``per_bucket`` rows of each reward bucket, spread over the bucket."""
    if per_bucket == 0:
        return {}
    buckets = _reward_buckets(rows.reward)
    picks: Dict[int, str] = {}
    for name, idx in buckets.items():
        if not idx:
            continue
        step = max(1, len(idx) // per_bucket)
        for i in idx[::step][:per_bucket]:
            picks[rows.line[i]] = name
    return read_samples(path, picks, [name for name, idx in buckets.items() if idx])


def _reward_buckets(rewards: List[float]) -> Dict[str, List[int]]:
    """Row indices by reward: one bucket per value when there are <= 6 distinct values,
    else low / mid / high thirds."""
    distinct = sorted({round(r, 6) for r in rewards})
    if len(distinct) <= 6:
        return {f"reward = {v:g}": [i for i, r in enumerate(rewards) if round(r, 6) == v]
                for v in distinct}
    q1, q2 = _quantile(rewards, 1 / 3), _quantile(rewards, 2 / 3)
    return {f"low (<= {q1:.3g})": [i for i, r in enumerate(rewards) if r <= q1],
            "mid": [i for i, r in enumerate(rewards) if q1 < r <= q2],
            f"high (> {q2:.3g})": [i for i, r in enumerate(rewards) if r > q2]}
