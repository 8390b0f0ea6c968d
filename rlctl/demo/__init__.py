"""The embedded demo models (tiny policy, agent and reward models) and their fixtures; only the model loader imports them."""
