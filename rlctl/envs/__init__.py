"""Multi-turn environments: the interface, tools and their sandbox, the built-in ones."""
