"""Metric sinks: console (rich), JSONL, wandb (offline by default), TensorBoard, a null sink.

The trainer holds one `MultiSink` from `build_sinks` and calls log/samples/summary/close on
it; which loggers are on is decided here, once (no `if wandb:` branches elsewhere).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from .base import MultiSink, NullSink, Sink
from .console import DEFAULT_KEYS, ConsoleSink
from .jsonl import JsonlSink, SamplesFile, read_jsonl, read_samples
from .tensorboard_sink import TENSORBOARD_DIR, TensorboardSink  # light: imports torch when used
from .wandb_sink import WandbSink, sample_key  # light: wandb itself is imported when a run starts

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"

__all__ = [
    "Sink",
    "NullSink",
    "MultiSink",
    "JsonlSink",
    "ConsoleSink",
    "WandbSink",
    "TensorboardSink",
    "SamplesFile",
    "build_sinks",
    "read_jsonl",
    "read_samples",
    "sample_key",
    "METRICS_FILE",
    "SAMPLES_FILE",
    "TENSORBOARD_DIR",
]


def build_sinks(
    run_dir: Path | str | None,
    jsonl: bool,
    wandb: bool,
    wandb_mode: str,
    project: str,
    name: str,
    run_config: Mapping[str, Any],
    console: bool,
    total_steps: int,
    console_keys: Sequence[str] = DEFAULT_KEYS,
    tensorboard: bool = False,
) -> MultiSink:
    """The sinks a run asked for, fanned out by one MultiSink (empty = null sink).

    jsonl, wandb and tensorboard write inside `run_dir` (`metrics.jsonl` with
    `samples.jsonl` beside it, `wandb/...`, `tensorboard/`) and are skipped when run_dir
    is None. Only an unknown wandb_mode raises; otherwise wandb
    falls back to offline or to disabled with one warning line (see WandbSink).
    ``run_config``: the resolved config as plain data, recorded as the W&B run's config.
    ``console_keys``: the figures the console shows (the RL schema's by default).
    """
    sinks: list[Sink] = []
    if console:
        sinks.append(ConsoleSink(total_steps, console_keys))
    if run_dir is not None:
        run_dir = Path(run_dir)
        if jsonl:
            sinks.append(JsonlSink(run_dir / METRICS_FILE))
            sinks.append(SamplesFile(run_dir / SAMPLES_FILE))
        if wandb:
            sinks.append(WandbSink(run_dir, project=project, name=name, run_config=dict(run_config),
                                   mode=wandb_mode))
        if tensorboard:
            sinks.append(TensorboardSink(run_dir))
    return MultiSink(sinks)
