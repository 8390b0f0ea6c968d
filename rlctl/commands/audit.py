"""Audit a rollout JSONL file (`rlctl rollout --out`, or any file with the same fields).

Alignment checks (each counts violations and names the first offending lines):
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
"EOS" here is the row's stop set: `stop_token_ids` (the tokenizer's EOS, the model's
generation_config.eos_token_id and rollout.stop_token_ids) or, in files without it,
`eos_token_id` alone. A check whose fields a file lacks is reported as not applicable. Without
max_new_tokens the cap is taken as the longest length in the file.

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
"""
from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from pathlib import Path
from typing import Dict, List, Optional

from rlctl.errors import UserError

CHECKS = ("eos_xor_truncated", "truncated_at_cap", "length_within_cap", "eos_is_last_token",
          "no_eos_inside", "length_matches_tokens", "logprobs_match_tokens", "logprobs_valid")
CORR_FLAG, CAP_FLAG, REPEAT_FLAG = 0.3, 0.25, 0.2


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


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _repetitive(text: str, prompt: str) -> bool:
    """One token makes up >= 60% of >= 4 tokens, and occurs more often than in the prompt
    (so sorting "9 9 9 3 9" for that prompt is not repetition, "1 1 1 1 1" is)."""
    toks = text.split()
    if len(toks) < 4:
        return False
    tok, count = Counter(toks).most_common(1)[0]
    return count / len(toks) >= 0.6 and count > max(prompt.split().count(tok), 1)


class _Rows:
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


def _read(path: Path):
    rows, bad, checker = _Rows(), [], _Checker()
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
            if not isinstance(row, dict) or not _num(row.get("reward")) or not (
                    _num(row.get("length")) or isinstance(row.get("token_ids"), list)):
                bad.append(lineno)
                continue
            checker.row(lineno, row)
            length = int(row["length"]) if _num(row.get("length")) else len(row["token_ids"])
            ended = row.get("ended_with_eos")
            trunc = row.get("truncated")
            rows.line.append(lineno)
            rows.reward.append(float(row["reward"]))
            rows.length.append(length)
            rows.truncated.append(bool(trunc) if trunc is not None else
                                  (not ended if ended is not None else None))
            rows.group.append(row.get("group"))
            rows.correct.append(row.get("correct") if isinstance(row.get("correct"), bool)
                                else None)
            text = str(row.get("completion", ""))
            rows.text_hash.append(hash(text))
            rows.repetitive.append(_repetitive(text, str(row.get("prompt", ""))))
            for name, value in (row.get("rewards") or {}).items():
                if _num(value):
                    rows.designs[name].append(float(value))
    return rows, bad, checker


class _Checker:
    """The alignment checks, applied row by row while streaming (no row is kept, except
    (line, length, truncated) of rows without max_new_tokens, checked against the longest
    length at the end)."""

    def __init__(self):
        self.checks = {c: {"applicable": 0, "violations": 0, "lines": []} for c in CHECKS}
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
        verdict = self.verdict
        ids = r.get("token_ids") if isinstance(r.get("token_ids"), list) else None
        length = r["length"] if _num(r.get("length")) else (len(ids) if ids is not None else None)
        ended, trunc = r.get("ended_with_eos"), r.get("truncated")
        stops = _stop_set(r)
        if ended is not None and trunc is not None:
            verdict("eos_xor_truncated", bool(ended) != bool(trunc), lineno)
        is_trunc = bool(trunc) if trunc is not None else (
            (not ended) if ended is not None else None)
        if _num(r.get("max_new_tokens")):
            self._cap(lineno, length, is_trunc, r["max_new_tokens"])
        else:
            self.deferred.append((lineno, length, is_trunc))
        if ids is not None and stops:
            if ended:
                verdict("eos_is_last_token", bool(ids) and ids[-1] in stops, lineno)
            if is_trunc is not None:
                inside = ids[:-1] if (ids and not is_trunc) else ids
                verdict("no_eos_inside", not stops.intersection(inside), lineno)
        if ids is not None and _num(r.get("length")):
            verdict("length_matches_tokens", r["length"] == len(ids), lineno)
        lps = r.get("logprobs")
        if ids is not None and isinstance(lps, list):
            verdict("logprobs_match_tokens", len(lps) == len(ids), lineno)
            verdict("logprobs_valid", all(_num(v) and math.isfinite(v) and v <= 1e-4
                                          for v in lps), lineno)

    def finish(self, cap_default: int) -> Dict[str, dict]:
        for lineno, length, is_trunc in self.deferred:
            self._cap(lineno, length, is_trunc, cap_default)
        self.deferred = []
        return self.checks


def _stop_set(r: dict) -> frozenset:
    """The ids that end row ``r``'s completion: ``stop_token_ids`` if the row lists them
    (any non-numeric entry: none), else ``eos_token_id``; empty when neither is usable."""
    listed = r.get("stop_token_ids")
    if isinstance(listed, list) and listed:
        return frozenset(listed) if all(_num(v) for v in listed) else frozenset()
    return frozenset([r["eos_token_id"]]) if _num(r.get("eos_token_id")) else frozenset()


def _groups(rows: _Rows) -> Dict[object, List[int]]:
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


def audit_rollout(path: Path, examples: int = 3) -> dict:
    rows, bad, checker = _read(path)
    n = len(rows.reward)
    if n == 0:
        raise UserError(f"'{path}' holds no rollout rows (JSON lines with reward and length, "
                        "as written by rlctl rollout)")
    cap_default = max(rows.length)
    checks = checker.finish(cap_default)
    # rows without truncated / ended_with_eos: truncated means "reached the cap"
    trunc = [bool(t) if t is not None else length >= cap_default
             for t, length in zip(rows.truncated, rows.length)]
    groups = _groups(rows)
    zero_std = sum(max(rows.reward[i] for i in idx) - min(rows.reward[i] for i in idx) <= 1e-9
                   for idx in groups.values())
    identical = sum(len({rows.text_hash[i] for i in idx}) == 1 for idx in groups.values())
    lengths = [float(x) for x in rows.length]
    corr = pearson(lengths, rows.reward)
    corr_within = pearson(_centred(lengths, groups), _centred(rows.reward, groups)) \
        if groups else None
    design_corr = {}
    for name, vals in rows.designs.items():
        if len(vals) == n:
            within = pearson(_centred(lengths, groups), _centred(vals, groups)) if groups else None
            design_corr[name] = {"all": pearson(lengths, vals), "within_group": within}
    r_trunc = _mean(r for r, t in zip(rows.reward, trunc) if t)
    r_eos = _mean(r for r, t in zip(rows.reward, trunc) if not t)
    report = {
        "kind": "rollout", "path": str(path), "rows": n, "bad_lines": len(bad),
        "bad_line_numbers": bad[:5], "groups": len(groups),
        "group_sizes": dict(Counter(len(idx) for idx in groups.values())),
        "truncation_rate": sum(trunc) / n,
        "length": {"mean": sum(lengths) / n, "min": min(rows.length), "max": max(rows.length)},
        "reward": _spread(rows.reward),
        "frac_zero_std_groups": zero_std / len(groups) if groups else None,
        "frac_identical_groups": identical / len(groups) if groups else None,
        "reward_length_corr": corr, "reward_length_corr_within_group": corr_within,
        "design_length_corr": design_corr,
        "mean_reward_truncated": r_trunc, "mean_reward_finished": r_eos,
        "checks": checks,
        "alignment_ok": all(c["violations"] == 0 for c in checks.values()) and not bad,
    }
    report["hacking_signs"] = _hacking_signs(rows, trunc, corr, corr_within, r_trunc, r_eos)
    report["samples"] = _samples(path, rows, examples)
    return report


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


def _hacking_signs(rows: _Rows, trunc, corr, corr_within, r_trunc, r_eos) -> List[dict]:
    signs = []

    def sign(name, value, flagged, why):
        signs.append({"sign": name, "value": value, "flagged": bool(flagged), "why": why})

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
    known = [(r, ok) for r, ok in zip(rewards, rows.correct) if ok is not None]
    best_correct = max((r for r, ok in known if ok), default=None)
    if best_correct is None:
        sign("wrong_beats_correct", None, False,
             "needs rows with correct=true (none in this file)")
    else:
        frac = sum(1 for r, ok in known if not ok and r > best_correct + 1e-9) / len(known)
        sign("wrong_beats_correct", frac, frac > 0,
             "share of incorrect completions scoring above the best correct one: the reward "
             "is exploitable")
    rep = rows.repetitive
    frac_rep = sum(rep) / len(rep)
    r_rep = _mean(r for r, x in zip(rewards, rep) if x)
    r_rest = _mean(r for r, x in zip(rewards, rep) if not x)
    sign("repetition_rewarded", frac_rep,
         frac_rep >= REPEAT_FLAG and r_rep is not None and (r_rest is None or r_rep >= r_rest),
         f"share of completions repeating one token (>= {REPEAT_FLAG} flags when they score "
         "at least the mean of the rest)")
    return signs


def _samples(path: Path, rows: _Rows, per_bucket: int) -> Dict[str, List[dict]]:
    if per_bucket == 0:
        return {}
    rewards = rows.reward
    distinct = sorted({round(r, 6) for r in rewards})
    buckets: Dict[str, List[int]] = {}
    if len(distinct) <= 6:
        for v in distinct:
            buckets[f"reward = {v:g}"] = [i for i, r in enumerate(rewards) if round(r, 6) == v]
    else:
        q1, q2 = _quantile(rewards, 1 / 3), _quantile(rewards, 2 / 3)
        buckets[f"low (<= {q1:.3g})"] = [i for i, r in enumerate(rewards) if r <= q1]
        buckets["mid"] = [i for i, r in enumerate(rewards) if q1 < r <= q2]
        buckets[f"high (> {q2:.3g})"] = [i for i, r in enumerate(rewards) if r > q2]
    picks: Dict[int, str] = {}
    for name, idx in buckets.items():
        if not idx:
            continue
        step = max(1, len(idx) // per_bucket)
        for i in idx[::step][:per_bucket]:
            picks[rows.line[i]] = name
    out: Dict[str, List[dict]] = {name: [] for name, idx in buckets.items() if idx}
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if lineno in picks:
                row = json.loads(line)
                out[picks[lineno]].append({
                    "line": lineno, "prompt": str(row.get("prompt", ""))[:200],
                    "completion": str(row.get("completion", ""))[:200],
                    "reward": row["reward"], "length": row.get("length"),
                    "truncated": row.get("truncated"), "correct": row.get("correct")})
    return out
