"""The ``rlctl`` command line; each command imports its work in its body (``--help``: no torch)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import typer

from rlctl.errors import UserError, handled

CONF_DIR = Path(__file__).parent / "config" / "conf"
GROUP_NAMES = ("algo", "task", "model", "hardware", "logger")
# free arguments: OVERRIDES and unknown flags go to the command (which names a bad flag
# in one line itself)
FREE_ARGS = {"allow_extra_args": True, "ignore_unknown_options": True}
DEBUG = typer.Option(False, "--debug", help="Show full tracebacks.")


def _groups_help() -> str:
    lines = []
    for g in GROUP_NAMES:
        opts = sorted(p.stem for p in (CONF_DIR / g).glob("*.yaml") if not p.stem.startswith("_"))
        lines.append(f"{g}={'|'.join(opts)}")
    return "\n\n".join(lines)


TRAIN_HELP = f"""Train a policy with RL. OVERRIDES are Hydra overrides, e.g.

    rlctl train algo=grpo task=sorting algo.clip_eps=0.1 trainer.lr=3e-4

Config groups and their options:

{_groups_help()}

Other sections: rollout.*, trainer.*, run.*, seed. A run writes runs/<time>-<name>/
with config.yaml, recipe.yaml (replay with --recipe), metrics.jsonl, model/ and
summary.json.
"""

EVAL_HELP = """Held-out metrics of a model on the task's eval split.

TARGET: a run directory (its config and model/), a model directory (Hugging Face format,
e.g. runs/<id>/model), a LoRA adapter directory, or absent (the configured model: the
starting point). OVERRIDES compose on top, e.g.

\b
    rlctl eval runs/<id> task.num_eval=512 --samples 8

Reports greedy and sampled (rollout.temperature) exact match, the mean of every reward
design, mean length and truncated fraction, and pass@k for --samples k > 1 (unbiased
estimator). Writes JSON to --out, else TARGET/eval.json (./eval-<model>.json without a
TARGET).
"""

ROLLOUT_HELP = """Sample completions, score them and write one JSON line per completion.

\b
    rlctl rollout [TARGET] [OVERRIDES...] --out FILE.jsonl [--prompts N] [--samples G]

TARGET as for `rlctl eval`. N prompts of the train split (or --split eval), G samples
each (defaults: trainer.prompts_per_step and algo.group_size). Each row holds prompt,
completion, token_ids, per-token logprobs (learner forward), reward and every reward
design, ended_with_eos / truncated, length and group id. Audit the file with
`rlctl inspect FILE.jsonl`.
"""

INSPECT_HELP = """Summarise run directories or audit a rollout file.

\b
    rlctl inspect runs/<id>              config vs defaults, metric summary, inspect_*.png
    rlctl inspect runs/<a> runs/<b> ...  config differences (key x run), overlaid curves
    rlctl inspect rollout.jsonl          EOS/mask alignment, truncation, zero-std groups,
                                         reward-hacking signs, samples per reward bucket
    rlctl inspect runs/<id> --samples    the run's newest sample tables (--step N: that
                                         step's) and the audit's signs over its samples
"""


SERVE_HELP = """Serve a model over HTTP: an OpenAI-compatible server that returns token ids and log-probs.

\b
    rlctl serve [TARGET] [OVERRIDES...] [--host 127.0.0.1] [--port 8000]

TARGET as for `rlctl eval` (a run directory serves its model/). Prints the URL it bound
(--port 0: any free port). Routes: GET /v1/models, POST /v1/completions (text or token-id
prompts; returns token_ids, per-token log-probs and finish_reason), POST
/v1/chat/completions (messages through the chat template), GET /health, GET /version (the
weights' version), POST /update_weights (safetensors body, ?version=V) and POST
/update_weights_from_disk ({"path", "version"}). See docs/engines.md.
"""


RM_TRAIN_HELP = """Fit a Bradley-Terry reward model on preference pairs.

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

RM_EVAL_HELP = """Pairwise accuracy and score distribution of a reward model on preference pairs.

\b
    rlctl reward-model eval PATH PREFS [--out FILE.json]

PATH: a reward-model directory (sequence classifier, num_labels=1) or a run directory of
`rlctl reward-model train`. PREFS as for train.
"""

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="rlctl: fine-tune language models with reinforcement learning "
                       "(REINFORCE, RLOO, PPO, GRPO).")


def _fail(message: str, code: int = 2) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


rm_app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                     help="Train and evaluate reward models (Bradley-Terry, on preference pairs).")
app.add_typer(rm_app, name="reward-model")   # listed after the commands


def _int(name: str, value: Optional[str]) -> Optional[int]:
    """An integer option's value; a bad one is one line (click would print a usage block)."""
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise UserError(f"{name} expects an integer, got '{value}'") from None


def split_args(args: Sequence[str], usage: str) -> Tuple[Optional[str], List[str]]:
    """(TARGET or None, OVERRIDES) from the free arguments; overrides contain '='."""
    args = list(args)
    flags = [a for a in args if a.startswith("-")]
    if flags:
        raise UserError(f"unknown option '{flags[0]}'; usage: {usage}")
    target = None
    if args and "=" not in args[0]:
        target = args.pop(0)
    stray = [a for a in args if "=" not in a]
    if stray:
        raise UserError(f"unexpected argument '{stray[0]}': only one TARGET is allowed and "
                        "overrides look like key=value (e.g. task.num_eval=512)")
    return target, args


@app.command(context_settings=FREE_ARGS, help=TRAIN_HELP)
def train(ctx: typer.Context,
          recipe: Optional[str] = typer.Option(None, "--recipe", help="A recipe name (see `rlctl recipes`) or YAML path (e.g. runs/<id>/recipe.yaml); overrides apply on top."),
          resume: Optional[str] = typer.Option(None, "--resume", help="Continue RUN_DIR from its newest checkpoint (same config; overrides such as trainer.steps apply)."),
          multirun: bool = typer.Option(False, "-m", "--multirun", help="Sweep: run the grid of comma-separated overrides (e.g. seed=0,1,2), one run each, then compare."),
          dry_run: bool = typer.Option(False, "--dry-run", help="Print parameter counts, resident models and a memory estimate per rank; train nothing."),
          debug: bool = DEBUG) -> None:
    overrides: List[str] = list(ctx.args)
    bad_flags = [a for a in overrides if a.startswith("--")]
    if bad_flags:
        _fail(f"unknown option '{bad_flags[0]}'; options: --recipe NAME|PATH, --resume RUN_DIR, -m/--multirun, "
              "--dry-run, --debug, --help")
    if resume and (recipe or multirun):
        _fail("--resume takes the run's own recipe; it cannot be combined with --recipe or -m")
    if dry_run and (multirun or resume):
        _fail("--dry-run plans one run from a config; it cannot be combined with -m or --resume")
    with handled(debug):
        if multirun:
            from rlctl.config.compose import check_override_syntax
            check_override_syntax(overrides)     # one line for Hydra's grammar errors, before torch
            from rlctl.commands.sweep import run_sweep
            run_sweep(overrides, recipe)
            return
        from rlctl.config.compose import compose
        composed = None if resume else compose(overrides, recipe)   # a bad override: before torch
        if dry_run:
            from rlctl.train.build_run import dry_run as plan
            plan(composed.cfg)
        else:
            from rlctl.train.run import run_training
            run_training(overrides, recipe, resume, composed)


@app.command()
def recipes() -> None:
    """List the saved experiments (recipes/*.yaml) with a one-line description each."""
    from rlctl.config.compose import recipe_description, recipe_files

    files = recipe_files()
    if not files:
        typer.echo("no recipes found (looked in ./recipes and the repository's recipes/)")
    width = max((len(n) for n in files), default=0)
    for name, path in files.items():
        typer.echo(f"{name:<{width}}  {recipe_description(path)}")


@app.command("eval", context_settings=FREE_ARGS, help=EVAL_HELP,
             options_metavar="[TARGET] [OVERRIDES]... [OPTIONS]")
def eval_run(ctx: typer.Context,
             samples: str = typer.Option("1", "--samples", "-k", metavar="K", help="Sampled completions per prompt (pass@k for k > 1)."),
             out: Optional[str] = typer.Option(None, "--out", metavar="FILE", help="JSON file to write."),
             batch_size: Optional[str] = typer.Option(None, "--batch-size", metavar="N", help="Sequences per generate call (default 256; episodes played together: 64), as the trainer's eval."),
             debug: bool = DEBUG) -> None:
    with handled(debug):
        from rlctl.commands.eval_cmd import run_eval

        target, overrides = split_args(ctx.args, "rlctl eval [TARGET] [OVERRIDES...] "
                                       "[--samples K] [--out FILE.json]")
        run_eval(target, overrides, samples=_int("--samples", samples), out=out,
                 batch_size=_int("--batch-size", batch_size))


@app.command("rollout", context_settings=FREE_ARGS, help=ROLLOUT_HELP,
             options_metavar="[TARGET] [OVERRIDES]... --out FILE.jsonl [OPTIONS]")
def rollout_(ctx: typer.Context,
             out: Optional[str] = typer.Option(None, "--out", metavar="FILE", help="JSONL file to write (required)."),
             prompts: Optional[str] = typer.Option(None, "--prompts", "-n", metavar="N", help="Number of prompts N (default trainer.prompts_per_step)."),
             samples: Optional[str] = typer.Option(None, "--samples", "-g", metavar="G", help="Completions per prompt G (default algo.group_size)."),
             split: str = typer.Option("train", "--split", metavar="SPLIT", help="train | eval"),
             batch_size: str = typer.Option("256", "--batch-size", metavar="N", help="Sequences per generate call (the chunk streamed to disk)."),
             debug: bool = DEBUG) -> None:
    with handled(debug):
        from rlctl.commands.rollout_cmd import run_rollout

        target, overrides = split_args(ctx.args, "rlctl rollout [TARGET] [OVERRIDES...] "
                                       "--out FILE.jsonl [--prompts N] [--samples G]")
        run_rollout(target, overrides, out, prompts=_int("--prompts", prompts),
                    samples=_int("--samples", samples), split=split,
                    batch_size=_int("--batch-size", batch_size))


@app.command("inspect", context_settings=FREE_ARGS, help=INSPECT_HELP,
             options_metavar="PATH [PATH]... [OPTIONS]")
def inspect_(ctx: typer.Context,
             out_dir: Optional[str] = typer.Option(None, "--out-dir", metavar="DIR", help="Where comparison plots go (default: the current directory)."),
             json_out: Optional[str] = typer.Option(None, "--json", metavar="FILE", help="Also write the report as JSON."),
             plots: bool = typer.Option(True, "--plots/--no-plots", help="Write PNG plots."),
             examples: str = typer.Option("3", "--examples", metavar="N", help="Sample completions per reward bucket (rollout audit)."),
             samples: bool = typer.Option(False, "--samples", help="Show the run's sample tables (samples.jsonl) and audit them."),
             step: Optional[str] = typer.Option(None, "--step", metavar="N", help="With --samples: the tables of step N."),
             debug: bool = DEBUG) -> None:
    with handled(debug):
        from rlctl.commands.inspect.report import run_inspect

        run_inspect(list(ctx.args), out_dir=out_dir, json_out=json_out, plots=plots,
                    examples=_int("--examples", examples), samples=samples,
                    step=_int("--step", step))


@app.command("serve", context_settings=FREE_ARGS, help=SERVE_HELP,
             options_metavar="[TARGET] [OVERRIDES]... [OPTIONS]")
def serve_(ctx: typer.Context,
           host: str = typer.Option("127.0.0.1", "--host", metavar="HOST", help="Address to listen on (0.0.0.0: every interface)."),
           port: str = typer.Option("8000", "--port", metavar="PORT", help="TCP port (0: any free one)."),
           debug: bool = DEBUG) -> None:
    with handled(debug):
        from rlctl.commands.serve_cmd import run_serve

        target, overrides = split_args(ctx.args, "rlctl serve [TARGET] [OVERRIDES...] "
                                       "[--host HOST] [--port PORT]")
        run_serve(target, overrides, host, _int("--port", port))


@rm_app.command("train", context_settings=FREE_ARGS, help=RM_TRAIN_HELP,
                options_metavar="PREFS [OVERRIDES]... [OPTIONS]")
def rm_train(ctx: typer.Context,
             eval_prefs: Optional[str] = typer.Option(None, "--eval", metavar="PREFS_EVAL", help="Held-out preference pairs (default: a seeded rm.eval_frac of PREFS)."),
             debug: bool = DEBUG) -> None:
    with handled(debug):
        args = list(ctx.args)
        if not args or "=" in args[0] or args[0].startswith("-"):
            raise UserError("missing PREFS: rlctl reward-model train PREFS [--eval PREFS_EVAL] "
                            "[OVERRIDES]...")
        from rlctl.rm.training import train_reward_model

        run_dir = train_reward_model(args[1:], args[0], eval_prefs)
        summary = json.loads((run_dir / "summary.json").read_text())
        train = ", ".join(f"{name} {summary[key]:.4f}" for key, name in (
            ("train_loss", "loss"), ("train_accuracy", "accuracy")) if key in summary)
        typer.echo(f"held-out pairwise accuracy {summary['eval/pairwise_accuracy']:.4f} "
                   f"({summary['eval_pairs']} pairs, mean margin {summary['eval/margin']:+.4f})"
                   + (f"; last training step: {train}" if train else ""))
        typer.echo(f"reward model: {run_dir / 'model'}")


@rm_app.command("eval", context_settings=FREE_ARGS, help=RM_EVAL_HELP,
                options_metavar="PATH PREFS [OPTIONS]")
def rm_eval(ctx: typer.Context,
            out: Optional[str] = typer.Option(None, "--out", metavar="FILE", help="Also write the numbers as JSON."),
            debug: bool = DEBUG) -> None:
    with handled(debug):
        args = list(ctx.args)
        if len(args) != 2 or any(a.startswith("-") for a in args):
            raise UserError("rlctl reward-model eval takes PATH PREFS (a reward model or run "
                            f"directory, then a preference file); got {' '.join(args) or 'nothing'}")
        from rlctl.rm.training import eval_reward_model

        stats = eval_reward_model(args[0], args[1])
        typer.echo(f"pairwise accuracy  {stats['pairwise_accuracy']:.4f}  "
                   f"({int(stats['num_pairs'])} pairs, mean margin {stats['mean_margin']:+.4f})")
        typer.echo(f"{'scores':<9} {'mean':>9} {'std':>9} {'p10':>9} {'p50':>9} {'p90':>9}")
        for name in ("chosen", "rejected"):
            typer.echo(f"{name:<9} " + " ".join(f"{stats[f'{name}_{k}']:>9.4f}"
                                                for k in ("mean", "std", "p10", "p50", "p90")))
        if out:
            from rlctl.commands.files import write_json

            write_json(Path(out), stats)


def main() -> None:
    # Thread limits must be set before torch is imported: on small CPUs more threads
    # make tiny-model steps many times slower.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        app()
    except SystemExit as exc:
        if exc.code in (130, 143):   # stopped by a signal, all saved: skip torch's slow teardown
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(exc.code)
        raise


if __name__ == "__main__":
    sys.exit(main())
