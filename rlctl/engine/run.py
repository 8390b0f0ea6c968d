"""`rlctl train`: compose -> build task, model, sinks -> train -> save the run."""
from __future__ import annotations

import os
import resource
import time
from typing import List, Optional

from omegaconf import OmegaConf

from rlctl.compose import compose
from rlctl.errors import UserError


def attach_critic(model, critic: str):
    """(model, separate critic or None) for algo.critic = none | shared | separate."""
    if critic == "none":
        return model, None
    from rlctl.models.value import PolicyValueModel, SeparateCritic

    if critic == "shared":
        return PolicyValueModel(model), None
    return model, SeparateCritic(model)


def run_training(overrides: List[str], recipe: Optional[str] = None):
    composed = compose(overrides, recipe)
    cfg = composed.cfg
    OmegaConf.resolve(cfg)

    if cfg.hardware.device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # transformers may import deepspeed
    import torch
    import transformers

    from rlctl.engine import rundir
    from rlctl.engine.report import print_summary
    from rlctl.engine.trainer import Trainer
    from rlctl.models.loading import load_model_and_tokenizer
    from rlctl.sinks import build_sinks
    from rlctl.tasks import build_task

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    torch.set_num_threads(cfg.hardware.num_threads)
    t0 = time.perf_counter()
    task_opts = {k: v for k, v in OmegaConf.to_container(cfg.task).items() if k != "name"}
    try:
        task = build_task(cfg.task.name, **task_opts)
    except (ValueError, TypeError) as exc:
        raise UserError(f"task '{cfg.task.name}': {exc}") from None
    run_dir = rundir.create_run_dir(cfg.run.output_dir, cfg.run.name)
    rundir.write_config(run_dir, composed)
    model_opts = {k: v for k, v in OmegaConf.to_container(cfg.model).items() if k != "name"}
    try:
        model, tokenizer = load_model_and_tokenizer(cfg.model.name, device=cfg.hardware.device,
                                                    **model_opts)
    except (ValueError, OSError) as exc:
        raise UserError(f"cannot load model: {exc}") from None
    torch.manual_seed(cfg.seed)
    model, critic = attach_critic(model, cfg.algo.critic)
    sink = build_sinks(run_dir=run_dir, jsonl=cfg.logger.jsonl, wandb=cfg.logger.wandb,
                       wandb_mode=cfg.logger.wandb_mode, project=cfg.logger.project,
                       name=run_dir.name, config=OmegaConf.to_container(cfg),
                       console=cfg.logger.console, total_steps=cfg.trainer.steps)
    try:
        result = Trainer(cfg, model, tokenizer, task, sink, critic=critic).train()
        summary = {"run_dir": str(run_dir), "steps": result.steps, "train_seconds": result.seconds,
                   "setup_seconds": time.perf_counter() - t0 - result.seconds,
                   "tokens_per_s": result.tokens_per_s, "eval_start": result.eval_start,
                   "eval_end": result.eval_end, "final_metrics": result.last_metrics}
        sink.summary({f"final/{k}": v for k, v in result.eval_end.items()})
    finally:
        sink.close()
    if cfg.run.save_model:
        summary["model_dir"] = str(rundir.save_model(run_dir, model, tokenizer))
        if critic is not None:
            critic.save_pretrained(run_dir / "critic")
    summary["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    rundir.write_json_atomic(run_dir / "summary.json", summary)
    print_summary(summary)
    return summary
