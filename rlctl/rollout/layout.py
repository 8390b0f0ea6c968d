"""Where each rank of an asynchronous run lives: ``ActorLayout``, read once from the config.

Rank 0 is the learner; its ``num_actors`` actor processes, on the same machine, are ranks
1 .. num_actors of one gloo group (``file://`` rendezvous). Rollout on other machines is
done by inference servers (``rollout.engine=server``, docs/engines.md), not by actors.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ActorLayout:
    """The ``trainer.async_rollout`` fields the actors' layout reads."""
    enabled: bool                  # trainer.async_rollout.enabled
    num_actors: int                # actor processes beside the learner

    @classmethod
    def from_config(cls, cfg) -> "ActorLayout":
        """From the composed config's ``trainer.async_rollout`` section."""
        a = cfg.trainer.async_rollout
        return cls(enabled=bool(a.enabled), num_actors=int(a.num_actors))

    @property
    def world_size(self) -> int:
        """1 learner + its actors."""
        return 1 + self.num_actors

    @staticmethod
    def timeout_text() -> str:
        """The process group's timeout, in the words an error message uses."""
        return "the process group's timeout"
