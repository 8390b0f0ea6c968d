"""Print the reports of `rlctl.commands.inspect_report` as rich tables: one run (config
against the defaults, metric summary, plots written) and several runs side by side; and
a run's sample tables with their audit (`rlctl.commands.inspect_samples`)."""
from __future__ import annotations

from typing import Dict, List, Optional

from rich.console import Console
from rich.table import Table
from rich.text import Text

from rlctl.commands.audit_print import print_examples, signs_table
from rlctl.commands.fmt import show

PROMPT_TAIL = 160        # characters of a prompt shown (its end: the question; --json has all)


def _console():
    return Console()


def print_run(report: dict) -> None:
    console = _console()
    console.print(f"[bold]run[/bold] {report['run_dir']}", soft_wrap=True)
    if report["overrides"]:
        console.print("overrides: " + " ".join(report["overrides"]), soft_wrap=True,
                      markup=False)
    table = Table(title="config differing from the defaults")
    for col in ("key", "default", "run"):
        table.add_column(col, no_wrap=col == "key")
    for key, v in report["config_diff"].items():
        table.add_row(key, show(v["default"]), show(v["run"]))
    if not report["config_diff"]:
        table.add_row("(none)", "", "")
    console.print(table)
    if report["keys_not_in_run"]:
        console.print(f"{len(report['keys_not_in_run'])} default key(s) not in this run's "
                      "config (added since the run?): " + ", ".join(report["keys_not_in_run"]),
                      soft_wrap=True, markup=False)
    _print_metrics(console, report["metrics"], report["metrics_source"], report["steps"])
    _print_plots(console, report)


def _print_metrics(console, metrics: dict, source: Optional[str], steps: int) -> None:
    if source is None:
        console.print("no metrics logged (no metrics.jsonl; logger=none or logger.jsonl=false?)")
        return
    table = Table(title=f"metrics ({source}, {steps} steps; -: not logged; min in --json)")
    for col in ("metric", "first", "last", "max", "best@step"):
        table.add_column(col, justify="left" if col == "metric" else "right",
                         no_wrap=True)
    for key, m in metrics.items():
        if m is None:
            table.add_row(key, "-", "-", "-", "-")
            continue
        best = "" if m["best"] is None else f"{show(m['best'], 3)}@{m['best_step']}"
        table.add_row(key, show(m["first"], 3), show(m["last"], 3), show(m["max"], 3), best)
    console.print(table)


def _print_plots(console, report: dict) -> None:
    for p in report["plots"]:
        console.print(f"wrote {p}", soft_wrap=True, markup=False)
    if report["plots_skipped"]:
        console.print("no data for plot(s): " + ", ".join(report["plots_skipped"]))


def print_compare(report: dict) -> None:
    console = _console()
    labels = report["runs"]
    table = Table(title=f"config keys that differ between {len(labels)} runs")
    table.add_column("key", no_wrap=True)
    for label in labels:
        table.add_column(label, overflow="fold")
    for key, values in report["config_diff"].items():
        table.add_row(key, *[show(values[lb]) for lb in labels])
    if not report["config_diff"]:
        table.add_row("(no differing values)", *[""] * len(labels))
    console.print(table)
    _print_partial_keys(console, report)
    console.print(_compare_metrics_table(report))
    _print_plots(console, report)


def _print_partial_keys(console, report: dict) -> None:
    partial = report["keys_not_in_every_run"]
    if partial and report.get("mixed_kinds"):
        console.print(_kind_sections(partial), soft_wrap=True, markup=False)
    elif partial:
        console.print("keys only some runs hold (config schema changed between runs?): "
                      + ", ".join(f"{k} [{', '.join(v)}]" for k, v in partial.items()),
                      soft_wrap=True, markup=False)


def _kind_sections(partial: Dict[str, List[str]]) -> str:
    """One line for RL and reward-model runs compared: the config sections only one kind
    has (by section, not key by key: a different command, not a changed schema)."""
    sections: Dict[tuple, set] = {}
    for key, holders in partial.items():
        sections.setdefault(tuple(holders), set()).add(key.split(".")[0] + ".*")
    return ("RL and reward-model runs compared: only the keys both kinds hold are compared; "
            + "; ".join(f"{', '.join(sorted(secs))} [{', '.join(holders)}]"
                        for holders, secs in sections.items()))


def _compare_metrics_table(report: dict) -> Table:
    labels = report["runs"]
    table = Table(title="metrics: last (best)")
    table.add_column("metric", no_wrap=True)
    for label in labels:
        table.add_column(label, justify="right", overflow="fold")
    for key in report["summary_keys"]:
        cells = []
        for label in labels:
            m = report["metrics"][label].get(key)
            if m is None:
                cells.append("-")
            else:
                best = "" if m["best"] is None else f" ({show(m['best'])})"
                cells.append(show(m["last"]) + best)
        if any(c != "-" for c in cells):
            table.add_row(key, *cells)
    return table


def print_samples(report: dict) -> None:
    console = _console()
    console.print(f"[bold]samples[/bold] {report['run_dir']} step {report['step']} "
                  f"(steps with samples: " + "; ".join(
                      f"{t}: {', '.join(map(str, s))}" for t, s in report["steps"].items()) + ")",
                  soft_wrap=True)
    for table, rows in report["tables"].items():
        _print_table(console, f"{table} samples at step {report['step']}", rows)
    audit = report["audit"]
    if audit is None:
        console.print("no train rows to audit")
        return
    r, ln = audit["reward"], audit["length"]
    console.print(f"audit of {report['audit_scope']} ({audit['rows']} rows, {audit['groups']} "
                  f"groups): reward mean {show(r['mean'], 3)} std {show(r['std'], 3)}; length mean "
                  f"{show(ln['mean'], 3)}; truncated {show(audit['truncation_rate'], 3)}; "
                  f"zero-std groups {show(audit['frac_zero_std_groups'], 3)}", soft_wrap=True,
                  markup=False)
    console.print(signs_table(audit))
    print_examples(console, audit)


def _print_table(console, title: str, rows: List[dict]) -> None:
    """One block per row (readable at any width): its figures on one line, then the
    prompt's end and the completion, as text (no markup)."""
    console.print(f"[bold]{title}[/bold] ({len(rows)} rows)")
    for i, row in enumerate(rows, 1):
        figures = [f"{k} {show(v, 3)}" for k, v in row.items()
                   if k not in ("step", "prompt", "completion", "stop_id", "stop_token", "turns")]
        if row.get("stop_token") is not None:
            figures.append(f"stop {row['stop_token']} (id {row.get('stop_id')})")
        prompt = str(row.get("prompt", ""))
        if len(prompt) > PROMPT_TAIL:
            prompt = "..." + prompt[-PROMPT_TAIL:]
        console.print(Text(f"#{i} " + " | ".join(figures), style="bold"), soft_wrap=True)
        console.print(Text(f"   prompt:     {prompt!r}"), soft_wrap=True)
        if isinstance(row.get("turns"), list):
            _print_turns(console, row["turns"])
        else:
            console.print(Text(f"   completion: {row.get('completion', '')!r}"), soft_wrap=True)


def _print_turns(console, turns: List[dict]) -> None:
    """An episode turn by turn: model turns numbered with their reward, observations
    indented under them (marked when cut to max_obs_tokens)."""
    k = 0
    for t in turns:
        if t.get("role") == "model":
            k += 1
            line = f"   model {k}:    {t.get('text', '')!r} (reward {show(t.get('reward'), 3)})"
        else:
            cut = " [truncated]" if t.get("truncated") else ""
            line = f"     {t.get('role', 'observation')}: {t.get('text', '')!r}{cut}"
        console.print(Text(line), soft_wrap=True)
