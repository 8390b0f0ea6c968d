"""Map exceptions to the one-line messages and exit codes users see."""
from __future__ import annotations

from typing import Tuple


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
