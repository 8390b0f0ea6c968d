"""Quiet third-party libraries before a model is loaded: no progress bars or info logs from
transformers, and the configured number of torch threads."""
from __future__ import annotations

import os

import torch


def quiet_libraries(device: str, num_threads: int) -> None:
    if device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # transformers may import deepspeed
    import transformers  # after DS_ACCELERATOR is set: transformers may import deepspeed

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    torch.set_num_threads(num_threads)
