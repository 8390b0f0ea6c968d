"""Build a run's task (with its reward models), the task prepared for the model, the policy."""
from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch
from omegaconf import DictConfig, OmegaConf

from rlctl.errors import UserError
from rlctl.models.forward import enable_gradient_checkpointing
from rlctl.models.loading import disable_dropout, load_model_and_tokenizer
from rlctl.models.lora import apply_lora, reference_for
from rlctl.models.value import PolicyValueModel, SeparateCritic
from rlctl.rm.learned import LearnedRewards, RewardModel, build_learned_rewards, check_names
from rlctl.rm.tiny_rm import task_mismatch, tiny_reward_model_dir
from rlctl.tasks import TASKS, build_task as _task_from_registry
from rlctl.tasks.prompt_budget import Prepared, prepare
from rlctl.tasks.rewards import is_model_entry, model_entries
from rlctl.train.update import needs_reference

LEARNED_KEYS = ("reward_model", "reward_norm", "reward_clip")   # read here, not by the task


def _takes(name: str, option: str) -> bool:
    try:
        return option in inspect.signature(TASKS.get(name)).parameters
    except (TypeError, ValueError):
        return False


def _learned_rewards(cfg: DictConfig, opts: dict) -> LearnedRewards:
    """The task's reward models (or None); ``opts`` is left with what the task itself takes."""
    rm, norm, clip = (opts.pop(k, None) for k in LEARNED_KEYS)
    rm = _resolve_reward_model(rm, cfg)
    rewards = opts.get("rewards")
    if rewards and all(is_model_entry(r) for r in rewards) and not _takes(cfg.task.name, "rewards"):
        opts["rewards"] = None      # the models are all of task.rewards: nothing for the task
    if rm and _takes(cfg.task.name, "reward_model"):
        opts["reward_model"] = rm   # a data task then needs no reward function of its own
    learned = build_learned_rewards(rm, rewards, norm, clip, cfg.hardware.device)
    hw = cfg.hardware      # running: statistics merged once per sampling round, in the learner
    world = max(hw.num_processes * hw.nnodes, int(os.environ.get("WORLD_SIZE", "1") or 1))
    if learned is not None and norm == "running" and cfg.trainer.async_rollout.enabled:
        raise ValueError("task.reward_norm=running keeps its statistics in the learner, and "
                         "rollout actors score apart from it; set "
                         "trainer.async_rollout.enabled=false")
    if learned is not None and norm == "running" and world > 1 and cfg.algo.dynamic_sampling:
        raise ValueError("task.reward_norm=running merges every rank's statistics once per "
                         "sampling round, and with algo.dynamic_sampling the ranks sample "
                         "different numbers of rounds; set algo.dynamic_sampling=false (or "
                         "run one process)")
    init = cfg.algo.critic_init or "policy"
    if init not in ("policy", "reward_model"):
        raise ValueError(f"invalid algo.critic_init '{init}'; valid: policy, reward_model")
    if init == "reward_model" and cfg.algo.critic != "separate":
        raise ValueError(f"algo.critic_init={init} needs algo.critic=separate (got {cfg.algo.critic})")
    if init == "reward_model" and (learned is None or len(learned.models) != 1):
        raise ValueError("algo.critic_init=reward_model needs exactly one reward model "
                         "(task.reward_model=PATH)")
    return learned


def _resolve_reward_model(path, cfg: DictConfig):
    """``tiny``: the embedded sorting reward model (built on first use); else a directory."""
    if path != "tiny":
        return path
    problem = task_mismatch(cfg.task.name, cfg.task.get("num_digits", None))
    if problem:
        raise ValueError(problem)
    return str(tiny_reward_model_dir())   # builds ~10 s on first use, then cached


@dataclass(frozen=True)
class BuiltTask:
    """The task as its factory returned it and the run's reward models (None: none)."""
    task: Any
    learned: Optional[LearnedRewards] = None


def task_from_config(cfg: DictConfig) -> BuiltTask:
    """The task ``cfg.task.name`` with its reward models; UserError, one line, on a bad option."""
    opts = {k: v for k, v in OmegaConf.to_container(cfg.task).items() if k != "name"}
    try:
        learned = _learned_rewards(cfg, opts)
        task = _task_from_registry(cfg.task.name, **opts)
        if learned is not None:
            check_names(learned.models, list(getattr(task, "reward_weights", {}) or {}))
        return BuiltTask(task, learned)
    except (ValueError, TypeError) as exc:
        raise UserError(f"task '{cfg.task.name}': {exc}") from None


def prepare_task(cfg: DictConfig, tokenizer, model, built: Optional[BuiltTask] = None,
                 quiet: bool = False) -> Prepared:
    """``built`` (default: built from ``cfg``) prepared for the loaded model."""
    built = built or task_from_config(cfg)
    return prepare(built.task, tokenizer, cfg.rollout, model, built.learned,
                   quiet=quiet)


def model_from_config(cfg: DictConfig):
    """(policy or PolicyValueModel, separate critic or None, tokenizer, LoRA reference)."""
    opts = {k: v for k, v in OmegaConf.to_container(cfg.model).items() if k not in ("name", "lora")}
    try:
        model, tokenizer = load_model_and_tokenizer(cfg.model.name, device=cfg.hardware.device, **opts)
    except (ValueError, OSError) as exc:
        text = str(exc)
        if not text.startswith("cannot load model"):
            text = f"cannot load model: {text}"
        raise UserError(text) from None
    keep_dropout = not cfg.model.get("disable_dropout", True)
    if not keep_dropout:     # before LoRA: model.lora.dropout stays as configured
        disable_dropout(model)   # the reference and a policy-copied critic are copies of it
    torch.manual_seed(cfg.seed)
    ref_model = None
    if cfg.model.lora.enabled:
        lo = cfg.model.lora
        try:
            model = apply_lora(model, lo.r, lo.alpha, lo.dropout, list(lo.target_modules))
        except (ValueError, ImportError) as exc:
            raise UserError(f"model.lora: {exc}") from None
        if needs_reference(cfg.algo):   # the base with the adapter disabled: no second copy
            ref_model = reference_for(model)
    if cfg.model.get("gradient_checkpointing", False):   # model.gradient_checkpointing
        try:
            enable_gradient_checkpointing(model)
        except ValueError as exc:
            raise UserError(str(exc)) from None
    critic = SeparateCritic(model) if cfg.algo.critic == "separate" else None
    if cfg.algo.critic == "shared":
        model = PolicyValueModel(model)
    if critic is not None and (cfg.algo.critic_init or "policy") == "reward_model":
        critic = _critic_from_reward_model(cfg, tokenizer)
        if not keep_dropout:
            disable_dropout(critic)
    return model, critic, tokenizer, ref_model


def _critic_from_reward_model(cfg: DictConfig, tokenizer) -> SeparateCritic:
    """The one reward model as the critic, its score head as the value head (same vocabulary)."""
    try:
        task = OmegaConf.to_container(cfg.task)
        (entry,) = model_entries(task.get("rewards"), _resolve_reward_model(task.get("reward_model"), cfg))
        reward_model = RewardModel(entry.path, device=cfg.hardware.device, key=entry.key)
    except ValueError as exc:
        raise UserError(f"task '{cfg.task.name}': {exc}") from None
    if reward_model.tokenizer.get_vocab() != tokenizer.get_vocab():
        raise UserError(f"algo.critic_init=reward_model: the reward model '{reward_model.path}' "
                        "has another vocabulary than the policy's tokenizer; the critic reads "
                        "the policy's token ids (use algo.critic_init=policy)")
    return SeparateCritic.from_sequence_classifier(reward_model.load())
