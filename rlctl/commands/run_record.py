"""A run directory read back for `rlctl inspect`: its config.yaml flattened to dotted
keys, its overrides.yaml, its metric rows (metrics.jsonl), and the defaults of the command
that made it (`rlctl train`, or `rlctl reward-model train`: rm.* keys), which the run's
config is compared with; its sample tables (samples.jsonl) for `rlctl inspect --samples`."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import yaml
from omegaconf import OmegaConf

from rlctl.commands.fmt import flatten
from rlctl.compose import compose
from rlctl.errors import UserError
from rlctl.reward_models.config import default_config as reward_model_defaults
from rlctl.sinks.jsonl import read_jsonl, read_samples


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
    rows, source = _load_metrics(path)
    return Run(path, flatten(config), rows, source, _load_overrides(path))


def _load_overrides(path: Path) -> Dict[str, Any]:
    """overrides.yaml ({overrides: [...], choices: {...}}); empty when absent or unreadable."""
    if not (path / "overrides.yaml").is_file():
        return {}
    try:
        return yaml.safe_load((path / "overrides.yaml").read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError):
        return {}


def _load_metrics(path: Path):
    if (path / "metrics.jsonl").is_file():
        try:
            return read_jsonl(path / "metrics.jsonl"), "metrics.jsonl"
        except ValueError as exc:       # not UTF-8: one line naming the file
            raise UserError(str(exc)) from None
    return [], None


def load_samples(path: Path) -> List[dict]:
    """The rows of ``path``/samples.jsonl ({"table", "step", columns...}, as written);
    one-line errors when the run has none."""
    file = path / "samples.jsonl"
    if not file.is_file():
        raise UserError(f"{path} has no samples.jsonl (a run writes one with logger.jsonl=true "
                        "and logger.samples.every > 0, from its first sample table)")
    try:
        rows = read_samples(file)
    except ValueError as exc:       # not UTF-8: one line naming the file
        raise UserError(str(exc)) from None
    if not rows:
        raise UserError(f"{file} holds no sample rows")
    for i, row in enumerate(rows, 1):
        _check_sample_row(file, i, row)
    return rows


# what a row needs to be shown and audited (the producer writes them all)
SAMPLE_NUMBERS = {"train": ("step", "reward", "length"), "eval": ("step",)}


def _check_sample_row(file: Path, i: int, row: dict) -> None:
    need = SAMPLE_NUMBERS.get(row.get("table"))
    if need is None:
        raise UserError(f"{file}: row {i} has table {row.get('table')!r}; valid: "
                        f"{', '.join(SAMPLE_NUMBERS)}")
    bad = [k for k in need if isinstance(row.get(k), bool)
           or not isinstance(row.get(k), (int, float))]
    if bad:
        raise UserError(f"{file}: row {i} ({row['table']}) needs numbers in {', '.join(bad)} "
                        f"(required: {', '.join(need)})")


def default_config(reward_model: bool = False) -> Dict[str, Any]:
    """The flattened config of a run with no overrides: `rlctl train`'s, or with
    ``reward_model`` `rlctl reward-model train`'s (its sections and rm.*, data.* unset)."""
    if reward_model:
        return flatten(dict(reward_model_defaults(), data={"prefs": None, "eval": None}))
    cfg = compose([]).cfg
    return flatten(OmegaConf.to_container(cfg, resolve=True))
