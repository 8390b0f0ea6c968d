"""Compose the run config from ``rlctl/conf`` + a recipe + shell overrides with Hydra,
then validate it (``rlctl.config.validate``).

Every failure here is a ``ConfigError`` whose message is one line naming the key and
what is valid; the CLI prints it and exits with code 2.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, open_dict

from rlctl.compose_errors import explain
from rlctl.config import validate
from rlctl.errors import ConfigError
from rlctl.overrides import rename_deprecated
from rlctl.recipes import load_recipe
from rlctl.schema import CONF_DIR, GROUPS, register_schemas

RECIPE_GROUP = "recipe"


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
    choices: Dict[str, Any]      # group -> chosen option, e.g. {"algo": "grpo"}, or a list
                                 # of them merged in order (logger=[jsonl,wandb])
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
        raise ConfigError(explain(exc, overrides)) from None
    finally:
        GlobalHydra.instance().clear()
    ran = cfg.hydra.runtime.choices
    choices = {g: str(ran[g]) if g in ran else _list_choice(g, given, loaded) for g in GROUPS}
    with open_dict(cfg):
        for key in ("hydra", "defaults"):
            cfg.pop(key, None)
    validate(cfg, given, choices["algo"])
    return Composed(cfg=cfg, choices=choices, overrides=given, recipe=recipe)


def _list_choice(group: str, overrides: Sequence[str], recipe: Optional[Dict]) -> List[str]:
    """The options of a group given as a list (logger=[jsonl,wandb]), for which Hydra records
    no choice: the shell's last list for it, else the recipe's defaults entry."""
    for o in reversed(OverridesParser.create().parse_overrides(list(overrides))):
        if o.key_or_group == group and isinstance(o.value(), list):
            return [str(v) for v in o.value()]
    for item in (recipe or {}).get("defaults", []) or []:
        for key, value in (item.items() if isinstance(item, dict) else []):
            if key.replace("override", "").strip().lstrip("/") == group and isinstance(value, list):
                return [str(v) for v in value]
    return []
