"""The checks of a training config that need the registries or the built task, run before a
run directory is made; failures are one ``ConfigError`` line (exit 2)."""
from __future__ import annotations

import sys
from typing import Optional

import torch

from rlctl.dist import BACKENDS
from rlctl.core import (ADVANTAGE_ESTIMATORS, KL_PLACEMENT_NOTES, POLICY_LOSSES, resolve_agg_mode,
                        resolve_kl_estimator)
from rlctl.core import PREFERENCE_LOSSES
from rlctl.envs.environment import is_episodic
from rlctl.errors import ConfigError
from rlctl.tasks import TASKS
from rlctl.train.update import needs_reference, preference_loss


def check_entries(algo, task_name, backend) -> None:
    """Every registry name of ``algo``, ``task_name`` and ``backend`` resolves (user entries
    are imported here) and the advantage's level agrees with ``algo.critic``."""
    lookups = (("algo.advantage", algo.advantage, ADVANTAGE_ESTIMATORS.entry),
               ("algo.policy_loss", algo.policy_loss, POLICY_LOSSES.entry),
               ("algo.loss_agg_mode", algo.loss_agg_mode, resolve_agg_mode),
               ("algo.kl.estimator", algo.kl.estimator,
                lambda kind: resolve_kl_estimator(kind, algo.kl.placement)),
               ("task.name", task_name, TASKS.entry), ("hardware.backend", backend, BACKENDS.entry))
    if algo.get("loss_type") is not None:
        lookups += (("algo.loss_type", algo.loss_type, PREFERENCE_LOSSES.entry),)
    for key, name, lookup in lookups:
        try:
            lookup(name)
        except ValueError as exc:
            raise ConfigError(f"invalid {key}: {' '.join(str(exc).split())}") from None
    if algo.get("loss_type") is not None:
        _check_preference_loss(algo)
    advantage, critic = algo.advantage, algo.critic
    token_level = ADVANTAGE_ESTIMATORS.entry(advantage).level == "token"
    if token_level and critic == "none":
        raise ConfigError(f"algo.advantage={advantage} needs a critic; set algo.critic=shared or separate")
    if not token_level and critic != "none":
        raise ConfigError(f"algo.critic={critic} trains a value model that algo.advantage="
                          f"{advantage} does not use; set algo.critic=none or algo.advantage=gae")


def _check_preference_loss(algo) -> None:
    """``algo.loss_type`` on P=2 distinct pairs (reference as a run passes it) returns a [2]
    loss and two [2] rewards; a loss refuses the options it does not use (ValueError)."""
    args = torch.tensor([[-3.0, -5.0], [-4.0, -6.5], [-3.5, -5.5], [-4.2, -5.8], [3.0, 4.0], [4.0, 5.0]])
    ref = needs_reference(algo)                                        # [6, P=2]
    try:
        out = preference_loss(algo)(*(a if ref or i not in (2, 3) else None for i, a in enumerate(args)))
    except ValueError as exc:
        raise ConfigError(f"invalid algo.loss_type={algo.loss_type} options: {exc}") from None
    if not (isinstance(out, (tuple, list)) and len(out) == 3
            and all(isinstance(t, torch.Tensor) and t.shape == (2,) for t in out)):
        raise ConfigError(f"algo.loss_type={algo.loss_type} must return (loss, reward_chosen, "
                          "reward_rejected), each [P] for P pairs; on 2 pairs it returned "
                          f"{_shapes(out)}")


def _shapes(out) -> str:
    """``out`` described by its tensors' shapes (else its type)."""
    items = out if isinstance(out, (tuple, list)) else (out,)
    return ", ".join(f"[{', '.join(map(str, t.shape))}]" if isinstance(t, torch.Tensor)
                     else type(t).__name__ for t in items)


def check_episodes(rollout, task) -> None:
    """A task played as episodes is sampled by the learner's own sampler, in full precision."""
    if not is_episodic(task):
        return
    if rollout.engine == "server":
        raise ConfigError("rollout.engine=server samples single-turn tasks; a task played as "
                          "episodes is played by the learner's own sampler (rollout.engine=torch)")
    if rollout.sample_dtype != "float32":
        raise ConfigError(f"rollout.sample_dtype={rollout.sample_dtype} applies to the "
                          "single-turn sampler; a task played as episodes samples in the "
                          "model's own precision (use rollout.sample_dtype=float32)")


def check_held_out(eval_every: int, task, ranks: int = 1) -> None:
    """Evaluation needs held-out rows (else every ``eval/*`` would read a measured-looking 0),
    at least one per rank (a rank with none would leave the others waiting)."""
    if eval_every <= 0:
        return
    name, n = getattr(task, 'name', type(task).__name__), len(task.eval_examples())
    if not n:
        raise ConfigError(f"task '{name}' has no held-out "
                          f"rows (its eval_examples() returned none) to evaluate every "
                          f"trainer.eval_every={eval_every} steps; set trainer.eval_every=0 "
                          "or give the task held-out rows")
    if n < ranks:
        raise ConfigError(f"task '{name}' has {n} held-out rows for hardware.num_processes={ranks} "
                          "ranks (each evaluates at least one); set task.num_eval >= "
                          f"{ranks} or trainer.eval_every=0")


def kl_placement_warning(algo) -> Optional[str]:
    """The warning for a KL estimator whose gradient follows no divergence where placed."""
    kl = algo.kl
    if not kl.coef > 0:
        return None
    kind = resolve_kl_estimator(kl.estimator, kl.placement)
    note = KL_PLACEMENT_NOTES.get((kind, kl.placement))
    if note is None:
        return None
    return f"algo.kl.estimator={kind} with algo.kl.placement={kl.placement}: {note}"


def group_size_warning(algo) -> Optional[str]:
    """The warning for a group-relative advantage with ``algo.group_size=1`` (all 0)."""
    if algo.group_size != 1:
        return None
    try:
        entry = ADVANTAGE_ESTIMATORS.entry(algo.advantage)
    except ValueError:       # an unknown name is refused by check_entries, in one line
        return None
    if not entry.group:
        return None
    return (f"algo.group_size=1 with algo.advantage={algo.advantage}: a group-relative advantage "
            "compares a completion with the others of its group, so every advantage is 0 and "
            "the policy does not learn; use algo.group_size >= 2")


def warn_config(algo, stream=None) -> None:
    """Print each configuration warning as one line on stderr."""
    for message in (kl_placement_warning(algo), group_size_warning(algo)):
        if message is not None:
            print(f"rlctl: warning: {message}", file=stream or sys.stderr, flush=True)
