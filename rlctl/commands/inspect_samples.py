"""`rlctl inspect RUN --samples [--step N]`: a run's sample tables (samples.jsonl, written
by the sinks from rlctl/learner/metrics.py's rows) and the audit's statistics and
reward-hacking signs over them.

Without --step the newest step with a train table is shown (its eval table too, when
that step has one); the audit covers the train rows of every step, or of step N only.
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional

from rlctl.commands.audit import audit_samples
from rlctl.commands.run_record import load_samples
from rlctl.errors import UserError


def _steps(rows: List[dict]) -> Dict[str, List[int]]:
    """{table: its steps, ascending}: train, eval, then any other."""
    out: Dict[str, set] = {}
    for r in rows:
        out.setdefault(str(r["table"]), set()).add(r["step"])
    order = sorted(out, key=lambda t: (["train", "eval"] + [t]).index(t))
    return {t: sorted(out[t]) for t in order}


def _listing(steps: Dict[str, List[int]]) -> str:
    return "; ".join(f"{t}: {', '.join(map(str, s))}" for t, s in steps.items())


def samples_report(path: Path, step: Optional[int] = None) -> dict:
    rows = load_samples(path)
    steps = _steps(rows)
    if step is None:
        shown = max(steps.get("train") or [r["step"] for r in rows])
    elif any(step in s for s in steps.values()):
        shown = step
    else:
        raise UserError(f"{path}/samples.jsonl has no sample table at step {step}; steps with "
                        f"samples: {_listing(steps)}")
    tables = {t: [_columns(r) for r in rows if r["table"] == t and r["step"] == shown]
              for t in steps}
    train = [_columns(r) for r in rows if r["table"] == "train" and (step is None or r["step"] == step)]
    return {"kind": "samples", "run_dir": str(path), "steps": steps, "step": shown,
            "tables": {t: v for t, v in tables.items() if v},
            "audit": audit_samples(train) if train else None,
            "audit_scope": f"train rows of step {step}" if step is not None else
                           f"train rows of all {len(steps.get('train', []))} steps"}


def _columns(row: dict) -> dict:
    """A row's columns as the learner wrote them (the file's "table" key dropped)."""
    return {k: v for k, v in row.items() if k != "table"}
