"""Rollout: generation and sampling, the rollout sources, actor processes and remote actors with their wire format."""
