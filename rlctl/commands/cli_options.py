"""What every subcommand that takes free arguments shares (``rlctl eval``, ``rollout``,
``inspect``, ``reward-model train|eval``): the click settings that hand OVERRIDES and
unknown flags to the command (which names a bad flag in one line itself) and the
``--debug`` option. typer only, so that ``rlctl --help`` stays instant."""
from __future__ import annotations

import typer

FREE_ARGS = {"allow_extra_args": True, "ignore_unknown_options": True}
DEBUG = typer.Option(False, "--debug", help="Show full tracebacks.")
