"""The configuration of `rlctl reward-model train`: the fit's ``rm.*`` knobs (typed by
``RMConfig``, defaults in rlctl/conf/reward_model.yaml) and the sections composed as for
`rlctl train` (``SECTIONS``). No torch here: `rlctl inspect` reads a reward-model run's
defaults from this module (``default_config``)."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import yaml
from omegaconf import OmegaConf

from rlctl.compose import CONF_DIR, compose
from rlctl.config import AT_LEAST_1, NON_NEGATIVE, POSITIVE, Range
from rlctl.errors import ConfigError, UserError

SECTIONS = ("model", "hardware", "logger", "seed", "run")   # composed like `rlctl train`


@dataclass
class RMConfig:
    lr: float = 1e-4
    weight_decay: float = 0.0
    steps: int = 200
    batch_size: int = 16
    margin: float = 0.0
    center_coef: float = 0.01
    max_grad_norm: float = 1.0
    eval_frac: float = 0.1
    eval_every: int = 50
    eval_batch_size: int = 64
    max_length: Optional[int] = None


RM_RANGES = {"lr": POSITIVE, "weight_decay": NON_NEGATIVE, "steps": AT_LEAST_1,
             "batch_size": AT_LEAST_1, "margin": Range(), "center_coef": NON_NEGATIVE,
             "max_grad_norm": Range(0, why="0: no clipping"),
             "eval_frac": Range(0, 1, lo_open=True, hi_open=True),
             "eval_every": Range(0, why="0: only at the end"), "eval_batch_size": AT_LEAST_1,
             "max_length": AT_LEAST_1}


def rm_config(overrides: Sequence[str]) -> RMConfig:
    """conf/reward_model.yaml with ``rm.KEY=VALUE`` overrides, typed and range-checked."""
    base = OmegaConf.merge(OmegaConf.structured(RMConfig),
                           OmegaConf.load(CONF_DIR / "reward_model.yaml"))
    for o in overrides:
        key, eq, value = o.partition("=")
        leaf = key[len("rm."):]
        if not eq or leaf not in RM_RANGES:
            raise ConfigError(f"unknown reward-model key '{key}'; valid: "
                              f"{', '.join('rm.' + k for k in RM_RANGES)}")
        try:
            base[leaf] = yaml.safe_load(value)
        except Exception:  # noqa: BLE001 - OmegaConf's type errors
            kind = type(getattr(RMConfig(), leaf, 0.0) or 0.0).__name__
            raise ConfigError(f"invalid value '{value}' for '{key}': expected "
                              f"{'an integer' if kind == 'int' else 'a float'}") from None
    cfg = RMConfig(**OmegaConf.to_container(base))
    for leaf, rng in RM_RANGES.items():
        v = getattr(cfg, leaf)
        if v is not None and (not math.isfinite(v) or not rng.contains(v)):
            what = f"{rng.describe()} and finite" if rng.lo is not None else "finite"
            why = f"; {rng.why}" if rng.why else ""
            raise ConfigError(f"invalid rm.{leaf} '{v}'; must be {what}{why}")
    return cfg


def split_overrides(overrides: Sequence[str]) -> Tuple[List[str], List[str]]:
    """(the composed sections' overrides, the rm.* ones); other sections are refused."""
    bad = [o for o in overrides if o.startswith("--")]
    if bad:
        raise UserError(f"unknown option '{bad[0]}'; options: --eval PREFS, --debug, --help")
    base, rm = [], []
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if key.startswith("rm.") or key == "rm":
            rm.append(o)
        elif key.split(".")[0] in SECTIONS:
            base.append(o)
        else:
            raise ConfigError(f"rlctl reward-model train takes overrides of "
                              f"{', '.join(SECTIONS)} and rm.* (e.g. rm.lr=1e-4); got '{o}'")
    return base, rm


def resolved_sections(cfg) -> Dict[str, Any]:
    """The composed sections of a reward-model run's config.yaml, resolved."""
    return {k: OmegaConf.to_container(cfg[k], resolve=True) if k != "seed" else cfg.seed
            for k in SECTIONS}


def default_config() -> Dict[str, Any]:
    """What a reward-model run's config.yaml holds with no overrides (less ``data``, the
    preference files)."""
    return dict(resolved_sections(compose([]).cfg), rm=asdict(rm_config([])))
