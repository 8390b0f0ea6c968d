"""The ``rlctl`` command line: parse, compose the config, call the engine. No math here.

Heavy imports (torch, transformers, wandb) happen inside the commands so that
``rlctl --help`` stays instant.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import List, Optional

import typer

from rlctl.commands.app import DEBUG, FREE_ARGS

CONF_DIR = Path(__file__).parent / "config" / "conf"
GROUP_NAMES = ("algo", "task", "model", "hardware", "logger")


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

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="rlctl: fine-tune language models with reinforcement learning "
                       "(REINFORCE, RLOO, PPO, GRPO).")


@app.callback()
def _root() -> None:
    """rlctl: fine-tune language models with reinforcement learning."""


def _fail(message: str, code: int = 2) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


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
    from rlctl.errors import handled

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
            from rlctl.train.dryrun import dry_run as plan
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


# eval, rollout, inspect (rlctl/commands; light imports, the work is imported lazily)
from rlctl.commands import register as _register_commands  # noqa: E402

_register_commands(app)


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
