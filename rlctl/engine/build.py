"""Build what a run needs from its config: the task, the policy (+LoRA, +critic, +the
LoRA reference) and quiet third-party libraries. Used by `rlctl train` (every rank), the
dry run, the async rollout actors and `rlctl eval`/`rollout`, so all of them see the same
objects for the same config."""
from __future__ import annotations

import os

import torch
from omegaconf import DictConfig, OmegaConf

from rlctl.errors import UserError
from rlctl.models.loading import load_model_and_tokenizer
from rlctl.models.lora import apply_lora, reference_for
from rlctl.models.value import PolicyValueModel, SeparateCritic
from rlctl.tasks import build_task as _task_from_registry


def attach_critic(model, critic: str):
    """(model, separate critic or None) for algo.critic = none | shared | separate."""
    if critic == "none":
        return model, None
    if critic == "shared":
        return PolicyValueModel(model), None
    return model, SeparateCritic(model)


def quiet_libraries(cfg: DictConfig) -> None:
    """No progress bars or info logs from transformers; the configured torch threads."""
    if cfg.hardware.device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # transformers may import deepspeed
    import transformers  # after DS_ACCELERATOR is set: transformers may import deepspeed

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    torch.set_num_threads(cfg.hardware.num_threads)


def task_from_config(cfg: DictConfig):
    """The task named by ``cfg.task.name`` with the rest of ``cfg.task`` as its options."""
    opts = {k: v for k, v in OmegaConf.to_container(cfg.task).items() if k != "name"}
    try:
        return _task_from_registry(cfg.task.name, **opts)
    except (ValueError, TypeError) as exc:
        raise UserError(f"task '{cfg.task.name}': {exc}") from None


def _load_error(exc: Exception) -> UserError:
    text = str(exc)
    return UserError(text if text.startswith("cannot load model") else f"cannot load model: {text}")


def model_from_config(cfg: DictConfig):
    """(policy or PolicyValueModel, separate critic or None, tokenizer, LoRA reference)."""
    opts = {k: v for k, v in OmegaConf.to_container(cfg.model).items() if k not in ("name", "lora")}
    try:
        model, tokenizer = load_model_and_tokenizer(cfg.model.name, device=cfg.hardware.device, **opts)
    except (ValueError, OSError) as exc:
        raise _load_error(exc) from None
    torch.manual_seed(cfg.seed)
    ref_model = None
    if cfg.model.lora.enabled:
        lo = cfg.model.lora
        try:
            model = apply_lora(model, lo.r, lo.alpha, lo.dropout, list(lo.target_modules))
        except (ValueError, ImportError) as exc:
            raise UserError(f"model.lora: {exc}") from None
        if cfg.algo.kl.coef > 0:   # the base with the adapter disabled: no second copy
            ref_model = reference_for(model)
    model, critic = attach_critic(model, cfg.algo.critic)
    return model, critic, tokenizer, ref_model
