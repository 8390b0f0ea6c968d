"""Private dtype helpers: reductions and exponentials run in float32 (float64 stays float64)."""
from __future__ import annotations

import torch


def acc_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def upcast(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`x` in the accumulation dtype (a no-op for float32 / float64 inputs)."""
    return x.to(dtype or acc_dtype(x))


def keep(mask: torch.Tensor) -> torch.Tensor:
    """Boolean "this position counts" from a 0/1 (or weight) mask of any dtype."""
    return mask != 0
