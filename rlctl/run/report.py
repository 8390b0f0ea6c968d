"""What a run tells its user at the end: ``summary.json`` (``run_summary``), with its
reward-health fields (reward calls, errors and timeouts, and ``warnings``), and the
summary table."""
from __future__ import annotations

import resource
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch
from rich.console import Console
from rich.table import Table

# (what the scorer scored, what a run whose every call failed means)
_KINDS = (("reward", "training", "the policy was trained on all-zero rewards"),
          ("eval_reward", "held-out eval", "the eval/* metrics say nothing about the policy"))


def reward_report(train: Sequence[float], evaluation: Sequence[float] = (0, 0, 0)) -> Dict[str, Any]:
    """summary.json fields from the (calls, errors, timeouts) counts of the training and
    the held-out eval rewards (summed over ranks); ``warnings`` names any failures and
    says so plainly when every call failed (each such call scored 0)."""
    out: Dict[str, Any] = {}
    warnings: List[str] = []
    for (prefix, what, meaning), (calls, errors, timeouts) in zip(_KINDS, (train, evaluation)):
        calls, errors, timeouts = int(calls), int(errors), int(timeouts)
        out.update({f"{prefix}_calls": calls, f"{prefix}_errors": errors,
                    f"{prefix}_timeouts": timeouts})
        failed = errors + timeouts
        detail = f"{errors} raised or were not finite, {timeouts} timed out"
        if calls and failed >= calls:
            warnings.append(f"every {what} reward call failed ({failed} of {calls}: {detail}) and "
                            f"scored 0: {meaning}; the log's 'reward failed' lines show why")
        elif failed:
            warnings.append(f"{failed} of {calls} {what} reward calls failed ({detail}) and scored 0")
    out["warnings"] = warnings
    return out


def reward_summary(scorers: Sequence[Any], backend) -> Dict[str, Any]:
    """``reward_report`` of the (training, eval) RewardScorers, counts summed over ranks
    (a collective: every rank calls it)."""
    counts = torch.tensor([[float(s.calls), float(s.errors), float(s.timeouts)] for s in scorers])  # [2, 3]
    return reward_report(*backend.all_reduce(counts, "sum").tolist())


def run_summary(run_dir: Path, result, backend, seconds: float, lora: bool, params: Sequence[int],
                model_dir: Optional[Path], scorers: Sequence[Any]) -> Dict[str, Any]:
    """``summary.json`` from the trainer's ``result``: ``seconds`` since the rank started,
    ``params`` (trainable, total), ``model_dir`` where rank 0 saved the model (None: not
    saved), ``scorers`` as for ``reward_summary``. A collective: every rank calls it."""
    trainable, total = params
    summary = {"run_dir": str(run_dir), "steps": result.steps, "train_seconds": result.seconds,
               "setup_seconds": seconds - result.seconds, "tokens_per_s": result.tokens_per_s,
               "eval_start": result.eval_start, "eval_end": result.eval_end,
               "final_metrics": result.last_metrics, "lora": lora,
               "params_trainable": trainable, "params_total": total,
               "num_processes": backend.world_size, "backend": backend.name}
    if model_dir is not None:
        summary["model_dir"] = str(model_dir)
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024])  # KiB -> MiB
    summary["peak_rss_mb"] = float(backend.all_reduce(peak, "max"))
    summary.update(reward_summary(scorers, backend))
    return summary


def print_summary(summary: Dict[str, Any]) -> None:
    table = Table(title="rlctl run summary", show_header=True)
    table.add_column("metric")
    table.add_column("start", justify="right")
    table.add_column("end", justify="right")
    start, end = summary.get("eval_start", {}), summary.get("eval_end", {})
    for key in sorted(set(start) | set(end)):
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        table.add_row(key, fmt(start.get(key)), fmt(end.get(key)))
    table.add_row("train time (s)", "", f"{summary['train_seconds']:.1f}")
    table.add_row("tokens/s", "", f"{summary['tokens_per_s']:.0f}")
    if "reward_calls" in summary:
        failed = summary["reward_errors"] + summary["reward_timeouts"]
        table.add_row("reward calls failed", "", f"{failed} of {summary['reward_calls']}")
    console = Console()
    console.print(table)
    for line in summary.get("warnings", []):
        console.print(f"warning: {line}", highlight=False)
    console.print(f"run dir: {summary['run_dir']}", highlight=False, soft_wrap=True)  # no newline in the path
