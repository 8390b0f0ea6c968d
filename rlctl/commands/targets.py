"""TARGET resolution shared by `rlctl eval` and `rlctl rollout`.

A TARGET is one of
    run dir      holds config.yaml (written by `rlctl train`); its recipe.yaml is
                 recomposed with the shell overrides on top, and its model/ is loaded
    model dir    a Hugging Face checkpoint (config.json), e.g. runs/<id>/model
    LoRA adapter a peft adapter dir (adapter_config.json), loaded onto the base model
                 named in the adapter config and merged
    (absent)     the model configured by the composed config (the starting point)
A model or adapter dir inside a run dir (runs/<id>/model) takes the task and rollout
settings from that run; elsewhere from the default config plus overrides.
"""
from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from omegaconf import OmegaConf
from transformers import AutoTokenizer

from rlctl.commands.files import is_run_dir
from rlctl.compose import compose
from rlctl.errors import ConfigError, UserError
from rlctl.models.loading import load_model_and_tokenizer, prepare_tokenizer, quiet_libraries
from rlctl.models.stop_ids import resolve_stop_ids
from rlctl.run.build import prepare_task, task_from_config


@dataclass
class Target:
    kind: str                       # "run" | "model" | "adapter" | "config"
    path: Optional[Path] = None     # what the user named
    run_dir: Optional[Path] = None  # the run whose config is used, if any


def split_args(args: Sequence[str], usage: str) -> Tuple[Optional[str], List[str]]:
    """(TARGET or None, OVERRIDES) from the free arguments; overrides contain '='."""
    args = list(args)
    flags = [a for a in args if a.startswith("-")]
    if flags:
        raise UserError(f"unknown option '{flags[0]}'; usage: {usage}")
    target = None
    if args and "=" not in args[0]:
        target = args.pop(0)
    stray = [a for a in args if "=" not in a]
    if stray:
        raise UserError(f"unexpected argument '{stray[0]}': only one TARGET is allowed and "
                        "overrides look like key=value (e.g. task.num_eval=512)")
    return target, args


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
    """The resolved config: the run's recipe (when there is a run) + overrides."""
    if target.run_dir is not None:
        recipe = target.run_dir / "recipe.yaml"
        if recipe.is_file():
            cfg = compose(overrides, str(recipe)).cfg
        else:  # an older run without a recipe: its resolved config + dotted overrides
            cfg = _config_yaml_with_overrides(target.run_dir / "config.yaml", overrides)
    else:
        cfg = compose(overrides).cfg
    OmegaConf.resolve(cfg)
    return cfg


def _config_yaml_with_overrides(path: Path, overrides: Sequence[str]):
    cfg = OmegaConf.load(path)
    OmegaConf.set_struct(cfg, True)
    for item in overrides:
        key, _, value = item.partition("=")
        if OmegaConf.select(cfg, key, default="__missing__") == "__missing__":
            raise ConfigError(f"unknown config key '{key}' in {path}")
        OmegaConf.update(cfg, key, OmegaConf.from_dotlist([f"x={value}"]).x, merge=False)
    return cfg


def open_target(target_arg, overrides):
    """(target, cfg, prepared task, model, tokenizer, description) for eval/rollout: path
    errors come before the config is composed and the model loaded; the task is prepared
    for the model (``rlctl.run.build.prepare_task``); the model's generation config holds
    the full stop set."""
    target = resolve_target(target_arg)
    cfg = load_config(target, overrides)
    built = task_from_config(cfg)
    model, tokenizer, what = load_policy(target, cfg)
    # the stop set (tokenizer EOS, generation config, rollout.stop_token_ids) onto the model
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
    with warnings.catch_warnings():  # peft calls deprecated transformers helpers
        warnings.simplefilter("ignore", FutureWarning)
        model = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    model.to(device)
    return model, tok, f"{adapter_dir} (LoRA on {base_name}, merged)"


def task_scores(task, example, completion: str, reward_name: str, reward: float) -> dict:
    """Every reward design of the task ({design: value}); a generic task: its ``reward``
    (the scorer's total: user code is not run again outside the scorer's time limit)."""
    score_all = getattr(task, "score_all", None)
    if callable(score_all):
        return {k: float(v) for k, v in score_all(example, completion).items()}
    return {reward_name: float(reward)}
