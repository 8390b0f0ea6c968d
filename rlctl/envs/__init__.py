"""Multi-turn environments: the interface, tools and their sandbox, the built-in environments.

Importing ``rlctl.envs`` (any module of it) registers the built-in environments
(``calculator``, ``guess_number``, ``running_sum``) as tasks in ``rlctl.tasks.TASKS``
and in ``rlctl.envs.registration.ENVS`` (``rlctl.envs.builtin``). ``rlctl.tasks`` sits
below this package and never imports it; the layers above (models, rollout, run) do.
"""
from rlctl.envs import builtin  # noqa: F401  (registers the built-in environments)
