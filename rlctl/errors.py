"""Map exceptions to the one-line messages and exit codes users see."""
from __future__ import annotations

from typing import Callable, Tuple


class UserError(ValueError):
    """Bad input from the user: one line, exit code 2."""


def user_message(exc: BaseException) -> Tuple[str, int]:
    from rlctl.compose import ConfigError
    from rlctl.engine.checkpoint import CheckpointError
    from rlctl.engine.rundir import RunDirError

    text = " ".join(str(exc).split())
    if isinstance(exc, (ConfigError, RunDirError, UserError, CheckpointError)):
        return text, 2
    if type(exc).__name__ in ("TrainingFault", "LaunchError"):
        return text, 1
    return f"{type(exc).__name__}: {text[:300]} (rerun with --debug for the traceback)", 1


def run_command(fn: Callable[[], object], debug: bool) -> None:
    """Run a CLI command: bad input is one line on stderr and exit code 2 (other failures
    1); --debug re-raises for the traceback. Ctrl-C exits 130, with the resume command
    when the trainer saved a checkpoint."""
    import typer

    try:
        fn()
    except KeyboardInterrupt as exc:
        run_dir, step = getattr(exc, "run_dir", None), getattr(exc, "step", None)
        if run_dir is not None and step:
            typer.echo(f"interrupted after step {step}; checkpoint saved. Resume with: "
                       f"rlctl train --resume {run_dir}", err=True)
        else:
            typer.echo("interrupted", err=True)
        raise typer.Exit(130)
    except typer.Exit:
        raise
    except Exception as exc:  # noqa: BLE001 - one line for users, the traceback with --debug
        if debug:
            raise
        message, code = user_message(exc)
        typer.echo(f"error: {message}", err=True)
        raise typer.Exit(code)
