"""`rlctl inspect RUN --samples [--step N]`: step N's sample tables and the train rows' audit."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Dict, List, Optional

from rich.console import Console
from rich.text import Text

from rlctl.commands.audit.cmd import audit_samples, print_signs, show
from rlctl.commands.audit.rows import is_number
from rlctl.errors import UserError
from rlctl.sinks.jsonl import read_samples

NOT_FIGURES = ("step", "prompt", "completion", "stop_id", "stop_token", "turns")
PROMPT_TAIL = 160        # characters of a prompt shown (its end: the question; --json has all)
# what a row needs to be shown and audited (the producer writes them all)
SAMPLE_NUMBERS = {"train": ("step", "reward", "length"), "eval": ("step",)}


def _listing(steps: Dict[str, List[int]]) -> str:
    return "; ".join(f"{t}: {', '.join(map(str, s))}" for t, s in steps.items())


def samples_report(path: Path, step: Optional[int] = None) -> dict:
    """The tables of ``path``/samples.jsonl at one step and the audit of its train rows."""
    file = path / "samples.jsonl"
    if not file.is_file():
        raise UserError(f"{path} has no samples.jsonl (a run writes one with logger.jsonl=true "
                        "and logger.samples.every > 0, from its first sample table)")
    skipped: List[int] = []
    try:
        rows = read_samples(file, skipped=skipped)
    except ValueError as exc:       # not UTF-8: one line naming the file
        raise UserError(str(exc)) from None
    if skipped:
        shown = ", ".join(map(str, skipped[:5])) + (", ..." if len(skipped) > 5 else "")
        print(f"rlctl: warning: {file}: {len(skipped)} of {len(skipped) + len(rows)} lines skipped, not "
              f"sample rows (line{'s' if len(skipped) > 1 else ''} {shown}); the other {len(rows)} rows "
              "are shown", file=sys.stderr, flush=True)
    if not rows:
        raise UserError(f"{file} holds no sample rows")
    for i, row in enumerate(rows, 1):
        need = SAMPLE_NUMBERS.get(row.get("table"))
        if need is None:
            raise UserError(f"{file}: row {i} has table {row.get('table')!r}; valid: "
                            f"{', '.join(SAMPLE_NUMBERS)}")
        bad = [k for k in need if not is_number(row.get(k))]
        if bad:
            raise UserError(f"{file}: row {i} ({row['table']}) needs numbers in {', '.join(bad)} "
                            f"(required: {', '.join(need)})")
    by_table: Dict[str, set] = {}
    for r in rows:
        by_table.setdefault(str(r["table"]), set()).add(r["step"])
    order = sorted(by_table, key=lambda t: (["train", "eval"] + [t]).index(t))
    steps = {t: sorted(by_table[t]) for t in order}       # train, eval, then any other
    if step is None:
        shown = max(steps.get("train") or [r["step"] for r in rows])
    elif any(step in s for s in steps.values()):
        shown = step
    else:
        raise UserError(f"{path}/samples.jsonl has no sample table at step {step}; steps with "
                        f"samples: {_listing(steps)}")
    columns = [{k: v for k, v in r.items() if k != "table"} for r in rows]   # as the learner wrote
    tables = {t: [c for r, c in zip(rows, columns) if r["table"] == t and r["step"] == shown]
              for t in steps}
    train = [c for r, c in zip(rows, columns)
             if r["table"] == "train" and (step is None or r["step"] == step)]
    return {"kind": "samples", "run_dir": str(path), "steps": steps, "step": shown, "skipped_lines": skipped,
            "tables": {t: v for t, v in tables.items() if v},
            "audit": audit_samples(train) if train else None,
            "audit_scope": f"train rows of step {step}" if step is not None else
                           f"train rows of all {len(steps.get('train', []))} steps"}


def print_samples(report: dict) -> None:
    console = Console()
    console.print(f"[bold]samples[/bold] {report['run_dir']} step {report['step']} "
                  f"(steps with samples: {_listing(report['steps'])})", soft_wrap=True)
    for table, rows in report["tables"].items():
        # one block per row (readable at any width): its figures on one line, then the
        # prompt's end and the completion (an episode: turn by turn), as text (no markup)
        console.print(f"[bold]{table} samples at step {report['step']}[/bold] ({len(rows)} rows)")
        for i, row in enumerate(rows, 1):
            figures = [f"{k} {show(v, 3)}" for k, v in row.items() if k not in NOT_FIGURES]
            if row.get("stop_token") is not None:
                figures.append(f"stop {row['stop_token']} (id {row.get('stop_id')})")
            prompt = str(row.get("prompt", ""))
            if len(prompt) > PROMPT_TAIL:
                prompt = "..." + prompt[-PROMPT_TAIL:]
            console.print(Text(f"#{i} " + " | ".join(figures), style="bold"), soft_wrap=True)
            console.print(Text(f"   prompt:     {prompt!r}"), soft_wrap=True)
            if not isinstance(row.get("turns"), list):
                console.print(Text(f"   completion: {row.get('completion', '')!r}"), soft_wrap=True)
                continue
            k = 0
            for t in row["turns"]:   # model turns numbered with their reward, observations
                if t.get("role") == "model":
                    k += 1
                    line = (f"   model {k}:    {t.get('text', '')!r} "
                            f"(reward {show(t.get('reward'), 3)})")
                else:
                    cut = " [truncated]" if t.get("truncated") else ""
                    line = f"     {t.get('role', 'observation')}: {t.get('text', '')!r}{cut}"
                console.print(Text(line), soft_wrap=True)
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
    print_signs(console, audit)
