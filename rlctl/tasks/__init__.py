"""Tasks: prompts + rewards, looked up by name (``build_task("sorting", ...)``)."""
from rlctl.tasks.base import TASKS, Task, build_task, register_task
from rlctl.tasks import sorting  # noqa: F401  (registers "sorting")

__all__ = ["TASKS", "Task", "build_task", "register_task"]
