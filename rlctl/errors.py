"""Map exceptions to the one-line messages and exit codes users see."""
from __future__ import annotations

import shlex
import signal
from typing import Callable, Tuple


class UserError(ValueError):
    """Bad input from the user: one line, exit code 2."""


class Interrupted(KeyboardInterrupt):
    """A run stopped by SIGINT/SIGTERM at a step boundary with its checkpoint saved
    (``aborted``: a second Ctrl-C stopped it mid-step; ``step`` is then the newest
    checkpoint's step, 0 if none). The exit code is 128 + the signal's number."""

    def __init__(self, run_dir, step: int, signum: int = signal.SIGINT, aborted: bool = False):
        super().__init__(step)
        self.run_dir, self.step, self.signum, self.aborted = run_dir, step, int(signum), aborted

    def message(self) -> str:
        name = signal.Signals(self.signum).name
        hint = (f". Resume with: rlctl train --resume {shlex.quote(str(self.run_dir))}"
                if self.run_dir is not None and self.step else "")
        if self.aborted:
            saved = f"the newest checkpoint is step {self.step}" if self.step else "no checkpoint was saved"
            return f"aborted by a second Ctrl-C; {saved}{hint}"
        return f"interrupted by {name} after step {self.step}; checkpoint saved{hint}"


def user_message(exc: BaseException) -> Tuple[str, int]:
    from rlctl.compose import ConfigError
    from rlctl.engine.checkpoint import CheckpointError
    from rlctl.engine.rundir import RunDirError

    text = " ".join(str(exc).split())
    if isinstance(exc, (ConfigError, RunDirError, UserError, CheckpointError)):
        return text, 2
    if type(exc).__name__ in ("TrainingFault", "LaunchError"):
        return text, int(getattr(exc, "code", 1))
    return f"{type(exc).__name__}: {text[:300]} (rerun with --debug for the traceback)", 1


def run_command(fn: Callable[[], object], debug: bool) -> None:
    """Run a CLI command: bad input is one line on stderr and exit code 2 (other failures
    1); --debug re-raises for the traceback. Ctrl-C exits 130 and SIGTERM 143, with the
    resume command when the trainer saved a checkpoint."""
    import typer

    try:
        fn()
    except Interrupted as exc:
        typer.echo(exc.message(), err=True)
        raise typer.Exit(128 + exc.signum)
    except KeyboardInterrupt:
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
