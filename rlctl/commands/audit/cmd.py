"""Audit a rollout file or a run's sample rows: statistics, reward-hacking signs (docs/runs.md)."""
from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Dict, List, Optional

from rich.console import Console
from rich.table import Table

from rlctl.commands.audit.rows import EXAMPLE_CHARS, Rows, is_episode, read_rows
from rlctl.errors import UserError
from rlctl.sinks.sink import cell_text
from rlctl.types import LENGTH_LIMIT, TOKEN_LIMIT, TURN_LIMIT

CORR_FLAG, CAP_FLAG, REPEAT_FLAG, DRIFT_FLAG = 0.3, 0.25, 0.2, 0.3
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


def _centred(values: List[float], groups: List[List[int]]) -> List[float]:
    out = []
    for idx in groups:
        mean = sum(values[i] for i in idx) / len(idx)
        out.extend(values[i] - mean for i in idx)
    return out


def _mean(xs) -> Optional[float]:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else None


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
        "bad_line_numbers": bad[:5], **_statistics(rows, trunc),
        "checks": checks,
        "alignment_ok": all(c["violations"] == 0 for c in checks.values()) and not bad,
    }
    _add_episodes(report, rows, trunc)
    report["samples"] = _samples(path, rows, examples)
    return report


def audit_samples(samples: List[dict]) -> dict:
    """The statistics and reward-hacking signs of sample-table rows."""
    rows = Rows()
    for i, r in enumerate(samples):
        designs = {k[len("reward/"):]: v for k, v in r.items() if k.startswith("reward/")}
        rows.add(i, {**r, "group": (r.get("step"), r.get("group")),
                     "truncated": r.get("finish_reason") in TRUNCATED_ENDINGS, "rewards": designs})
    trunc = [bool(t) for t in rows.truncated]
    report = {"rows": len(samples), **_statistics(rows, trunc)}
    _add_episodes(report, rows, trunc)
    return report


def _add_episodes(report: dict, rows: Rows, trunc: List[bool]) -> None:
    """The reward-hacking signs; with episodes among the rows, their statistics and signs."""
    report["hacking_signs"] = _hacking_signs(rows, trunc, report)
    if rows.episodes.episodes:
        t = rows.episodes
        report["episodes"] = {"episodes": t.episodes, "status": dict(t.status),
                              "tool_task_episodes": t.tool_episodes}
        report["hacking_signs"] += rows.episodes.signs()


def _statistics(rows: Rows, trunc: List[bool]) -> dict:
    """The report's statistics, in its key order; a group: the rows sharing ``group`` (>= 2)."""
    by_group: Dict[object, List[int]] = defaultdict(list)
    for i, g in enumerate(rows.group):
        if g is not None:
            by_group[g].append(i)
    groups = [idx for idx in by_group.values() if len(idx) >= 2]
    rewards, n = rows.reward, len(rows.reward)
    zero_std = sum(max(rewards[i] for i in idx) - min(rewards[i] for i in idx) <= 1e-9
                   for idx in groups)
    identical = sum(len({rows.text_hash[i] for i in idx}) == 1 for idx in groups)
    lengths = [float(x) for x in rows.length]
    mean = sum(rewards) / n

    def within(values):     # corr(centred on the group mean: prompt difficulty removed)
        return pearson(_centred(lengths, groups), _centred(values, groups)) if groups else None

    return {
        "groups": len(groups),
        "group_sizes": dict(Counter(len(idx) for idx in groups)),
        "truncation_rate": sum(trunc) / n,
        "length": {"mean": sum(lengths) / n, "min": min(rows.length), "max": max(rows.length)},
        "reward": {"mean": mean, "std": math.sqrt(sum((x - mean) ** 2 for x in rewards) / n),
                   "min": min(rewards), "max": max(rewards)},
        "frac_zero_std_groups": zero_std / len(groups) if groups else None,
        "frac_identical_groups": identical / len(groups) if groups else None,
        "reward_length_corr": pearson(lengths, rewards),
        "reward_length_corr_within_group": within(rewards),
        "design_length_corr": {name: {"all": pearson(lengths, vals), "within_group": within(vals)}
                               for name, vals in rows.designs.items() if len(vals) == n},
        "mean_reward_truncated": _mean(r for r, t in zip(rewards, trunc) if t),
        "mean_reward_finished": _mean(r for r, t in zip(rewards, trunc) if not t),
    }


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
    known = [(r, ok) for r, ok in zip(rows.reward, rows.correct) if ok is not None]
    best_correct = max((r for r, ok in known if ok), default=None)
    if best_correct is None:
        sign("wrong_beats_correct", None, False, "needs rows with correct=true (none in this file)")
    else:
        frac = sum(1 for r, ok in known if not ok and r > best_correct + 1e-9) / len(known)
        sign("wrong_beats_correct", frac, frac > 0, "share of incorrect completions scoring above "
             "the best correct one: the reward is exploitable")
    rep = rows.repetitive
    frac_rep = sum(rep) / len(rep)
    r_rep = _mean(r for r, x in zip(rewards, rep) if x)
    r_rest = _mean(r for r, x in zip(rewards, rep) if not x)
    sign("repeated_answers", frac_rep, frac_rep >= REPEAT_FLAG,
         f"share of completions repeating one token, >= 3 times in a row or in >= 60% of "
         f"them (>= {REPEAT_FLAG} flags): a degenerate format, whatever it scores")
    sign("repetition_rewarded", frac_rep,
         frac_rep >= REPEAT_FLAG and r_rep is not None and (r_rest is None or r_rep >= r_rest),
         f"share of completions repeating one token (>= {REPEAT_FLAG} flags when "
         "they score at least the mean of the rest)")
    drift = _format_drift(rows)
    if drift is None:
        sign("format_drift", None, False, "needs rows from >= 2 steps (a run's sample rows; "
             "rollout rows carry no step)")
    else:
        drop, (before, after) = drift
        sign("format_drift", drop, drop > DRIFT_FLAG and after > before,
             f"share of completions in the early steps' common shapes (digits 9, letters a, "
             f"runs collapsed), early minus late; > {DRIFT_FLAG} flags while the mean reward "
             f"rises ({before:.3g} -> {after:.3g} here): the reward may pay for a new format")
    return signs


def _format_drift(rows: Rows) -> Optional[tuple]:
    """(early share - late share of the rows whose shape is one of the early rows' common
    shapes, (early, late) mean reward), None with < 2 steps. Early / late: the rows of the
    first / last third of the steps (>= 1 step each); common: the early rows' most frequent
    shapes (ties: first seen), taken until they cover at least half of the early rows."""
    steps = sorted({s for s in rows.step if s is not None})
    if len(steps) < 2:
        return None
    k = max(1, len(steps) // 3)
    early = [i for i, s in enumerate(rows.step) if s is not None and s <= steps[k - 1]]
    late = [i for i, s in enumerate(rows.step) if s is not None and s >= steps[-k]]
    common, covered = set(), 0
    for form, count in Counter(rows.shape[i] for i in early).most_common():
        if 2 * covered >= len(early):
            break
        common.add(form)
        covered += count

    def share(idx):
        return sum(rows.shape[i] in common for i in idx) / len(idx)
    rewards = [_mean(rows.reward[i] for i in idx) for idx in (early, late)]
    return share(early) - share(late), tuple(rewards)


def _samples(path: Path, rows: Rows, per_bucket: int) -> Dict[str, List[dict]]:
    """Up to ``per_bucket`` rows of each reward bucket, spread over the bucket: one bucket
    per value when there are <= 6 distinct values, else low / mid / high thirds."""
    if per_bucket == 0:
        return {}
    rewards = rows.reward
    distinct = sorted({round(r, 6) for r in rewards})
    if len(distinct) <= 6:
        buckets = {f"reward = {v:g}": [i for i, r in enumerate(rewards) if round(r, 6) == v]
                   for v in distinct}
    else:
        q1, q2 = _quantile(rewards, 1 / 3), _quantile(rewards, 2 / 3)
        buckets = {f"low (<= {q1:.3g})": [i for i, r in enumerate(rewards) if r <= q1],
                   "mid": [i for i, r in enumerate(rewards) if q1 < r <= q2],
                   f"high (> {q2:.3g})": [i for i, r in enumerate(rewards) if r > q2]}
    picks: Dict[int, str] = {}
    for name, idx in buckets.items():
        step = max(1, len(idx) // per_bucket)
        for i in idx[::step][:per_bucket]:
            picks[rows.line[i]] = name
    out: Dict[str, List[dict]] = {name: [] for name, idx in buckets.items() if idx}
    with path.open(encoding="utf-8") as fh:     # the picked lines, re-read for their texts
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


def show(value: Any, digits: int = 4) -> str:
    """A compact cell: ``digits`` significant digits for floats, YAML-like null/true/false."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and math.isfinite(value):
        return f"{value:.{digits}g}"
    return str(value)


def print_audit(report: dict) -> None:
    console = Console()
    console.print(f"[bold]rollout audit[/bold] {report['path']}", soft_wrap=True)
    t = Table(title="statistics", show_header=False)
    t.add_column("stat")
    t.add_column("value", justify="right")
    sizes = ", ".join(f"{n} x {s}" for s, n in sorted(report["group_sizes"].items()))
    r, ln = report["reward"], report["length"]
    for label, value in (
            ("rows", report["rows"]), ("unreadable lines", report["bad_lines"]),
            ("groups (size >= 2)", f"{report['groups']}" + (f" ({sizes})" if sizes else "")),
            ("truncation rate", report["truncation_rate"]),
            ("length mean / min / max", f"{ln['mean']:.3g} / {ln['min']} / {ln['max']}"),
            ("reward mean / std / min / max",
             " / ".join(f"{r[k]:.3g}" for k in ("mean", "std", "min", "max"))),
            ("zero-std groups", report["frac_zero_std_groups"]),
            ("identical-completion groups", report["frac_identical_groups"]),
            ("corr(reward, length)", report["reward_length_corr"]),
            ("corr(reward, length) within groups", report["reward_length_corr_within_group"]),
            ("mean reward truncated / finished",
             f"{show(report['mean_reward_truncated'])} / {show(report['mean_reward_finished'])}"),
    ):
        t.add_row(label, show(value))
    for name, c in report["design_length_corr"].items():
        t.add_row(f"corr({name}, length) all / within",
                  f"{show(c['all'])} / {show(c['within_group'])}")
    console.print(t)
    t = Table(title="EOS / mask alignment: " + ("ok" if report["alignment_ok"] else "PROBLEMS"))
    for col in ("check", "rows checked", "violations", "first lines"):
        t.add_column(col)
    for name, c in report["checks"].items():
        if c["applicable"] == 0:
            t.add_row(name, "n/a (fields absent)", "", "")
        else:
            t.add_row(name, str(c["applicable"]), str(c["violations"]),
                      ", ".join(map(str, c["lines"])))
    console.print(t)
    print_signs(console, report)
    for bucket, samples in report["samples"].items():
        console.print(f"[bold]{bucket}[/bold]")
        for s in samples:
            flag = " [truncated]" if s["truncated"] else ""
            text = s["turns"] if "turns" in s else s["completion"]
            console.print(f"  line {s['line']}: {s['prompt']!r} -> {text!r} "
                          f"(reward {show(s['reward'])}, length {s['length']}{flag})",
                          markup=False, soft_wrap=True)


def print_signs(console, report: dict) -> None:
    """The reward-hacking signs' table, then each episode sign's count and first example."""
    t = Table(title="reward-hacking signs")
    for col in ("sign", "value", "flag", "meaning"):
        t.add_column(col)
    for s in report["hacking_signs"]:
        value = show(s["value"]) + (f" ({s['count']})" if "count" in s else "")
        t.add_row(s["sign"], value, "FLAG" if s["flagged"] else "ok", s["why"])
    console.print(t)
    for s in report["hacking_signs"]:
        e = s.get("example")
        if e is None:
            continue
        where = f"line {e['line']}" if e.get("step") is None else f"step {e['step']} (row {e['line']})"
        console.print(f"{s['sign']}: {s['count']} episode(s); e.g. {where}: {e['prompt']!r} -> "
                      f"{e['turns']!r} (reward {show(e['reward'])}, {e['status']})",
                      markup=False, soft_wrap=True)
