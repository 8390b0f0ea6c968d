"""`rlctl reward-model train`'s config: the ``rm.*`` knobs (``RMConfig``) and the ``SECTIONS``
composed as for `rlctl train`. No torch: `rlctl inspect` reads ``default_config``."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Dict, List, Optional, Sequence, Tuple

import yaml
from omegaconf import OmegaConf

from rlctl.config.compose import compose
from rlctl.errors import ConfigError, UserError
from rlctl.config.schema import AT_LEAST_1, NON_NEGATIVE, POSITIVE, Range, knob

SECTIONS = ("model", "hardware", "logger", "seed", "run")   # composed like `rlctl train`


@dataclass
class RMConfig:
    lr: float = knob(1e-4, range=POSITIVE)  # AdamW learning rate
    weight_decay: float = knob(0.0, range=NON_NEGATIVE)
    steps: int = knob(200, range=AT_LEAST_1)  # optimizer steps (batches of pairs)
    batch_size: int = knob(16, range=AT_LEAST_1)  # pairs per step (2x sequences per forward)
    # m in -log sigmoid(r_c - r_r - m); a `margin` column overrides it per pair
    margin: float = knob(0.0, range=Range())
    # c * (r_c + r_r)^2 keeps scores centred (Eisenstein et al., 2023)
    center_coef: float = knob(0.01, range=NON_NEGATIVE)
    max_grad_norm: float = knob(1.0, range=Range(0, why="0: no clipping"))
    # without --eval: this seeded share of the pairs is held out
    eval_frac: float = knob(0.1, range=Range(0, 1, lo_open=True, hi_open=True))
    # steps between held-out evaluations (0: only at the end)
    eval_every: int = knob(50, range=Range(0, why="0: only at the end"))
    eval_batch_size: int = knob(64, range=AT_LEAST_1)  # pairs per held-out forward
    # Tokens per prompt + completion. A longer text keeps its last max_length tokens (a leading
    # BOS stays first): the end of the completion, where the score is read. Saved with the model
    # (the tokenizer's model_max_length), so runs and `reward-model eval` score with the same
    # limit. null: the model's context (the tokenizer's model_max_length, at most its positions).
    max_length: Optional[int] = knob(None, range=AT_LEAST_1)


def rm_config(overrides: Sequence[str]) -> RMConfig:
    """``RMConfig`` with ``rm.KEY=VALUE`` overrides, typed and range-checked."""
    base = OmegaConf.structured(RMConfig)
    ranges = {f.name: f.metadata["range"] for f in fields(RMConfig)}
    for o in overrides:
        key, eq, value = o.partition("=")
        leaf = key[len("rm."):]
        if not eq or leaf not in ranges:
            raise ConfigError(f"unknown reward-model key '{key}'; valid: "
                              f"{', '.join('rm.' + k for k in ranges)}")
        try:
            base[leaf] = yaml.safe_load(value)
        except Exception:  # noqa: BLE001 - OmegaConf's type errors
            kind = type(getattr(RMConfig(), leaf, 0.0) or 0.0).__name__
            raise ConfigError(f"invalid value '{value}' for '{key}': expected "
                              f"{'an integer' if kind == 'int' else 'a float'}") from None
    cfg = RMConfig(**OmegaConf.to_container(base))
    for leaf, rng in ranges.items():
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


def default_config() -> Dict[str, Any]:
    """A reward-model run's config.yaml with no overrides (less ``data``)."""
    resolved = OmegaConf.to_container(compose([]).cfg, resolve=True)
    return dict({k: resolved[k] for k in SECTIONS}, rm=asdict(rm_config([])))
