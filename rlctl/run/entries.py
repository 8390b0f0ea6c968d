"""The registry entries a config names, checked at the engine boundary.

``rlctl.compose.validate`` checks what needs no torch (types, ranges, options that must
agree). The names that pick registry entries (``algo.advantage``, ``algo.policy_loss``,
``algo.kl.estimator``, ``algo.loss_agg_mode``, ``task.name``, ``hardware.backend``) are
looked up here, in the registries themselves, before a run directory is made: so a
user entry given by import path (``algo.policy_loss=mypkg.losses:my_loss``) is imported
once, early, and a bad name or path fails in one line (``ConfigError``, exit 2).
Whether the advantage estimator needs a critic is asked of its entry (``level``).
"""
from __future__ import annotations

from typing import Callable, Tuple

from omegaconf import DictConfig, OmegaConf

from rlctl.backends import BACKENDS
from rlctl.core import (ADVANTAGE_ESTIMATORS, POLICY_LOSSES, resolve_agg_mode,
                        resolve_kl_estimator)
from rlctl.errors import ConfigError
from rlctl.tasks import TASKS


def _lookups(cfg: DictConfig) -> Tuple[Tuple[str, Callable], ...]:
    placement = cfg.algo.kl.placement
    return (("algo.advantage", ADVANTAGE_ESTIMATORS.entry),
            ("algo.policy_loss", POLICY_LOSSES.entry),
            ("algo.loss_agg_mode", resolve_agg_mode),
            ("algo.kl.estimator", lambda kind: resolve_kl_estimator(kind, placement)),
            ("task.name", TASKS.entry),
            ("hardware.backend", BACKENDS.entry))


def check_entries(cfg: DictConfig) -> None:
    """Every registry name in ``cfg`` resolves, and the advantage estimator's level
    agrees with ``algo.critic``. Raises ConfigError (one line naming the key)."""
    for key, lookup in _lookups(cfg):
        try:
            lookup(OmegaConf.select(cfg, key))
        except ValueError as exc:
            raise ConfigError(f"invalid {key}: {' '.join(str(exc).split())}") from None
    a = cfg.algo
    token_level = ADVANTAGE_ESTIMATORS.entry(a.advantage).level == "token"
    if token_level and a.critic == "none":
        raise ConfigError(f"algo.advantage={a.advantage} needs a critic; set algo.critic=shared or separate")
    if not token_level and a.critic != "none":
        raise ConfigError(f"algo.critic={a.critic} trains a value model that algo.advantage="
                          f"{a.advantage} does not use; set algo.critic=none or algo.advantage=gae")
