"""`rlctl inspect` of runs: config diffs, metric summaries, plots, sample tables."""
