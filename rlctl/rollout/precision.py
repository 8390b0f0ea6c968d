"""The sampler's numeric precision (``rollout.sample_dtype``), apart from the learner's.

``float32``: the sampling forwards run as the model is (the learner's own numbers).
``bfloat16``: they run under ``torch.autocast(device, bfloat16)``: matrix products in
bfloat16, the weights untouched, so the learner (float32) and the sampler share one module
and differ only in the sampler's rounding: the engine/learner mismatch an inference
engine in bf16 brings (docs/math.md, section 14), reproducible on a CPU.
"""
from __future__ import annotations

import contextlib

import torch

SAMPLE_DTYPES = ("float32", "bfloat16")


@contextlib.contextmanager
def sampling_precision(model, dtype: str):
    """Within: ``model``'s forwards in the sampler's precision ``dtype`` (SAMPLE_DTYPES)."""
    if dtype not in SAMPLE_DTYPES:
        raise ValueError(f"rollout.sample_dtype must be one of {SAMPLE_DTYPES}; got {dtype!r}")
    if dtype == "float32":
        yield
        return
    device = next(model.parameters()).device.type
    with torch.autocast(device, dtype=torch.bfloat16):
        yield
