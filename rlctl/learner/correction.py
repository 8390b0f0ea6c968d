"""The rollout correction in the learner (``algo.rollout_correction``; the math is
``rlctl.core.rollout_correction``, docs/math.md section 14).

Three hooks, each one call: the Trainer's ``old_policy_inputs`` before the old-policy
forward (bypass off: every row's pi_old comes from the learner's forward, stale async
rows included, and the sampler's log-probs stay in ``engine_logprobs``; bypass on: the
sampler's log-probs are pi_old), the update's ``weighted`` on each micro-batch's
per-token policy loss, and the update's ``batch_metrics`` (``rollout_corr/*``) once per
rollout. Each takes the config's ``algo.rollout_correction`` section, None when the
correction is off; then all three leave everything as it was.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from rlctl.core.rollout_correction import correction_weights, mismatch_metrics
from rlctl.errors import UserError
from rlctl.schema import RolloutCorrectionConfig
from rlctl.types import RolloutBatch


def old_policy_inputs(batch: RolloutBatch, corr: Optional[RolloutCorrectionConfig]) -> RolloutBatch:
    """The batch as the old-policy forward should see it: unchanged with the correction
    off; bypass: pi_old := pi_engine in every row; otherwise no old log-probs, so the
    learner computes pi_old for every row (``needs_old_forward`` is true then)."""
    if corr is None:
        return batch
    if batch.engine_logprobs is None:
        raise UserError("algo.rollout_correction.enabled=true needs the sampler's log-probs, "
                        "and this rollout source recorded none (engine_logprobs)")
    old = batch.engine_logprobs if corr.bypass else None
    return batch.replace(old_logprobs=old, behaviour_rows=None)


def weighted(loss_mat: torch.Tensor, mb: RolloutBatch, corr: Optional[RolloutCorrectionConfig]) -> torch.Tensor:
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


def batch_metrics(batch: RolloutBatch, corr: Optional[RolloutCorrectionConfig]) -> Dict[str, torch.Tensor]:
    """``rollout_corr/*`` over the rollout's counted tokens (none when off or in bypass:
    there is no learner pi_old to compare with)."""
    if corr is None or corr.bypass or batch.engine_logprobs is None or batch.old_logprobs is None:
        return {}
    m = mismatch_metrics(batch.old_logprobs, batch.engine_logprobs, batch.mask, corr.level,
                         corr.mode, corr.upper, corr.lower)
    return {f"rollout_corr/{k}": v for k, v in m.items()}
