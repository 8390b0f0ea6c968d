"""What `rlctl train` builds: one rank (``built_rank``) and the dry run's models (``dry_run``)."""
from __future__ import annotations

import copy
import importlib
import json
import os
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

import torch
from omegaconf import DictConfig, OmegaConf

from rlctl.dist import build_backend
from rlctl.errors import UserError
from rlctl.models.loading import quiet_libraries
from rlctl.models.lora import count_parameters
from rlctl.rollout.generate import check_training_sampling
from rlctl.sinks import SAMPLES_FILE, NullSink, build_sinks
from rlctl.storage import checkpoint
from rlctl.train.build import model_from_config, prepare_task, task_from_config
from rlctl.train.preflight import check_entries
from rlctl.train.sources import build_source
from rlctl.train.trainer import Trainer


@dataclass(frozen=True)
class Rank:
    """What one rank trains (its ``trainer`` holds the backend, sink, critic and tokenizer)."""
    trainer: Trainer
    params: Tuple[int, int]         # (trainable, total)
    lora: bool
    merged: bool                    # model.lora.save_merged (with LoRA)
    save: bool                      # run.save_model
    resume_from: Optional[Path]     # the checkpoint a resume continues from
    closing: ExitStack              # ends the sinks and the source
    started: float                  # time.perf_counter() when the build began


@contextmanager
def built_rank(cfg: DictConfig, run_dir: Path, resume: bool, stop, built=None) -> Iterator[Rank]:
    """Yields this rank's ``Rank`` (backend, models, sinks, source, Trainer), then closes it."""
    quiet_libraries(cfg.hardware.device, cfg.hardware.num_threads)
    started = time.perf_counter()
    if cfg.hardware.device == "cuda" and int(os.environ.get("WORLD_SIZE", 1)) > 1:
        local = int(os.environ.get("LOCAL_RANK", 0))     # each rank its launcher's local GPU
        torch.cuda.set_device(local)
        cfg = copy.deepcopy(cfg)
        cfg.hardware.device = f"cuda:{local}"             # the builders read it from the config
    hw, lora = cfg.hardware, bool(cfg.model.lora.enabled)
    backend = build_backend(hw.backend, hw.device, hw.zero_stage, hw.precision, hw.deepspeed_config,
                            hw.cpu_offload)
    closing = ExitStack()
    try:
        built = built or task_from_config(cfg)
        model, critic, tokenizer, ref_model = model_from_config(cfg)
        prepared = prepare_task(cfg, tokenizer, model, built)   # chat template; prompts within the context
        params = count_parameters(model, critic)
        torch.manual_seed(cfg.seed * 1000 + backend.rank)   # each rank samples differently
        resume_from = resume_point(run_dir, backend) if resume else None
        log = cfg.logger                     # rank 0's sinks (the config as a dict for wandb)
        sink = NullSink() if not backend.is_main else build_sinks(
            run_dir=run_dir, jsonl=log.jsonl, wandb=log.wandb, wandb_mode=log.wandb_mode,
            project=log.project, name=run_dir.name, run_config=OmegaConf.to_container(cfg),
            console=log.console, total_steps=cfg.trainer.steps, tensorboard=log.tensorboard)
        closing.callback(sink.close)
        source = build_source(cfg, model, tokenizer, prepared, backend, stop)
        try:
            trainer = Trainer.from_config(cfg, model, tokenizer, prepared, sink, source=source,
                                          critic=critic, ref_model=ref_model, backend=backend)
        except BaseException:
            source.close()                   # async: the engines end now, not at Python's exit
            raise
        closing.callback(trainer.close)      # async mode: stop the engine processes
        yield Rank(trainer, params, lora, lora and bool(cfg.model.lora.save_merged),
                   bool(cfg.run.save_model), resume_from, closing, started)
    finally:
        closing.close()
        backend.close()


def no_checkpoint(run_dir: Path) -> UserError:
    return UserError(f"cannot resume '{run_dir}': it has no complete checkpoint "
                     "(trainer.checkpoint_every writes them)")


def truncate_after(path: Path, step: int) -> None:
    """Drop the lines of a JSONL run file logged after ``step`` (they will be redone)."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue                     # a line torn by the kill
        if row.get("step", step + 1) <= step:
            keep.append(line)
    path.write_text("".join(x + "\n" for x in keep))


def resume_point(run_dir: Path, backend) -> Path:
    """The newest checkpoint; rank 0 drops the metric and sample lines logged after it."""
    resume_from = checkpoint.latest_checkpoint(run_dir)
    if resume_from is None:
        raise no_checkpoint(run_dir)
    if backend.is_main:
        for name in ("metrics.jsonl", SAMPLES_FILE):
            truncate_after(run_dir / name, checkpoint.step_of(resume_from))
    backend.barrier()
    return resume_from


def dry_run(cfg: DictConfig) -> List[str]:
    """`rlctl train --dry-run`: the models built as `train` builds them; returns the plan's lines."""
    OmegaConf.resolve(cfg)
    quiet_libraries(cfg.hardware.device, cfg.hardware.num_threads)
    check_entries(cfg.algo, cfg.task.name, cfg.hardware.backend)
    built = task_from_config(cfg)
    check_training_sampling(cfg.rollout.top_k)
    dryrun = importlib.import_module("rlctl.train.dryrun")     # a train run does not need it
    models = model_from_config(cfg)
    prepared = prepare_task(cfg, models[2], models[0], built)   # the prompts `train` samples
    settings = dryrun.MemorySettings.from_config(cfg, dryrun.prompt_tokens(prepared, models[2]))
    return dryrun.plan(settings, cfg.algo, models, built.learned)
