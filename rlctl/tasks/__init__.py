"""Tasks by name (``build_task``): ``sorting``, ``arithmetic``, ``jsonl`` and the environments."""
from rlctl.tasks.task import TASKS, Task, build_task, register_task
from rlctl.tasks.scoring import RewardScorer  # noqa: F401
from rlctl.tasks import sorting  # noqa: F401  (registers "sorting")
from rlctl.tasks import arithmetic  # noqa: F401  (registers "arithmetic")

__all__ = ["TASKS", "RewardScorer", "Task", "build_task", "register_task"]
