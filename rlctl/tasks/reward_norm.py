"""Running reward statistics for ``task.reward_norm=running``: count, mean and M2 of
every score seen (float64), merged batch by batch with the pairwise update of Chan,
Golub and LeVeque (1979) (Welford's update, one value at a time)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Sequence

STD_FLOOR = 1e-6         # running std below this divides by 1 (all scores so far equal)


@dataclass
class RunningNorm:
    """Count, mean and M2 (sum of squared deviations) of every value seen, float64."""
    count: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def update(self, xs: Sequence[float]) -> None:
        """Merge a batch (Chan et al.'s pairwise update; one value at a time is Welford's)."""
        m = len(xs)
        if m == 0:
            return
        b_mean = math.fsum(xs) / m
        b_m2 = math.fsum((x - b_mean) ** 2 for x in xs)
        n = self.count + m
        delta = b_mean - self.mean
        self.mean += delta * m / n
        self.m2 += b_m2 + delta * delta * self.count * m / n
        self.count = n

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
