"""What a run keeps on disk: the run directory (resolved config, lock, metadata) and checkpoints."""
