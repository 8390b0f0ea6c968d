"""Metric sinks: console, JSONL, W&B, TensorBoard, null; ``build_sinks`` returns one `MultiSink`."""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Mapping, Sequence

from .sink import MultiSink, NullSink, Sink
from .console import DEFAULT_KEYS, ConsoleSink
from .jsonl import JsonlSink, SamplesFile, read_jsonl, read_samples

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"


def build_sinks(run_dir: Path | str | None, jsonl: bool, wandb: bool, wandb_mode: str,
                project: str, name: str, run_config: Mapping[str, Any], console: bool,
                total_steps: int, console_keys: Sequence[str] = DEFAULT_KEYS,
                tensorboard: bool = False) -> MultiSink:
    """The sinks a run asked for in one MultiSink (file sinks skipped without ``run_dir``)."""
    sinks: list[Sink] = []
    if console:
        sinks.append(ConsoleSink(total_steps, console_keys))
    if run_dir is not None:
        run_dir = Path(run_dir)
        if jsonl:
            sinks += [JsonlSink(run_dir / METRICS_FILE), SamplesFile(run_dir / SAMPLES_FILE)]
        if wandb:
            sinks.append(importlib.import_module("rlctl.sinks.wandb_sink").WandbSink(
                run_dir, project=project, name=name, run_config=dict(run_config), mode=wandb_mode))
        if tensorboard:
            sinks.append(importlib.import_module("rlctl.sinks.tensorboard_sink").TensorboardSink(run_dir))
    return MultiSink(sinks)
