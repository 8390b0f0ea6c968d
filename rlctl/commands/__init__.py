"""The commands around `rlctl train` (the Typer app is rlctl/cli.py): `eval`, `rollout`, `serve`,
sweeps, `inspect/` (run reports, sample tables, plots) and `audit/` (rollout files)."""
