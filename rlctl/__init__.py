"""rlctl: reinforcement-learning fine-tuning of causal language models from the command line."""
__version__ = "0.1.0"
