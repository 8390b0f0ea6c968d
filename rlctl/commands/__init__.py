"""The commands around `rlctl train`: `eval`, `rollout`, `serve`, sweeps, `inspect/`, `audit/`."""
