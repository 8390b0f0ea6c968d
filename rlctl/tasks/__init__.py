"""Tasks: prompts + rewards, looked up by name (``build_task("sorting", ...)``).

Built in: ``sorting`` (the demo), ``arithmetic`` (generated, verifiable math) and
``jsonl`` (the user's data files and reward functions). ``RewardScorer`` scores batches
under ``task.reward_timeout_s``; ``bind_tokenizer`` enables ``task.prompt_format=chat``.
"""
from rlctl.tasks.base import (TASKS, Task, bind_tokenizer, build_task,
                              register_task)
from rlctl.tasks.scoring import RewardScorer  # noqa: F401
from rlctl.tasks import sorting  # noqa: F401  (registers "sorting")
from rlctl.tasks import arithmetic  # noqa: F401  (registers "arithmetic")
from rlctl.tasks import data  # noqa: F401  (registers "jsonl")

__all__ = ["TASKS", "RewardScorer", "Task", "bind_tokenizer", "build_task",
           "register_task"]
