"""The embedded demo models (tiny policy, agent and reward models); only loaders import them."""
