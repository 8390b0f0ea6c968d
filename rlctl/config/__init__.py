"""Configuration: the typed schema, composition with Hydra, recipes, and every check of a composed config."""
