"""Running reward statistics for ``task.reward_norm=running``: count, mean and M2 (float64)
merged batch by batch (Chan, Golub and LeVeque, 1979). With several ranks each rank's
batch statistics are merged first (``global_batch_stats``), so every rank normalises as
one process scoring the whole batch would."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

STD_FLOOR = 1e-6         # running std below this divides by 1 (all scores so far equal)
Stats = Tuple[int, float, float]   # (count, mean, M2)


def batch_stats(xs: Sequence[float]) -> Stats:
    """(count, mean, M2) of ``xs``, with exactly rounded sums."""
    m = len(xs)
    if m == 0:
        return 0, 0.0, 0.0
    mean = math.fsum(xs) / m
    return m, mean, math.fsum((x - mean) ** 2 for x in xs)


def merged(a: Stats, b: Stats) -> Stats:
    """The statistics of the union of two sets of values (Chan et al.'s pairwise update)."""
    (na, ma, m2a), (nb, mb, m2b) = a, b
    n = na + nb
    if nb == 0:
        return a
    delta = mb - ma
    return n, ma + delta * nb / n, m2a + m2b + delta * delta * na * nb / n


def global_batch_stats(batches: Sequence[Sequence[float]]) -> List[Stats]:
    """The statistics of each of this rank's batches (one per reward model) over every rank:
    one float64 all-reduce, merged in rank order. One process: the local statistics."""
    local = [batch_stats(b) for b in batches]
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return local
    world, rank = dist.get_world_size(), dist.get_rank()
    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend() == "nccl" else torch.device("cpu"))
    table = torch.zeros(world, len(local), 3, dtype=torch.float64, device=device)  # [W, M, 3]
    table[rank] = torch.tensor(local, dtype=torch.float64, device=device)
    dist.all_reduce(table)                 # each row is one rank's: the sum is a gather
    rows, out = table.tolist(), []         # one host copy of the [W, M, 3] table
    for j in range(len(local)):
        acc: Stats = (0, 0.0, 0.0)
        for r in range(world):
            n, mean, m2 = rows[r][j]
            acc = merged(acc, (int(round(n)), mean, m2))
        out.append(acc)
    return out


@dataclass
class RunningNorm:
    """Count, mean and M2 (sum of squared deviations) of every value seen, float64."""
    count: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def update(self, xs: Sequence[float]) -> None:
        """Merge a batch (Chan et al.'s pairwise update; one value at a time is Welford's)."""
        self.merge(*batch_stats(xs))

    def merge(self, m: int, b_mean: float, b_m2: float) -> None:
        """Merge the statistics (count, mean, M2) of another set of values."""
        self.count, self.mean, self.m2 = merged((self.count, self.mean, self.m2),
                                                (m, b_mean, b_m2))

    @property
    def std(self) -> float:
        """Population standard deviation of the values seen (0 before two values)."""
        return math.sqrt(self.m2 / self.count) if self.count else 0.0

    def normalize(self, x: float) -> float:
        std = self.std
        return (x - self.mean) / (std if std > STD_FLOOR else 1.0)

    def state(self) -> Dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state(self, state: Dict[str, Any]) -> None:
        self.count, self.mean, self.m2 = int(state["count"]), float(state["mean"]), float(state["m2"])
