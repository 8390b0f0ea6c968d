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

from dataclasses import dataclass
from typing import Any, Callable, Tuple

from omegaconf import OmegaConf

from rlctl.backends import BACKENDS
from rlctl.core import (ADVANTAGE_ESTIMATORS, POLICY_LOSSES, resolve_agg_mode,
                        resolve_kl_estimator)
from rlctl.errors import ConfigError
from rlctl.tasks import TASKS


@dataclass(frozen=True)
class EntryNames:
    """The names a config picks registry entries by (a built-in name or a user entry's
    import path; None where the config leaves one unset), and the two keys the checks
    also read."""
    advantage: Any                  # algo.advantage
    policy_loss: Any                # algo.policy_loss
    loss_agg_mode: Any              # algo.loss_agg_mode
    kl_estimator: Any               # algo.kl.estimator (None: the placement's default)
    task: Any                       # task.name
    backend: Any                    # hardware.backend
    kl_placement: str               # algo.kl.placement
    critic: str                     # algo.critic

    @classmethod
    def from_config(cls, cfg) -> "EntryNames":
        """From the composed config (resolved or not: interpolations resolve here)."""
        def name(key):
            return OmegaConf.select(cfg, key)         # None where the config has no value
        return cls(advantage=name("algo.advantage"), policy_loss=name("algo.policy_loss"),
                   loss_agg_mode=name("algo.loss_agg_mode"), kl_estimator=name("algo.kl.estimator"),
                   task=name("task.name"), backend=name("hardware.backend"),
                   kl_placement=cfg.algo.kl.placement, critic=cfg.algo.critic)


def _lookups(e: EntryNames) -> Tuple[Tuple[str, Any, Callable], ...]:
    """(key, name, registry lookup), in the order they are checked."""
    return (("algo.advantage", e.advantage, ADVANTAGE_ESTIMATORS.entry),
            ("algo.policy_loss", e.policy_loss, POLICY_LOSSES.entry),
            ("algo.loss_agg_mode", e.loss_agg_mode, resolve_agg_mode),
            ("algo.kl.estimator", e.kl_estimator,
             lambda kind: resolve_kl_estimator(kind, e.kl_placement)),
            ("task.name", e.task, TASKS.entry),
            ("hardware.backend", e.backend, BACKENDS.entry))


def check_entries(entries: EntryNames) -> None:
    """Every registry name in ``entries`` resolves, and the advantage estimator's level
    agrees with ``algo.critic``. Raises ConfigError (one line naming the key)."""
    for key, name, lookup in _lookups(entries):
        try:
            lookup(name)
        except ValueError as exc:
            raise ConfigError(f"invalid {key}: {' '.join(str(exc).split())}") from None
    advantage, critic = entries.advantage, entries.critic
    token_level = ADVANTAGE_ESTIMATORS.entry(advantage).level == "token"
    if token_level and critic == "none":
        raise ConfigError(f"algo.advantage={advantage} needs a critic; set algo.critic=shared or separate")
    if not token_level and critic != "none":
        raise ConfigError(f"algo.critic={critic} trains a value model that algo.advantage="
                          f"{advantage} does not use; set algo.critic=none or algo.advantage=gae")
