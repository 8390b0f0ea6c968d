"""`rlctl inspect PATH...`: the PATH arguments pick the report (one run dir, several run
dirs: inspect_report; a rollout JSONL file: audit; a run's sample tables: inspect_samples);
this module dispatches, prints and writes --json."""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from rlctl.commands.audit import audit_rollout
from rlctl.commands.audit_print import print_audit
from rlctl.commands.files import is_run_dir, write_json
from rlctl.commands.inspect_report import (MISSING, compare_runs, inspect_run, print_compare,
                                           print_run)
from rlctl.commands.inspect_samples import print_samples, samples_report
from rlctl.errors import UserError


def classify(paths: Sequence[str]) -> tuple:
    """("runs", [Path]), ("rollout", Path) or ("samples", [Path]) for a run's
    samples.jsonl; one-line errors for anything else."""
    if not paths:
        raise UserError("inspect needs a PATH: a run directory, several run directories, or a "
                        "rollout .jsonl file")
    flags = [p for p in paths if p.startswith("-")]
    if flags:
        raise UserError(f"unknown option '{flags[0]}'; options: --out-dir DIR, --json FILE, "
                        "--no-plots, --examples N, --samples, --step N, --debug")
    runs, files, samples = [], [], []
    for p in paths:
        path = Path(p).expanduser()
        if not path.exists():
            raise UserError(f"no such file or directory: '{p}'")
        if path.is_dir():
            if not is_run_dir(path):
                raise UserError(f"'{p}' is not a run directory (no config.yaml)")
            runs.append(path)
        elif path.name == "metrics.jsonl" and is_run_dir(path.parent):
            runs.append(path.parent)
        elif path.name == "samples.jsonl" and is_run_dir(path.parent):
            samples.append(path.parent)
        elif path.suffix == ".jsonl":
            files.append(path)
        else:
            raise UserError(f"'{p}' is neither a run directory nor a rollout .jsonl file")
    if len(files) + len(samples) + bool(runs) > 1 or len(files) > 1:
        raise UserError("inspect takes one rollout .jsonl file, one run's samples.jsonl, or run "
                        "directories; not several kinds")
    if samples:
        return "samples", samples
    return ("rollout", files[0]) if files else ("runs", runs)


def run_inspect(paths: Sequence[str], out_dir: Optional[str] = None,
                json_out: Optional[str] = None, plots: bool = True, examples: int = 3,
                quiet: bool = False, samples: bool = False, step: Optional[int] = None) -> dict:
    kind, what = classify(paths)
    if examples < 0:
        raise UserError(f"--examples must be >= 0 (got {examples})")
    samples = samples or kind == "samples"
    if step is not None and not samples:
        raise UserError("--step N picks a sample table: use it with --samples")
    if samples:
        if kind == "rollout" or len(what) != 1:
            raise UserError("--samples reads one run directory (its samples.jsonl); got "
                            + ("a rollout file" if kind == "rollout" else f"{len(what)} runs"))
        report, printer = samples_report(what[0], step), print_samples
    elif kind == "rollout":
        try:
            report, printer = audit_rollout(what, examples=examples), print_audit
        except UnicodeDecodeError as exc:
            raise UserError(f"cannot read '{what}': not UTF-8 text (byte "
                            f"{exc.object[exc.start]:#04x}); a rollout file is JSON Lines, as "
                            "`rlctl rollout --out` writes") from None
    elif len(what) == 1:
        report, printer = inspect_run(what[0], Path(out_dir) if out_dir else None, plots), print_run
    else:
        report = compare_runs(what, Path(out_dir) if out_dir else Path.cwd(), plots)
        printer = print_compare
    if not quiet:
        printer(report)
    if json_out:
        write_json(Path(json_out), _jsonable(report))
        if not quiet:
            print(f"wrote {json_out}")
    return report


def _jsonable(obj):
    if obj is MISSING:
        return "(absent)"
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, float) and obj != obj:
        return None
    return obj
