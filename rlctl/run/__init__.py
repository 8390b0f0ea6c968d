"""A run from its config: the builders, config checks, training orchestration (one rank or many), the dry run, sweeps, the rank worker and the end-of-run report."""
