"""A run directory read back for `rlctl inspect`: config.yaml flattened to dotted keys,
overrides.yaml, the metric rows of metrics.jsonl, and the defaults of the command that
made it (`rlctl train`, or `rlctl reward-model train`: rm.* keys) to compare it with."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

import yaml
from omegaconf import OmegaConf

from rlctl.compose import compose
from rlctl.errors import UserError
from rlctl.reward_models.config import default_config as reward_model_defaults
from rlctl.sinks.jsonl import read_jsonl


def flatten(tree: Any, prefix: str = "") -> Dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists stay values."""
    if not isinstance(tree, Mapping):
        return {prefix: tree} if prefix else {}
    out: Dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, name))
        else:
            out[name] = value
    return out


@dataclass
class Run:
    path: Path
    config: Dict[str, Any]                 # flattened dotted keys
    rows: List[dict]                       # metric rows with a "step"
    metrics_source: Optional[str]
    overrides: Dict[str, Any] = field(default_factory=dict)

    @property
    def reward_model(self) -> bool:
        """A run of `rlctl reward-model train` (its own config: rm.*, data.*)."""
        return any(k.startswith("rm.") for k in self.config)


def load_run(path: Path) -> Run:
    try:
        config = yaml.safe_load((path / "config.yaml").read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read {path}/config.yaml: {' '.join(str(exc).split())[:200]}") \
            from None
    if not isinstance(config, dict):
        raise UserError(f"{path}/config.yaml is not a mapping of config keys")
    rows, source, overrides = [], None, {}
    if (path / "metrics.jsonl").is_file():
        try:
            rows, source = read_jsonl(path / "metrics.jsonl"), "metrics.jsonl"
        except ValueError as exc:       # not UTF-8: one line naming the file
            raise UserError(str(exc)) from None
    if (path / "overrides.yaml").is_file():     # {overrides: [...], choices: {...}}
        try:
            overrides = yaml.safe_load((path / "overrides.yaml").read_text(encoding="utf-8")) or {}
        except (yaml.YAMLError, UnicodeDecodeError):
            pass                                # unreadable: none
    return Run(path, flatten(config), rows, source, overrides)


def default_config(reward_model: bool = False) -> Dict[str, Any]:
    """The flattened config of a run with no overrides: `rlctl train`'s, or with
    ``reward_model`` `rlctl reward-model train`'s (its sections and rm.*, data.* unset)."""
    if reward_model:
        return flatten(dict(reward_model_defaults(), data={"prefs": None, "eval": None}))
    cfg = compose([]).cfg
    return flatten(OmegaConf.to_container(cfg, resolve=True))
