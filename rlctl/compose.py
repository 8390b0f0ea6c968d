"""Compose the run config from ``rlctl/conf`` + a recipe + shell overrides, and validate it.

Every failure here is a ``ConfigError`` whose message is one line naming the key and
what is valid; the CLI prints it and exits with code 2.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import yaml
from omegaconf import DictConfig, OmegaConf

from rlctl.config import GROUPS, register_schemas

CONF_DIR = Path(__file__).parent / "conf"
RECIPE_GROUP = "recipe"
CRITIC_KEYS = {"algo.vf_coef", "algo.value_clip", "algo.critic_warmup_steps", "algo.lam"}


class ConfigError(ValueError):
    """A user-facing configuration error (one line, exit code 2)."""


def group_options(group: str) -> List[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml") if not p.stem.startswith("_"))


def _one_line(msg: str) -> str:
    return " ".join(str(msg).split())


def _explain(exc: Exception, overrides: Sequence[str]) -> str:
    """Turn Hydra/OmegaConf exceptions into one line naming the key and valid values."""
    parts, seen = [], exc
    while seen is not None and len(parts) < 5:
        parts.append(_one_line(seen))
        seen = seen.__cause__ or seen.__context__
    msg = " | ".join(parts)
    m = re.search(r"Could not find '(\w+)/([^']*)'", msg)
    if m and m.group(1) in GROUPS:
        group, bad = m.groups()
        return f"unknown {group} '{bad}'; valid: {', '.join(group_options(group))}"
    m = re.search(r"Could not override '([^']+)'", msg)
    if m:
        key = m.group(1)
        parent, _, leaf = key.rpartition(".")
        valid = _valid_keys(parent)
        hint = f"; valid keys of '{parent or 'the root'}': {', '.join(valid)}" if valid else ""
        return f"unknown config key '{key}'{hint}"
    m = re.search(r"Key '([^']+)' not in '(\w+)'", msg)
    if m:
        return f"unknown config key '{m.group(1)}' in {m.group(2)}"
    m = re.search(r"Value '([^']*)' (?:of type '\w+' )?could not be converted to (\w+)", msg)
    if m:
        key = re.search(r"full_key: ([\w.\[\]]+)", msg)
        where = f" for '{key.group(1)}'" if key else ""
        return f"invalid value '{m.group(1)}'{where}: expected {m.group(2).lower()}"
    if any(t in msg for t in ("mismatched input", "no viable alternative", "extraneous input",
                              "missing EQUAL")):
        bad = [o for o in overrides if "=" not in o]
        what = f"'{bad[0]}'" if bad else "an override"
        return f"cannot parse {what}; overrides look like key=value (e.g. algo.clip_eps=0.1)"
    return parts[-1] if len(parts) > 1 and "Error merging" in parts[0] else parts[0]


def _valid_keys(parent: str) -> List[str]:
    from rlctl.config import RLConfig

    node = OmegaConf.structured(RLConfig)
    try:
        sub = OmegaConf.select(node, parent) if parent else node
    except Exception:  # noqa: BLE001 - best-effort hint only
        return []
    return sorted(k for k in sub.keys() if k != "defaults") if isinstance(sub, DictConfig) else []


RECIPE_DIRS = (Path.cwd() / "recipes", Path(__file__).resolve().parents[1] / "recipes")


def recipe_files() -> Dict[str, Path]:
    """Shipped and local recipes by name (./recipes wins over the repository's)."""
    found: Dict[str, Path] = {}
    for d in reversed(RECIPE_DIRS):
        for p in sorted(d.glob("*.yaml")) if d.is_dir() else []:
            found[p.stem] = p
    return found


def recipe_description(path: Path) -> str:
    """The first comment line after `# @package _global_`."""
    for line in path.read_text().splitlines():
        text = line.lstrip("# ").strip()
        if line.startswith("#") and text and not text.startswith("@package"):
            return text
    return ""


def resolve_recipe(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.is_file():
        return p
    known = recipe_files()
    if name_or_path in known:
        return known[name_or_path]
    raise ConfigError(f"cannot read recipe '{name_or_path}': no such file or recipe name; "
                      f"recipes: {', '.join(known) or 'none'} (list them with `rlctl recipes`)")


def load_recipe(path: str) -> Dict:
    p = resolve_recipe(path)
    try:
        data = yaml.safe_load(p.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read recipe '{path}': {_one_line(exc)[:200]}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"cannot read recipe '{path}': expected a YAML mapping of config keys")
    return data


def _store_recipe(recipe: Dict, overrides: Sequence[str]) -> None:
    """Register the recipe as a global config; groups that the shell overrides are
    dropped from it, so `--recipe R algo=ppo` really gives PPO's defaults."""
    from hydra.core.config_store import ConfigStore

    chosen = {o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o}
    switched = {g for g in GROUPS if g in chosen}
    body = {k: v for k, v in recipe.items() if k not in switched}
    defaults = []
    for item in body.get("defaults", []) or []:
        key = next(iter(item)) if isinstance(item, dict) else str(item)
        if key.replace("override", "").strip().lstrip("/") not in switched:
            defaults.append(item)
    body["defaults"] = defaults
    ConfigStore.instance().store(group=RECIPE_GROUP, name="replay", node=body, package="_global_")


@dataclass
class Composed:
    cfg: DictConfig              # unresolved, validated
    choices: Dict[str, str]      # group -> chosen option, e.g. {"algo": "grpo"}
    overrides: List[str]         # as given on the command line
    recipe: Optional[str] = None


def compose(overrides: Sequence[str] = (), recipe: Optional[str] = None) -> Composed:
    """The composed (unresolved) config, validated. Raises ConfigError."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    given = overrides = list(overrides)
    register_schemas()
    if recipe is not None:
        _store_recipe(load_recipe(recipe), overrides)
        overrides = [f"+{RECIPE_GROUP}=replay"] + overrides
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = hydra_compose(config_name="config", overrides=overrides, return_hydra_config=True)
    except Exception as exc:  # noqa: BLE001 - every compose failure is a user error
        raise ConfigError(_explain(exc, overrides)) from None
    finally:
        GlobalHydra.instance().clear()
    choices = {g: str(cfg.hydra.runtime.choices[g]) for g in GROUPS}
    with _open_struct(cfg):
        for key in ("hydra", "defaults"):
            cfg.pop(key, None)
    validate(cfg)
    critic_only = [o.split("=", 1)[0] for o in given if o.split("=", 1)[0] in CRITIC_KEYS]
    if critic_only and cfg.algo.critic == "none":
        raise ConfigError(f"{critic_only[0]} is a critic setting, and algo={choices['algo']} has no "
                          "critic; use an algorithm with one (algo=ppo) or set algo.critic=shared "
                          "with algo.advantage=gae")
    return Composed(cfg=cfg, choices=choices, overrides=given, recipe=recipe)


class _open_struct:
    def __init__(self, cfg):
        self.cfg = cfg

    def __enter__(self):
        OmegaConf.set_struct(self.cfg, False)

    def __exit__(self, *exc):
        OmegaConf.set_struct(self.cfg, True)


def _choice(cfg: DictConfig, key: str, valid: Sequence[str]) -> None:
    value = OmegaConf.select(cfg, key)
    if value not in valid:
        raise ConfigError(f"invalid {key} '{value}'; valid: {', '.join(map(str, valid))}")


def _positive(cfg: DictConfig, key: str, allow_zero: bool = False) -> None:
    value = OmegaConf.select(cfg, key)
    if value is None or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"invalid {key} '{value}'; must be {bound}")


def validate(cfg: DictConfig) -> None:
    """Checks beyond types: registry names, ranges, and options that must agree."""
    import torch

    from rlctl.core import get_policy_loss, kl_estimate, resolve_agg_mode
    from rlctl.engine.advantage import estimator_kind
    from rlctl.tasks import TASKS

    _z = torch.zeros(1)

    try:
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except Exception as exc:  # noqa: BLE001
        msg = _one_line(exc)
        key = re.search(r"full_key: ([\w.]+)", msg)
        if "Missing mandatory value" in msg and key:
            raise ConfigError(f"missing value for '{key.group(1)}'; set it with {key.group(1)}=...") from None
        raise ConfigError(msg) from None
    # Registry names (peers' spellings accepted as aliases by the registries themselves).
    for key, lookup in (("algo.advantage", estimator_kind),
                        ("algo.policy_loss", get_policy_loss),
                        ("algo.loss_agg_mode", resolve_agg_mode),
                        ("algo.kl.estimator", lambda k: k is None or kl_estimate(_z, _z, k))):
        try:
            lookup(OmegaConf.select(cfg, key))
        except ValueError as exc:
            raise ConfigError(f"invalid {key}: {_one_line(exc)}") from None
    _choice(cfg, "algo.kl.placement", ["in_loss", "in_reward"])
    _choice(cfg, "algo.critic", ["none", "shared", "separate"])
    _choice(cfg, "algo.baseline", ["none", "batch_mean"])
    a = cfg.algo
    token_level = estimator_kind(a.advantage) == "token"
    if token_level and a.critic == "none":
        raise ConfigError(f"algo.advantage={a.advantage} needs a critic; set algo.critic=shared or separate")
    if not token_level and a.critic != "none":
        raise ConfigError(f"algo.critic={a.critic} trains a value model that algo.advantage="
                          f"{a.advantage} does not use; set algo.critic=none or algo.advantage=gae")
    if a.clip_ratio_c is not None and a.clip_ratio_c <= 1:
        raise ConfigError(f"invalid algo.clip_ratio_c '{a.clip_ratio_c}'; dual clip needs a value > 1 (or null)")
    if a.kl.target is not None and (a.kl.coef <= 0 or a.kl.target <= 0):
        raise ConfigError("an adaptive KL (algo.kl.target) needs algo.kl.coef > 0 and a target > 0")
    if not 0 <= a.gamma <= 1 or not 0 <= a.lam <= 1:
        raise ConfigError(f"algo.gamma and algo.lam must lie in [0, 1] (got {a.gamma}, {a.lam})")
    _choice(cfg, "task.name", sorted(TASKS))
    _choice(cfg, "model.dtype", ["float32", "bfloat16"])
    _choice(cfg, "hardware.device", ["cpu", "cuda"])
    _choice(cfg, "hardware.backend", ["torch", "deepspeed"])
    _choice(cfg, "hardware.precision", ["fp32", "bf16"])
    _choice(cfg, "hardware.zero_stage", [0, 1, 2, 3])
    hw = cfg.hardware
    if hw.num_processes < 1 or cfg.trainer.prompts_per_step % hw.num_processes:
        raise ConfigError(f"hardware.num_processes={hw.num_processes} must be >= 1 and divide "
                          f"trainer.prompts_per_step={cfg.trainer.prompts_per_step} (each rank "
                          "samples whole prompt groups)")
    if hw.deepspeed_config is not None and not Path(hw.deepspeed_config).is_file():
        raise ConfigError(f"hardware.deepspeed_config: no such file '{hw.deepspeed_config}'")
    _choice(cfg, "logger.wandb_mode", ["offline", "online", "disabled"])
    for key in ("algo.group_size", "algo.epochs", "algo.minibatches", "trainer.prompts_per_step",
                "rollout.max_new_tokens", "hardware.num_threads", "trainer.lr",
                "trainer.async.sync_every", "trainer.async.num_actors"):
        _positive(cfg, key)
    for key in ("trainer.steps", "trainer.eval_every", "algo.clip_eps", "algo.kl.coef",
                "algo.vf_coef", "algo.critic_warmup_steps", "algo.overlong_buffer",
                "trainer.micro_batch_size", "trainer.async.max_staleness",
                "rollout.temperature", "trainer.max_grad_norm", "trainer.weight_decay"):
        _positive(cfg, key, allow_zero=True)
    if cfg.rollout.temperature == 0:
        raise ConfigError("invalid rollout.temperature '0'; sampling needs > 0 (eval is greedy already)")
    _positive(cfg, "algo.max_sampling_rounds")
    n = cfg.trainer.prompts_per_step * cfg.algo.group_size
    if n % cfg.algo.minibatches and not cfg.algo.dynamic_sampling:
        raise ConfigError(f"algo.minibatches={cfg.algo.minibatches} must divide the "
                          f"{n} sequences per step (trainer.prompts_per_step * algo.group_size)")
    if cfg.trainer.compile and hw.backend != "torch":
        raise ConfigError("trainer.compile=true needs hardware.backend=torch (DeepSpeed wraps the "
                          f"model in its own engine; got hardware.backend={hw.backend})")
    if cfg.trainer["async"].enabled and hw.num_processes > 1:
        raise ConfigError("trainer.async.enabled=true runs one learner process; it needs "
                          f"hardware.num_processes=1 (got {hw.num_processes})")
    if cfg.model.name == "hf" and not cfg.model.name_or_path:
        raise ConfigError("model=hf needs model.name_or_path=PATH_OR_HUB_ID")
