"""Extra loss terms added to the policy loss, each with its coefficient.

A term is fn(logp [N, T], entropy [N, T], mask [N, T]) -> [N, T], aggregated like the
policy loss (``algo.loss_agg_mode``), times its coefficient, added to the loss.
``entropy`` is that of the learner's temperature-scaled distribution, with its graph.
Registered with ``@register_loss_term(name)``; the config key ``algo.<name>_coef`` names
the term. ``entropy``: the entropy bonus of A3C (Mnih et al., 2016) and PPO (Schulman et
al., 2017, eq. 9), matrix -entropy."""
from __future__ import annotations

from typing import Callable, List, Mapping, Tuple

import torch

from rlctl.registry import Registry

__all__ = ["LOSS_TERMS", "register_loss_term", "entropy_bonus", "active_terms"]

LOSS_TERMS = Registry("loss term")
register_loss_term = LOSS_TERMS.register


@register_loss_term("entropy")
def entropy_bonus(logp: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """-entropy per token ([N, T] -> [N, T]); masked positions are dropped by the aggregation."""
    return -entropy


def active_terms(coefs: Mapping[str, float]) -> List[Tuple[str, float, Callable]]:
    """(name, coef, fn) for each term with a non-zero coefficient, in name order."""
    return [(name, float(c), LOSS_TERMS.get(name)) for name, c in sorted(coefs.items()) if c]
