"""Learned reward models: scoring completions, the Bradley-Terry fit, the embedded tiny reward model and the ``rlctl reward-model`` training run."""
