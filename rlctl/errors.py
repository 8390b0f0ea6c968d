"""Every exception rlctl raises on purpose, shown by the CLI as one line and an exit code (2 bad
input, 1 a run that cannot go on, 128 + signal a stopped run)."""
from __future__ import annotations

import contextlib
import shlex
import signal
from typing import Tuple


class UserError(ValueError):
    """Bad input from the user: one line, exit code 2."""


class ConfigError(UserError):
    """A configuration value, key, group option or recipe that cannot be used."""


class CheckpointError(UserError):
    """A checkpoint that is missing, unreadable or does not fit the run."""


class DataError(UserError):
    """Bad data or data options: one line naming the key or the row."""


class RewardError(UserError):
    """A reward function failed or ran out of time with task.on_reward_error=raise."""


class RunDirError(OSError):
    """A run directory that cannot be created, read or locked (exit code 2)."""


class TrainingFault(RuntimeError):
    """Training cannot go on (e.g. non-finite updates); the message says why (exit 1)."""


class ActorFailed(RuntimeError):
    """A local rollout engine process died or raised; the message says which and why (exit 1)."""


class LaunchError(RuntimeError):
    """A rank failed (its own one line where it left one); ``code``: the exit code (2 for
    bad input); ``before_training``: a new run that never stepped is removed."""

    def __init__(self, message: str, before_training: bool = False, code: int = 1):
        super().__init__(message)
        self.before_training, self.code = before_training, code


class Interrupted(KeyboardInterrupt):
    """A run stopped by SIGINT/SIGTERM at a step boundary, checkpoint saved; exit 128 + the signal."""

    resume_args: Tuple[str, ...] = ()     # what this process adds to resume (its node's node_rank)

    def __init__(self, run_dir, step: int, signum: int = signal.SIGINT, aborted: bool = False):
        super().__init__(step)
        self.run_dir, self.step, self.signum, self.aborted = run_dir, step, int(signum), aborted

    def message(self) -> str:
        name = signal.Signals(self.signum).name
        extra = "".join(f" {shlex.quote(a)}" for a in self.resume_args)
        hint = (f". Resume with: rlctl train --resume {shlex.quote(str(self.run_dir))}{extra}"
                if self.run_dir is not None and self.step else "")
        if self.aborted:
            saved = f"the newest checkpoint is step {self.step}" if self.step else "no checkpoint was saved"
            return f"aborted by a second Ctrl-C; {saved}{hint}"
        if not self.step:                 # e.g. while launched ranks were starting
            return f"interrupted by {name} before the first step; nothing was saved"
        return f"interrupted by {name} after step {self.step}; checkpoint saved{hint}"


def one_line(msg: object) -> str:
    """A message (or an exception's) with its line breaks and runs of spaces as one space."""
    return " ".join(str(msg).split())


def user_message(exc: BaseException) -> Tuple[str, int]:
    """(the one line users see, the exit code) for any exception."""
    text = one_line(exc)
    if isinstance(exc, (UserError, RunDirError)):
        return text, 2
    if isinstance(exc, (TrainingFault, LaunchError, ActorFailed)):
        return text, int(getattr(exc, "code", 1))
    return f"{type(exc).__name__}: {text[:300]} (rerun with --debug for the traceback)", 1


@contextlib.contextmanager
def handled(debug: bool = False):
    """A CLI command's body: failures as ``user_message`` on stderr (--debug: the traceback);
    a stopped run exits 128 + the signal, with its resume command."""
    import typer  # the CLI's own dependency; errors.py stays importable without it

    try:
        yield
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
