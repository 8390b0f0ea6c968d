"""The commands around `rlctl train`: `eval`, `rollout`, `inspect` (run reports, the rollout
audit, plots), `serve` and `reward-model train|eval`. app.py holds the Typer commands
(light imports: `rlctl --help` stays instant); each command's module does the work."""
from rlctl.commands.app import register

__all__ = ["register"]
