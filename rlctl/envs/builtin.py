"""The built-in environments, registered as tasks (``rlctl.tasks.TASKS``) and in
``rlctl.envs.registration.ENVS`` when imported (``rlctl/envs/__init__.py`` does):
``calculator``, ``guess_number``, ``running_sum``."""
from rlctl.envs import calculator, guess_number, running_sum  # noqa: F401  (register)
from rlctl.envs.registration import ENVS

BUILTIN_ENVS = ("calculator", "guess_number", "running_sum")

__all__ = ["BUILTIN_ENVS", "ENVS"]
