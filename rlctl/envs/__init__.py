"""Multi-turn environments: the interface, tools and their sandbox, the built-in ones.
Importing any module of ``rlctl.envs`` registers the built-in environments as tasks
(``rlctl.envs.builtin``); ``rlctl.tasks`` never imports this package."""
from rlctl.envs import builtin  # noqa: F401  (registers the built-in environments)
