"""`rlctl inspect PATH...`: a run's report, runs compared, a rollout's audit or sample tables."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import yaml
from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table

from rlctl.commands.audit.cmd import audit_rollout, print_audit, show
from rlctl.commands.files import is_run_dir, write_json
from rlctl.commands.inspect.samples import print_samples, samples_report
from rlctl.commands.inspect.plots import PLOTS, REWARD_MODEL_PLOTS, plot_curves, plot_proxy_gold, series
from rlctl.config.compose import compose, flatten
from rlctl.errors import UserError
from rlctl.rm.settings import default_config as reward_model_defaults
from rlctl.sinks.jsonl import read_jsonl


class _Missing(str):
    """A key a config lacks: shown and written as "(absent)", told apart by identity."""


MISSING = _Missing("(absent)")


@dataclass
class Run:
    path: Path
    config: Dict[str, Any]                 # flattened dotted keys
    rows: List[dict]                       # metric rows with a "step"
    metrics_source: Optional[str]
    overrides: Dict[str, Any] = field(default_factory=dict)

    @property
    def reward_model(self) -> bool:
        """A run of `rlctl reward-model train` (its own config: rm.*, data.*)."""
        return any(k.startswith("rm.") for k in self.config)


def load_run(path: Path) -> Run:
    try:
        config = yaml.safe_load((path / "config.yaml").read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read {path}/config.yaml: {' '.join(str(exc).split())[:200]}") \
            from None
    if not isinstance(config, dict):
        raise UserError(f"{path}/config.yaml is not a mapping of config keys")
    rows, source, overrides = [], None, {}
    if (path / "metrics.jsonl").is_file():
        try:
            rows, source = read_jsonl(path / "metrics.jsonl"), "metrics.jsonl"
        except ValueError as exc:       # not UTF-8: one line naming the file
            raise UserError(str(exc)) from None
    if (path / "overrides.yaml").is_file():     # {overrides: [...], choices: {...}}
        try:
            overrides = yaml.safe_load((path / "overrides.yaml").read_text(encoding="utf-8")) or {}
        except (yaml.YAMLError, UnicodeDecodeError):
            pass                                # unreadable: none
    return Run(path, flatten(config), rows, source, overrides)


SUMMARY_KEYS = ("reward/mean", "eval/exact_match", "eval/reward", "policy/kl_ref",
                "policy/approx_kl", "policy/clip_frac", "policy/entropy", "length/mean",
                "length/truncated_frac", "reward/frac_zero_std_groups", "rewards/accuracy",
                "rewards/margins")          # the last two: a preference loss's pairs
# a run of `rlctl reward-model train` (its config has rm.* keys)
REWARD_MODEL_SUMMARY_KEYS = ("train/loss", "train/accuracy", "eval/pairwise_accuracy",
                             "eval/margin", "eval/chosen_mean", "eval/rejected_mean",
                             "optim/grad_norm")
HIGHER_IS_BETTER = ("reward/mean", "rewards/accuracy", "eval/exact_match", "eval/reward", "train/accuracy",
                    "eval/pairwise_accuracy", "eval/margin")


def kinds_of(runs: Sequence[Run]):
    """(summary keys, plots) for runs of one kind, or both kinds' when they are mixed."""
    rm = {r.reward_model for r in runs}
    keys = (SUMMARY_KEYS if False in rm else ()) + (REWARD_MODEL_SUMMARY_KEYS if True in rm else ())
    plots = (PLOTS if False in rm else ()) + (REWARD_MODEL_PLOTS if True in rm else ())
    return keys, plots


def config_diff(configs: Sequence[Dict[str, Any]]) -> Dict[str, List[Any]]:
    """Keys whose values differ between the configs (MISSING where a key is absent)."""
    keys = sorted(set().union(*configs))
    diff = {}
    for key in keys:
        values = [c.get(key, MISSING) for c in configs]
        a = values[0]       # MISSING and booleans differ from anything but themselves
        if any(a is not b if a is MISSING or b is MISSING or isinstance(a, bool)
               or isinstance(b, bool) else a != b for b in values[1:]):
            diff[key] = values
    return diff


def metric_summary(rows: Sequence[dict], keys: Sequence[str] = SUMMARY_KEYS
                   ) -> Dict[str, Optional[dict]]:
    out: Dict[str, Optional[dict]] = {}
    for key in keys:
        xs, ys = series(rows, key)
        if not xs:
            out[key] = None
            continue
        entry = {"n": len(ys), "first": ys[0], "last": ys[-1], "min": min(ys), "max": max(ys),
                 "best": None, "best_step": None}
        if key in HIGHER_IS_BETTER:
            i = max(range(len(ys)), key=ys.__getitem__)
            entry["best"], entry["best_step"] = ys[i], xs[i]
        out[key] = entry
    return out


def _ensure_dir(path: Path) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot write to '{path}': {exc.strerror or exc}") from None
    return path


def inspect_run(path: Path, out_dir: Optional[Path], plots: bool) -> dict:
    run = load_run(path)
    if run.reward_model:    # `rlctl reward-model train`'s defaults, its data.* unset
        defaults = flatten(dict(reward_model_defaults(), data={"prefs": None, "eval": None}))
    else:
        defaults = flatten(OmegaConf.to_container(compose([]).cfg, resolve=True))
    keys, plot_set = kinds_of([run])
    diff = config_diff([defaults, run.config])
    # keys the run's config lacks were added to the schema after the run: not a choice
    newer = sorted(k for k, v in diff.items() if v[1] is MISSING)
    report = {"kind": "run", "run_dir": str(path), "reward_model_run": run.reward_model,
              "metrics_source": run.metrics_source,
              "steps": len({r["step"] for r in run.rows}),
              "overrides": run.overrides.get("overrides", []),
              "choices": run.overrides.get("choices", {}),
              "config_diff": {k: {"default": v[0], "run": v[1]} for k, v in diff.items()
                              if v[1] is not MISSING},
              "keys_not_in_run": newer,
              "metrics": metric_summary(run.rows, keys), "plots": [], "plots_skipped": []}
    if plots and run.rows:
        written, skipped = plot_curves({path.name: run.rows}, _ensure_dir(out_dir or path),
                                       plots=plot_set)
        extra = None if run.reward_model else plot_proxy_gold(
            run.rows, proxy_keys(run.config), (out_dir or path) / "inspect_proxy_gold.png")
        report["plots"], report["plots_skipped"] = [str(p) for p in written + [extra] if p], skipped
    return report


def proxy_keys(config: Dict[str, Any]) -> List[str]:
    """The metrics of a run's reward-model scores (``reward/<name>``, or ``eval/reward`` alone)."""
    if config.get("task.reward_model"):
        return ["reward/reward_model", "eval/reward"]
    entries = [e for e in config.get("task.rewards") or [] if isinstance(e, dict) and "model" in e]
    return [f"reward/{e.get('name') or 'reward_model'}" for e in entries]


def compare_runs(paths: Sequence[Path], out_dir: Path, plots: bool) -> dict:
    runs = [load_run(p) for p in paths]
    labels = [p.name for p in paths]
    if len(set(labels)) < len(labels):
        labels = [str(p) for p in paths]
    keys, plot_set = kinds_of(runs)
    diff = config_diff([r.config for r in runs])
    partial = sorted(k for k, v in diff.items() if any(x is MISSING for x in v))
    report = {"kind": "compare", "runs": labels, "run_dirs": [str(p) for p in paths],
              "config_diff": {k: dict(zip(labels, v)) for k, v in diff.items()
                              if k not in partial},
              "keys_not_in_every_run": {k: [lb for lb, x in zip(labels, diff[k])
                                            if x is not MISSING] for k in partial},
              "mixed_kinds": len({r.reward_model for r in runs}) > 1,
              "summary_keys": list(keys),
              "metrics": {label: metric_summary(r.rows, keys) for label, r in zip(labels, runs)},
              "plots": [], "plots_skipped": []}
    if plots and any(r.rows for r in runs):
        written, skipped = plot_curves({lb: r.rows for lb, r in zip(labels, runs)},
                                       _ensure_dir(out_dir), plots=plot_set, compare=True)
        report["plots"], report["plots_skipped"] = [str(p) for p in written], skipped
    return report


def print_run(report: dict) -> None:
    console = Console()
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
    if report["metrics_source"] is None:
        console.print("no metrics logged (no metrics.jsonl; logger=none or logger.jsonl=false?)")
    else:
        table = Table(title=f"metrics ({report['metrics_source']}, {report['steps']} steps; "
                            "-: not logged; min in --json)")
        for col in ("metric", "first", "last", "max", "best@step"):
            table.add_column(col, justify="left" if col == "metric" else "right", no_wrap=True)
        for key, m in report["metrics"].items():
            if m is None:
                table.add_row(key, "-", "-", "-", "-")
                continue
            best = "" if m["best"] is None else f"{show(m['best'], 3)}@{m['best_step']}"
            table.add_row(key, show(m["first"], 3), show(m["last"], 3), show(m["max"], 3), best)
        console.print(table)
    _print_plots(console, report)


def _print_plots(console, report: dict) -> None:
    for p in report["plots"]:
        console.print(f"wrote {p}", soft_wrap=True, markup=False)
    if report["plots_skipped"]:
        console.print("no data for plot(s): " + ", ".join(report["plots_skipped"]))


def print_compare(report: dict) -> None:
    console = Console()
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
    partial = report["keys_not_in_every_run"]
    if partial and report.get("mixed_kinds"):   # by config section: a different command
        sections: Dict[tuple, set] = {}
        for key, holders in partial.items():
            sections.setdefault(tuple(holders), set()).add(key.split(".")[0] + ".*")
        console.print("RL and reward-model runs compared: only the keys both kinds hold are "
                      "compared; " + "; ".join(f"{', '.join(sorted(secs))} [{', '.join(holders)}]"
                                               for holders, secs in sections.items()),
                      soft_wrap=True, markup=False)
    elif partial:
        console.print("keys only some runs hold (config schema changed between runs?): "
                      + ", ".join(f"{k} [{', '.join(v)}]" for k, v in partial.items()),
                      soft_wrap=True, markup=False)
    table = Table(title="metrics: last (best)")
    table.add_column("metric", no_wrap=True)
    for label in labels:
        table.add_column(label, justify="right", overflow="fold")
    for key in report["summary_keys"]:
        ms = [report["metrics"][label].get(key) for label in labels]
        cells = ["-" if m is None else show(m["last"])
                 + ("" if m["best"] is None else f" ({show(m['best'])})") for m in ms]
        if any(c != "-" for c in cells):
            table.add_row(key, *cells)
    console.print(table)
    _print_plots(console, report)


def classify(paths: Sequence[str]) -> tuple:
    """("runs", [Path]), ("rollout", Path) or ("samples", [Path]); one-line errors else."""
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
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, float) and obj != obj:
        return None
    return obj
