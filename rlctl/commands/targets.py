"""TARGET of `rlctl eval`, `rollout` and `serve` (a run, model or adapter dir) and its scorer."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from omegaconf import OmegaConf
from transformers import AutoTokenizer

from rlctl.commands.files import is_run_dir
from rlctl.config.compose import compose
from rlctl.errors import CheckpointError, ConfigError, UserError
from rlctl.models.loading import load_model_and_tokenizer, prepare_tokenizer, quiet_libraries
from rlctl.models.lora import quiet_peft
from rlctl.models.stop_ids import resolve_stop_ids
from rlctl.train.build import prepare_task, task_from_config
from rlctl.storage.checkpoint import latest_checkpoint, read_state, step_of
from rlctl.tasks.scoring import RewardScorer


@dataclass
class Target:
    kind: str                       # "run" | "model" | "adapter" | "config"
    path: Optional[Path] = None     # what the user named
    run_dir: Optional[Path] = None  # the run whose config is used, if any


def resolve_target(target: Optional[str]) -> Target:
    if target is None:
        return Target("config")
    path = Path(target).expanduser()
    if not path.exists():
        raise UserError(f"no such file or directory: '{target}' (TARGET is a run directory, "
                        "a model directory or a LoRA adapter; overrides look like key=value)")
    if not path.is_dir():
        raise UserError(f"'{target}' is a file; TARGET is a run directory, a model directory "
                        "or a LoRA adapter directory")
    parent_run = path.parent if is_run_dir(path.parent) else None
    if is_run_dir(path):
        return Target("run", path, path)
    if (path / "adapter_config.json").is_file():
        return Target("adapter", path, parent_run)
    if (path / "config.json").is_file():
        return Target("model", path, parent_run)
    raise UserError(f"'{target}' is not a run directory (no config.yaml), a model directory "
                    "(no config.json) or a LoRA adapter (no adapter_config.json)")


def load_config(target: Target, overrides: Sequence[str]):
    """The resolved config: the run's recipe + overrides (a run without recipe.yaml: config.yaml)."""
    if target.run_dir is None:
        cfg = compose(overrides).cfg
    elif (target.run_dir / "recipe.yaml").is_file():
        cfg = compose(overrides, str(target.run_dir / "recipe.yaml")).cfg
    else:
        path = target.run_dir / "config.yaml"
        cfg = OmegaConf.load(path)
        OmegaConf.set_struct(cfg, True)
        for item in overrides:
            key, _, value = item.partition("=")
            if OmegaConf.select(cfg, key, default="__missing__") == "__missing__":
                raise ConfigError(f"unknown config key '{key}' in {path}")
            OmegaConf.update(cfg, key, OmegaConf.from_dotlist([f"x={value}"]).x, merge=False)
    OmegaConf.resolve(cfg)
    return cfg


def open_target(target_arg, overrides):
    """(target, cfg, prepared task, model, tokenizer, description) for eval/rollout; path
    errors first, then config, model (given the full stop set) and task errors."""
    target = resolve_target(target_arg)
    cfg = load_config(target, overrides)
    built = task_from_config(cfg)
    model, tokenizer, what = load_policy(target, cfg)
    resolve_stop_ids(model, tokenizer, cfg.rollout.get("stop_token_ids", None))
    prepared = prepare_task(cfg, tokenizer, model, built)   # chat template; prompts within the context
    return target, cfg, prepared, model, tokenizer, what


def load_policy(target: Target, cfg):
    """(model in eval mode, tokenizer, a one-line description of what was loaded)."""
    quiet_libraries(cfg.hardware.device, cfg.hardware.num_threads)
    device, dtype = cfg.hardware.device, cfg.model.dtype
    model_dir = target.path
    if target.kind == "run":
        model_dir = target.path / "model"
        if not model_dir.is_dir():
            raise UserError(f"run '{target.path}' has no model/ directory (trained with "
                            "run.save_model=false?)")
    try:
        if target.kind == "config":
            opts = {k: v for k, v in OmegaConf.to_container(cfg.model).items() if k != "name"}
            model, tok = load_model_and_tokenizer(cfg.model.name, device=device, **opts)
            what = cfg.model.name_or_path or f"model={cfg.model.name}"
        elif (model_dir / "adapter_config.json").is_file():
            model, tok, what = _load_adapter(model_dir, dtype, device)
        elif (model_dir / "config.json").is_file():
            model, tok = load_model_and_tokenizer("hf", name_or_path=str(model_dir.resolve()),
                                                  dtype=dtype, device=device)
            what = str(model_dir)
        else:
            raise UserError(f"'{model_dir}' holds neither config.json nor adapter_config.json")
    except (ValueError, OSError) as exc:
        if isinstance(exc, UserError):
            raise
        raise UserError(f"cannot load model: {exc}") from None
    model.eval()
    return model, tok, what


def _load_adapter(adapter_dir: Path, dtype: str, device: str):
    """A peft LoRA adapter on its base model (from adapter_config.json), merged."""
    try:
        base_name = json.loads((adapter_dir / "adapter_config.json").read_text()).get(
            "base_model_name_or_path")
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"cannot read {adapter_dir}/adapter_config.json: {exc}") from None
    if not base_name:
        raise UserError(f"{adapter_dir}/adapter_config.json names no base_model_name_or_path")
    try:
        from peft import PeftModel   # optional and slow to import (seconds): only for adapters
    except ImportError:
        raise UserError("loading a LoRA adapter needs peft: pip install 'rlctl[scale]'") from None
    base, tok = load_model_and_tokenizer("hf", name_or_path=base_name, dtype=dtype, device=device)
    if (adapter_dir / "tokenizer_config.json").is_file():  # saved with the adapter: prefer it
        tok = prepare_tokenizer(AutoTokenizer.from_pretrained(str(adapter_dir)), base)
    with quiet_peft():
        model = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    model.to(device)
    return model, tok, f"{adapter_dir} (LoRA on {base_name}, merged)"


def reward_parts(task, scorer, i: int, example, completion: str, reward_name: str,
                 total: float) -> dict:
    """Sample ``i`` of the scorer's last batch: each named reward as training logs it
    (reward/<name>: each reward function, design, reward model's raw score), with every
    design of a task's ``score_all``; a task without names: its total under ``reward_name``."""
    parts = {k: float(v[i]) for k, v in scorer.last_components.items()}
    if not scorer.has_gold:               # reward models alone
        return parts
    score_all = getattr(task, "score_all", None)
    designs = score_all(example, completion) if callable(score_all) else \
        {} if parts else {reward_name: total}
    return {**{k: float(v) for k, v in designs.items()}, **parts}


def learned_names(scorer) -> List[str]:
    """The reward models' names (their raw scores are the components reward/<name>)."""
    return [m.name for m in scorer.learned.models] if scorer.learned is not None else []


@dataclass
class SavedNorm:
    """Where the statistics came from (None: there were none to read)."""
    checkpoint: Optional[str]
    step: Optional[int]
    note: str                # one line for stderr and the report


def held_out_scorer(prepared, target) -> Tuple[RewardScorer, Optional[SavedNorm]]:
    """(a scorer that reads the run's saved task.reward_norm=running statistics and never
    updates them, where they came from: None without running norm)."""
    scorer = prepared.scorer(norm_owner=False)
    learned = scorer.learned
    if learned is None or learned.norm != "running":
        return scorer, None
    ckpt = latest_checkpoint(target.run_dir) if target.run_dir is not None else None
    state, why = None, "no checkpoint"
    if ckpt is not None:
        try:
            state = read_state(ckpt).get("scorer", {}).get("reward_norm")
            why = f"none in {ckpt}"
        except CheckpointError as exc:
            why = str(exc)
    if not state:
        where = f"run '{target.run_dir}'" if target.run_dir is not None else "this target"
        return scorer, SavedNorm(None, None, (
            f"task.reward_norm=running: {where} has no saved reward statistics ({why}), so "
            "'reward' is the reward models' score without normalisation"))
    learned.load_state(state)
    step = step_of(ckpt)
    return scorer, SavedNorm(str(ckpt), step, (
        f"task.reward_norm=running: 'reward' is normalised with the run's saved statistics "
        f"(checkpoint step {step}); 'reward_raw' is the raw score"))


def reward_label(scorer: RewardScorer, reward_name: str, saved: Optional[SavedNorm]) -> str:
    """What the 'reward' row holds: the reward design, or the reward models' score as trained."""
    learned = scorer.learned
    if learned is None:
        return reward_name
    what = "reward model" if learned.replace_task else f"{reward_name} + reward models"
    shaping = []
    if saved is not None:
        shaping.append(f"normalised with the run's saved statistics, step {saved.step}"
                       if saved.step is not None else "raw: no saved statistics")
    if learned.clip is not None:
        shaping.append(f"clipped to +-{learned.clip:g}")
    return f"{what}, {'; '.join(shaping)}" if shaping else what
