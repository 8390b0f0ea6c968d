"""`rlctl reward-model train|eval`: the Typer sub-app. Only typer and rlctl.errors are
imported here; the work (torch, transformers) is imported inside each command, on
purpose, so that `rlctl --help` stays instant (as in rlctl/commands/app.py)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional

import typer

from rlctl.commands.cli_options import DEBUG, FREE_ARGS
from rlctl.commands.files import write_json
from rlctl.errors import UserError, run_command

TRAIN_HELP = """Fit a Bradley-Terry reward model on preference pairs.

\b
    rlctl reward-model train PREFS [--eval PREFS_EVAL] [OVERRIDES]...
    rlctl reward-model train prefs.jsonl rm.steps=300 rm.lr=1e-3
    rlctl reward-model train prefs.parquet model=hf model.name_or_path=/path/to/lm

PREFS: a JSONL, JSON, CSV, Parquet file or datasets directory with prompt, chosen and
rejected columns (and optionally a numeric margin). Without --eval a seeded
rm.eval_frac of the pairs is held out. Loss per pair: -log sigmoid(r_chosen - r_rejected
- margin) + rm.center_coef * (r_chosen + r_rejected)^2. OVERRIDES: model=..., hardware=...,
logger=..., seed=..., run.output_dir=... and rm.* (lr, steps, batch_size, margin,
center_coef, weight_decay, max_grad_norm, eval_frac, eval_every, eval_batch_size,
max_length). Writes runs/<time>-rm/ with model/ (a Hugging Face sequence classifier,
num_labels=1: use it as task.reward_model=RUN/model), metrics.jsonl
(eval/pairwise_accuracy), config.yaml and summary.json. Ctrl-C or SIGTERM stops after
the current step with the model so far saved (summary.json: stopped_at_step).
"""

EVAL_HELP = """Pairwise accuracy and score distribution of a reward model on preference pairs.

\b
    rlctl reward-model eval PATH PREFS [--out FILE.json]

PATH: a reward-model directory (sequence classifier, num_labels=1) or a run directory of
`rlctl reward-model train`. PREFS as for train.
"""

rm_app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                     help="Train and evaluate reward models (Bradley-Terry, on preference pairs).")


def format_eval(stats: Dict[str, float]) -> List[str]:
    """The lines `rlctl reward-model eval` prints."""
    lines = [f"pairwise accuracy  {stats['pairwise_accuracy']:.4f}  "
             f"({int(stats['num_pairs'])} pairs, mean margin {stats['mean_margin']:+.4f})",
             f"{'scores':<9} {'mean':>9} {'std':>9} {'p10':>9} {'p50':>9} {'p90':>9}"]
    for name in ("chosen", "rejected"):
        lines.append(f"{name:<9} " + " ".join(f"{stats[f'{name}_{k}']:>9.4f}"
                                               for k in ("mean", "std", "p10", "p50", "p90")))
    return lines


def format_fit(summary: Dict) -> str:
    """The line `rlctl reward-model train` ends with: the held-out figures and the last
    training step's."""
    train = ", ".join(f"{name} {summary[key]:.4f}" for key, name in
                      (("train_loss", "loss"), ("train_accuracy", "accuracy")) if key in summary)
    return (f"held-out pairwise accuracy {summary['eval/pairwise_accuracy']:.4f} "
            f"({summary['eval_pairs']} pairs, mean margin {summary['eval/margin']:+.4f})"
            + (f"; last training step: {train}" if train else ""))


@rm_app.command("train", context_settings=FREE_ARGS, help=TRAIN_HELP,
                options_metavar="PREFS [OVERRIDES]... [OPTIONS]")
def train_(ctx: typer.Context,
           eval_prefs: Optional[str] = typer.Option(None, "--eval", metavar="PREFS_EVAL", help="Held-out preference pairs (default: a seeded rm.eval_frac of PREFS)."),
           debug: bool = DEBUG) -> None:
    def go():
        args = list(ctx.args)
        if not args or "=" in args[0] or args[0].startswith("-"):
            raise UserError("missing PREFS: rlctl reward-model train PREFS [--eval PREFS_EVAL] "
                            "[OVERRIDES]...")
        from rlctl.reward_models.train import train_reward_model

        run_dir = train_reward_model(args[1:], args[0], eval_prefs)
        typer.echo(format_fit(json.loads((run_dir / "summary.json").read_text())))
        typer.echo(f"reward model: {run_dir / 'model'}")
    run_command(go, debug)


@rm_app.command("eval", context_settings=FREE_ARGS, help=EVAL_HELP,
                options_metavar="PATH PREFS [OPTIONS]")
def eval_(ctx: typer.Context,
          out: Optional[str] = typer.Option(None, "--out", metavar="FILE", help="Also write the numbers as JSON."),
          debug: bool = DEBUG) -> None:
    def go():
        args = list(ctx.args)
        if len(args) != 2 or any(a.startswith("-") for a in args):
            raise UserError("rlctl reward-model eval takes PATH PREFS (a reward model or run "
                            f"directory, then a preference file); got {' '.join(args) or 'nothing'}")
        from rlctl.reward_models.train import eval_reward_model

        stats = eval_reward_model(args[0], args[1])
        for line in format_eval(stats):
            typer.echo(line)
        if out:
            write_json(Path(out), stats)
    run_command(go, debug)
