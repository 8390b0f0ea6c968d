"""Compose the run config from ``rlctl/conf`` + a recipe + shell overrides, and validate it.

Every failure here is a ``ConfigError`` whose message is one line naming the key and
what is valid; the CLI prints it and exits with code 2.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import yaml
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf, open_dict

from rlctl.config import (GROUPS, RLConfig, example_value, range_problem, register_schemas,
                          rename_deprecated, schema_fields)
from rlctl.errors import ConfigError

CONF_DIR = Path(__file__).parent / "conf"
RECIPE_GROUP = "recipe"
CRITIC_KEYS = {"algo.vf_coef", "algo.value_clip", "algo.critic_warmup_steps", "algo.lam"}


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
    m = re.search(r"Could not override '([^']+)'", msg) or re.search(
        r"Key '[^']+' not in '\w+' full_key: ([\w.]+)", msg)
    if m:
        return _unknown_key(m.group(1))
    m = re.search(r"full_key: ([\w.]+)", msg)
    if m and any(t in msg for t in TYPE_ERRORS):
        return _type_message(m.group(1), msg, overrides)
    if any(t in msg for t in GRAMMAR_ERRORS):
        return grammar_message(msg, overrides)
    return parts[-1] if len(parts) > 1 and "Error merging" in parts[0] else parts[0]


TYPE_ERRORS = ("could not be converted", "is not a valid bool", "is not a ListConfig",
               "is not a subclass of", "is not Optional", "Incompatible value")
GRAMMAR_ERRORS = ("mismatched input", "no viable alternative", "extraneous input", "missing EQUAL",
                  "token recognition error")
KIND_NAMES = {"float": "a float", "int": "an integer", "bool": "a boolean",
              "str": "a string", "list": "a list", "any": "a value"}


def _unknown_key(key: str) -> str:
    parent, _, _ = key.rpartition(".")
    valid = _valid_keys(parent)
    hint = f"; valid keys of '{parent or 'the root'}': {', '.join(valid)}" if valid else ""
    return f"unknown config key '{key}'{hint}"


def _given_value(key: str, msg: str, overrides: Sequence[str]) -> str:
    """The value as the user typed it (the override), else as OmegaConf quotes it."""
    for o in overrides:
        k, eq, v = o.partition("=")
        if eq and k.lstrip("+~") == key:
            return v
    m = re.search(r"[Vv]alue '(.*?)'(?: of type| is not a valid| for field)", msg) \
        or re.search(r"value: (\S+)", msg)
    return m.group(1) if m else "null" if "not Optional" in msg else "?"


def _type_message(key: str, msg: str, overrides: Sequence[str]) -> str:
    """'invalid value V for KEY: expected TYPE (e.g. KEY=EXAMPLE)', from the schema."""
    spec = next((s for s in schema_fields() if s.key == key), None)
    value = _given_value(key, msg, overrides)
    if spec is None:
        return f"invalid value '{value}' for '{key}': {msg.split(' full_key')[0][-160:]}"
    if spec.kind == "group":
        keys = ", ".join(_valid_keys(key))
        return (f"invalid value '{value}' for '{key}': it is a group of keys ({keys}); set one of "
                f"them, e.g. {key}.{_valid_keys(key)[0]}=...")
    what = KIND_NAMES[spec.kind]
    if spec.kind == "list":
        what = {"str": "a list of strings", "float": "a list of floats"}.get(spec.item, "a list")
    if spec.optional:
        what += " or null"
    elif value in ("null", "None"):
        what += " (null is not allowed)"
    return f"invalid value '{value}' for '{key}': expected {what} (e.g. {key}={example_value(spec)})"


def grammar_message(msg: str, overrides: Sequence[str]) -> str:
    """Hydra's override grammar error as one line: which override, and what it looks like."""
    m = re.search(r"Error parsing override '([^']*)'", msg)
    bad = m.group(1) if m else _first_unparsable(overrides)
    reason = re.search(r"(mismatched input|no viable alternative at input|extraneous input|"
                       r"missing EQUAL at|token recognition error at:) ?('[^']*')?", msg)
    why = f" ({reason.group(1)} {reason.group(2) or ''})".replace(" )", ")") if reason else ""
    what = f"'{bad}'" if bad is not None else "an override"
    return (f"cannot parse {what}{why}; overrides look like key=value (e.g. algo.clip_eps=0.1), "
            "a sweep (-m) lists values like seed=0,1,2")


def _first_unparsable(overrides: Sequence[str]) -> Optional[str]:
    parser = OverridesParser.create()
    for o in overrides:
        try:
            parser.parse_override(o)
        except Exception:  # noqa: BLE001 - Hydra's grammar errors
            return o
    return None


def check_override_syntax(overrides: Sequence[str]) -> None:
    """Parse overrides with Hydra's grammar (sweep lists included); ConfigError on failure."""
    try:
        OverridesParser.create().parse_overrides(list(overrides))
    except Exception as exc:  # noqa: BLE001 - Hydra's grammar errors
        raise ConfigError(grammar_message(_one_line(exc), overrides)) from None


def _valid_keys(parent: str) -> List[str]:
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
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
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
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"cannot read recipe '{path}': not UTF-8 text (byte {exc.object[exc.start]:#04x} "
                          f"at offset {exc.start}); a recipe is a YAML file of config keys") from None
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
    given, loaded = rename_deprecated(list(overrides), load_recipe(recipe) if recipe is not None else None)
    overrides = given
    register_schemas()
    if recipe is not None:
        _store_recipe(loaded, overrides)
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
    with open_dict(cfg):
        for key in ("hydra", "defaults"):
            cfg.pop(key, None)
    validate(cfg)
    critic_only = [o.split("=", 1)[0] for o in given if o.split("=", 1)[0] in CRITIC_KEYS]
    if critic_only and cfg.algo.critic == "none":
        raise ConfigError(f"{critic_only[0]} is a critic setting, and algo={choices['algo']} has no "
                          "critic; use an algorithm with one (algo=ppo) or set algo.critic=shared "
                          "with algo.advantage=gae")
    return Composed(cfg=cfg, choices=choices, overrides=given, recipe=recipe)


def _choice(cfg: DictConfig, key: str, valid: Sequence[str]) -> None:
    value = OmegaConf.select(cfg, key)
    if value not in valid:
        raise ConfigError(f"invalid {key} '{value}'; valid: {', '.join(map(str, valid))}")


def _check_resolved(cfg: DictConfig) -> None:
    try:
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except Exception as exc:  # noqa: BLE001
        msg = _one_line(exc)
        key = re.search(r"full_key: ([\w.]+)", msg)
        if "Missing mandatory value" in msg and key:
            raise ConfigError(f"missing value for '{key.group(1)}'; set it with {key.group(1)}=...") from None
        raise ConfigError(msg) from None


def check_ranges(cfg: DictConfig) -> None:
    """Every numeric key against rlctl.config.RANGES (and finite, for floats); no torch."""
    def interpolated(key: str) -> bool:   # checked last: a bad source is named, not its copy
        parent, _, leaf = key.rpartition(".")
        return OmegaConf.is_interpolation(OmegaConf.select(cfg, parent) if parent else cfg, leaf)

    numeric = [s for s in schema_fields() if s.kind in ("float", "int", "list")]
    for spec in sorted(numeric, key=lambda s: interpolated(s.key)):
        value = OmegaConf.select(cfg, spec.key)
        items = list(value) if spec.kind == "list" and value is not None else [value]
        for item in items:
            problem = range_problem(spec, item)
            if problem:
                shown = list(value) if spec.kind == "list" else value
                raise ConfigError(f"invalid {spec.key} '{shown}'; {problem}")


def read_deepspeed_config(path: str) -> Dict:
    """The user's DeepSpeed JSON (hardware.deepspeed_config) as a dict; ConfigError naming
    the file and what is wrong with it."""
    where = f"hardware.deepspeed_config '{path}'"
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"hardware.deepspeed_config: no such file '{path}'") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{where} is not UTF-8 text; it must be a DeepSpeed JSON config") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where} is not valid JSON: {exc.msg} at line {exc.lineno} column "
                          f"{exc.colno}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {where}: {exc.strerror or exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must hold a JSON object ({{\"key\": value, ...}}), "
                          f"got a {type(data).__name__}")
    return data


def _check_cuda(hw: DictConfig) -> None:
    if hw.device != "cuda":
        return
    import torch  # only to ask for a GPU: validation of a CPU config imports no torch

    if not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else "no GPU is visible"
        raise ConfigError(f"hardware.device=cuda (hardware={hw.name}) needs a CUDA GPU, and {why}; "
                          "use hardware=cpu (or hardware.device=cpu)")


def _check_hardware(cfg: DictConfig) -> None:
    _choice(cfg, "hardware.device", ["cpu", "cuda"])
    _choice(cfg, "hardware.precision", ["fp32", "bf16"])
    _choice(cfg, "hardware.zero_stage", [0, 1, 2, 3])
    hw = cfg.hardware
    if cfg.trainer.prompts_per_step % hw.num_processes:
        raise ConfigError(f"hardware.num_processes={hw.num_processes} must be >= 1 and divide "
                          f"trainer.prompts_per_step={cfg.trainer.prompts_per_step} (each rank "
                          "samples whole prompt groups)")
    if hw.deepspeed_config is not None:
        read_deepspeed_config(hw.deepspeed_config)
    _check_cuda(hw)
    if cfg.trainer.compile and hw.backend != "torch":
        raise ConfigError("trainer.compile=true needs hardware.backend=torch (DeepSpeed wraps the "
                          f"model in its own engine; got hardware.backend={hw.backend})")
    if cfg.trainer.async_rollout.enabled and hw.num_processes > 1:
        raise ConfigError("trainer.async_rollout.enabled=true runs one learner process; it needs "
                          f"hardware.num_processes=1 (got {hw.num_processes})")


def _check_algo(cfg: DictConfig) -> None:
    _choice(cfg, "algo.kl.placement", ["in_loss", "in_reward"])
    _choice(cfg, "algo.critic", ["none", "shared", "separate"])
    _choice(cfg, "algo.baseline", ["none", "batch_mean"])
    a = cfg.algo
    if a.kl.target is not None and a.kl.coef <= 0:
        raise ConfigError("an adaptive KL (algo.kl.target) needs algo.kl.coef > 0 and a target > 0")
    n = cfg.trainer.prompts_per_step * a.group_size
    if n % a.minibatches and not a.dynamic_sampling:
        raise ConfigError(f"algo.minibatches={a.minibatches} must divide the "
                          f"{n} sequences per step (trainer.prompts_per_step * algo.group_size)")
    if a.dynamic_sampling and a.minibatches > a.group_size:   # a rank keeps >= 1 group
        raise ConfigError(f"algo.minibatches={a.minibatches} with algo.dynamic_sampling=true must be "
                          f"<= algo.group_size={a.group_size} (a step may keep a single group)")


def _check_eval(cfg: DictConfig) -> None:
    if cfg.task.get("num_eval") == 0 and cfg.trainer.eval_every > 0:
        raise ConfigError("task.num_eval=0 leaves no held-out set to evaluate every "
                          f"trainer.eval_every={cfg.trainer.eval_every} steps; set "
                          "trainer.eval_every=0 (no evaluation) or task.num_eval >= 1")


def validate(cfg: DictConfig) -> None:
    """Checks beyond types that need no torch: ranges (every numeric key), options that
    must agree, and the machine (CUDA, the DeepSpeed JSON). Raises ConfigError (one line).
    Registry names (algo.advantage, algo.policy_loss, algo.kl.estimator, task.name, ...)
    are checked where the registries are, by ``rlctl.run.entries.check_entries``,
    before a run directory is made."""
    _check_resolved(cfg)
    check_ranges(cfg)
    _check_algo(cfg)
    _check_eval(cfg)
    _choice(cfg, "model.dtype", ["float32", "bfloat16"])
    _choice(cfg, "logger.wandb_mode", ["offline", "online", "disabled"])
    if cfg.model.name == "hf" and not cfg.model.name_or_path:
        raise ConfigError("model=hf needs model.name_or_path=PATH_OR_HUB_ID")
    _check_hardware(cfg)
