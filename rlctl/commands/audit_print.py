"""A rollout audit (`rlctl.commands.audit.audit_rollout`) printed as rich tables:
statistics, EOS/mask alignment checks, reward-hacking signs, sample completions."""
from __future__ import annotations

import math
from typing import Any

from rich.console import Console
from rich.table import Table


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
