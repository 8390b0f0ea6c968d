"""The rollout correction in the learner (``algo.rollout_correction``; math in
``rlctl.core.rollout_correction``, docs/math.md section 14). Three hooks:
``old_policy_inputs`` before the old-policy forward (bypass: the sampler's log-probs are
pi_old; otherwise the learner computes pi_old for every row and keeps the sampler's in
``engine_logprobs``), ``weighted`` on each micro-batch's policy loss and
``batch_metrics`` (``rollout_corr/*``) once per rollout. Off (None): no change."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch

from rlctl.core.rollout_correction import correction_weights, mismatch_metrics
from rlctl.errors import UserError
from rlctl.types import RolloutBatch


@dataclass(frozen=True)
class RolloutCorrection:
    """``algo.rollout_correction`` when enabled."""
    level: str = "token"       # token | sequence
    mode: str = "truncate"     # truncate | mask | measure
    upper: float = 2.0
    lower: float = 0.5
    bypass: bool = False

    @classmethod
    def from_config(cls, algo) -> Optional["RolloutCorrection"]:
        """None when the correction is off (or the section absent)."""
        rc = algo.get("rollout_correction")
        if rc is None or not rc.enabled:
            return None
        return cls(level=rc.level, mode=rc.mode, upper=float(rc.upper), lower=float(rc.lower),
                   bypass=bool(rc.bypass))


def old_policy_inputs(batch: RolloutBatch, corr: Optional[RolloutCorrection]) -> RolloutBatch:
    """The batch for the old-policy forward: unchanged when off; bypass: pi_old := pi_engine;
    otherwise no old log-probs (``needs_old_forward`` is true)."""
    if corr is None:
        return batch
    if batch.engine_logprobs is None:
        raise UserError("algo.rollout_correction.enabled=true needs the sampler's log-probs, "
                        "and this rollout source recorded none (engine_logprobs)")
    old = batch.engine_logprobs if corr.bypass else None
    return batch.replace(old_logprobs=old, behaviour_rows=None)


def weighted(loss_mat: torch.Tensor, mb: RolloutBatch, corr: Optional[RolloutCorrection]) -> torch.Tensor:
    """The per-token policy loss [n, T] times the correction weight (unchanged when off or
    in bypass, where the weight is 1)."""
    if corr is None or corr.bypass:
        return loss_mat
    if mb.engine_logprobs is None or mb.old_logprobs is None:
        raise UserError("algo.rollout_correction needs both the sampler's log-probs and the "
                        "learner's old ones in the batch (engine_logprobs, old_logprobs)")
    w = correction_weights(mb.old_logprobs, mb.engine_logprobs, mb.mask, corr.level, corr.mode,
                           corr.upper, corr.lower)                                # [n, T]
    return loss_mat * w.to(loss_mat.dtype)


def batch_metrics(batch: RolloutBatch, corr: Optional[RolloutCorrection]) -> Dict[str, torch.Tensor]:
    """``rollout_corr/*`` over the rollout's counted tokens (none when off or in bypass:
    there is no learner pi_old to compare with)."""
    if corr is None or corr.bypass or batch.engine_logprobs is None or batch.old_logprobs is None:
        return {}
    m = mismatch_metrics(batch.old_logprobs, batch.engine_logprobs, batch.mask, corr.level,
                         corr.mode, corr.upper, corr.lower)
    return {f"rollout_corr/{k}": v for k, v in m.items()}
