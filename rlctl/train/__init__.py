"""A training run: compose -> run directory -> build -> fit -> save; the trainer, the update, metrics and the one evaluator."""
