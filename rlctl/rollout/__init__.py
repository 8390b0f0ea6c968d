"""Rollout: generation and sampling, the rollout sources, the generation engines (in-process, local processes, servers) and their source."""
