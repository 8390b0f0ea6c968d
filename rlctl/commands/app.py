"""The Typer commands `eval`, `rollout`, `inspect` and `serve`. Only typer, rlctl.errors (which
imports nothing) and typer-only command modules are imported here; each command's
module is imported inside the command."""
from __future__ import annotations

from typing import Optional

import typer

from rlctl.errors import UserError, run_command
from rlctl.commands.cli_options import DEBUG, FREE_ARGS
from rlctl.commands.reward_model_cmd import rm_app  # light: typer and rlctl.errors only

# The command modules (rlctl.commands.eval_cmd, rollout_cmd, inspect_cmd) are imported
# inside the command bodies below, on purpose: they pull in torch, transformers and hydra
# (seconds), and `rlctl --help` must not pay for them.

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


SERVE_HELP = """Serve a model over HTTP: an OpenAI-compatible completions server on token ids.

\b
    rlctl serve [TARGET] [OVERRIDES...] [--host 127.0.0.1] [--port 8000]

TARGET as for `rlctl eval` (a run directory serves its model/). Routes: POST
/v1/completions (prompt as token ids; returns token_ids, per-token log-probs and
finish_reason), GET /health, GET /version (the weights' version), POST /update_weights
(safetensors body, ?version=V) and POST /update_weights_from_disk ({"path", "version"}).
See docs/engines.md.
"""


def _int(name: str, value: Optional[str]) -> Optional[int]:
    """Integer options are parsed here so that a bad value is one line (click prints
    a usage block)."""
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise UserError(f"{name} expects an integer, got '{value}'") from None


def register(app: typer.Typer) -> None:
    @app.command("eval", context_settings=FREE_ARGS, help=EVAL_HELP,
                 options_metavar="[TARGET] [OVERRIDES]... [OPTIONS]")
    def eval_(ctx: typer.Context,
              samples: str = typer.Option("1", "--samples", "-k", metavar="K", help="Sampled completions per prompt (pass@k for k > 1)."),
              out: Optional[str] = typer.Option(None, "--out", metavar="FILE", help="JSON file to write."),
              batch_size: Optional[str] = typer.Option(None, "--batch-size", metavar="N", help="Sequences per generate call (default 256; episodes played together: 64), as the trainer's eval."),
              debug: bool = DEBUG) -> None:
        def go():
            from rlctl.commands.eval_cmd import run_eval
            from rlctl.commands.targets import split_args

            target, overrides = split_args(ctx.args, "rlctl eval [TARGET] [OVERRIDES...] "
                                           "[--samples K] [--out FILE.json]")
            run_eval(target, overrides, samples=_int("--samples", samples), out=out,
                     batch_size=_int("--batch-size", batch_size))
        run_command(go, debug)

    @app.command("rollout", context_settings=FREE_ARGS, help=ROLLOUT_HELP,
                 options_metavar="[TARGET] [OVERRIDES]... --out FILE.jsonl [OPTIONS]")
    def rollout_(ctx: typer.Context,
                 out: Optional[str] = typer.Option(None, "--out", metavar="FILE", help="JSONL file to write (required)."),
                 prompts: Optional[str] = typer.Option(None, "--prompts", "-n", metavar="N", help="Number of prompts N (default trainer.prompts_per_step)."),
                 samples: Optional[str] = typer.Option(None, "--samples", "-g", metavar="G", help="Completions per prompt G (default algo.group_size)."),
                 split: str = typer.Option("train", "--split", metavar="SPLIT", help="train | eval"),
                 batch_size: str = typer.Option("256", "--batch-size", metavar="N", help="Sequences per generate call (the chunk streamed to disk)."),
                 debug: bool = DEBUG) -> None:
        def go():
            from rlctl.commands.rollout_cmd import run_rollout
            from rlctl.commands.targets import split_args

            target, overrides = split_args(ctx.args, "rlctl rollout [TARGET] [OVERRIDES...] "
                                           "--out FILE.jsonl [--prompts N] [--samples G]")
            run_rollout(target, overrides, out, prompts=_int("--prompts", prompts),
                        samples=_int("--samples", samples), split=split,
                        batch_size=_int("--batch-size", batch_size))
        run_command(go, debug)

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
        def go():
            from rlctl.commands.inspect_cmd import run_inspect

            run_inspect(list(ctx.args), out_dir=out_dir, json_out=json_out, plots=plots,
                        examples=_int("--examples", examples), samples=samples,
                        step=_int("--step", step))
        run_command(go, debug)

    _register_serve(app)
    app.add_typer(rm_app, name="reward-model")   # rlctl reward-model train|eval


def _register_serve(app: typer.Typer) -> None:
    @app.command("serve", context_settings=FREE_ARGS, help=SERVE_HELP,
                 options_metavar="[TARGET] [OVERRIDES]... [OPTIONS]")
    def serve_(ctx: typer.Context,
               host: str = typer.Option("127.0.0.1", "--host", metavar="HOST", help="Address to listen on (0.0.0.0: every interface)."),
               port: str = typer.Option("8000", "--port", metavar="PORT", help="TCP port (0: any free one)."),
               debug: bool = DEBUG) -> None:
        def go():
            from rlctl.commands.serve_cmd import run_serve
            from rlctl.commands.targets import split_args

            target, overrides = split_args(ctx.args, "rlctl serve [TARGET] [OVERRIDES...] "
                                           "[--host HOST] [--port PORT]")
            run_serve(target, overrides, host, _int("--port", port))
        run_command(go, debug)
