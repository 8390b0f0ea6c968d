"""Where each rank of an asynchronous run lives: ``ActorLayout``, read once from the config.

Rank 0 is the learner, on node 0 with its ``num_actors`` local actors (ranks 1 ..
num_actors); node r >= 1 runs ``actors_per_node`` actors, ranks ``1 + num_actors + (r - 1)
* actors_per_node`` onwards. World = 1 + num_actors + (nnodes - 1) * actors_per_node.
The layout also holds where the learner serves its rendezvous (``master_addr``,
``master_port``) and how long every wait for a peer lasts (``dist_timeout_s``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List

from rlctl.backends.launch import check_node_rank
from rlctl.errors import UserError


@dataclass(frozen=True)
class ActorLayout:
    """The ``trainer.async_rollout`` and ``hardware`` fields the actors' layout and join read."""
    enabled: bool                  # trainer.async_rollout.enabled
    num_actors: int                # actors on node 0, beside the learner
    actors_per_node: int           # actors on each node after node 0
    nnodes: int
    node_rank: int                 # this machine's node
    master_addr: str               # where the learner serves its store
    master_port: int
    dist_timeout_s: float          # joining, and the group's timeout

    @classmethod
    def from_config(cls, cfg) -> "ActorLayout":
        """From the composed config's ``trainer.async_rollout`` and ``hardware`` sections."""
        a, hw = cfg.trainer.async_rollout, cfg.hardware
        return cls(enabled=bool(a.enabled), num_actors=int(a.num_actors), actors_per_node=int(a.actors_per_node),
                   nnodes=int(hw.nnodes), node_rank=int(hw.node_rank), master_addr=str(hw.master_addr),
                   master_port=int(hw.master_port), dist_timeout_s=float(hw.dist_timeout_s))

    @property
    def world_size(self) -> int:
        """1 learner + the local actors + every other node's actors."""
        return 1 + self.num_actors + (self.nnodes - 1) * self.actors_per_node

    def node_of(self, rank: int) -> int:
        """The node hosting ``rank`` (0: the learner and its local actors)."""
        return 0 if rank <= self.num_actors else 1 + (rank - 1 - self.num_actors) // self.actors_per_node

    def node_ranks(self, node: int) -> List[int]:
        """The actor ranks node ``node`` >= 1 starts."""
        first = 1 + self.num_actors + (node - 1) * self.actors_per_node
        return list(range(first, first + self.actors_per_node))

    def timeout_text(self) -> str:
        """The process group's timeout, in the words an error message uses."""
        if self.nnodes > 1:
            return f"hardware.dist_timeout_s={self.dist_timeout_s:g} s"
        return "the process group's timeout"

    def check(self) -> None:
        """Refuse (one line, exit 2) an async layout that cannot run."""
        if not self.enabled:
            return
        if self.nnodes == 1 and self.num_actors == 0:
            raise UserError("trainer.async_rollout.num_actors=0 leaves no rollout actor: it may be 0 only "
                            "when other nodes run them (hardware.nnodes > 1); use num_actors >= 1")
        if self.nnodes > 1:
            check_node_rank(self)          # it reads node_rank and nnodes
