"""Warnings about configurations that run but do not optimise what they seem to.

A group-relative advantage (an estimator registered with ``group=True``: GRPO, Dr. GRPO,
RLOO) compares each completion with the others of its prompt, so with
``algo.group_size=1`` every advantage is 0 and the policy gradient vanishes.

A KL estimator's gradient follows a KL divergence in one placement and not in the other
(rlctl/core/kl.py has the table, checked by exact enumeration): k1 in the loss has zero
expected gradient, k2 and k3 in the reward give a biased gradient. Training goes on;
``rlctl train`` prints one line on stderr.
"""
from __future__ import annotations

import sys
from typing import Optional

from rlctl.core import ADVANTAGE_ESTIMATORS, KL_PLACEMENT_NOTES, resolve_kl_estimator


def kl_placement_warning(algo) -> Optional[str]:
    """The warning for ``algo.kl`` (a config node with coef, estimator, placement), or
    None when the pair follows a KL divergence or no KL term is used (coef 0)."""
    kl = algo.kl
    if not kl.coef > 0:
        return None
    kind = resolve_kl_estimator(kl.estimator, kl.placement)
    note = KL_PLACEMENT_NOTES.get((kind, kl.placement))
    if note is None:
        return None
    return f"algo.kl.estimator={kind} with algo.kl.placement={kl.placement}: {note}"


def group_size_warning(algo) -> Optional[str]:
    """The warning for a group-relative advantage estimator with ``algo.group_size=1``
    (the registry entry says whether it is one), or None."""
    if algo.group_size != 1:
        return None
    try:
        entry = ADVANTAGE_ESTIMATORS.entry(algo.advantage)
    except ValueError:       # an unknown name is refused elsewhere, in one line
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
