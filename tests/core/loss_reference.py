"""Aggregated losses the core tests compare against: a per-token loss of rlctl.core.losses
through `aggregate`, as the learner composes them (rlctl/train/update.py)."""
from typing import Optional

from rlctl.core.losses import (aggregate, ppo_clip_per_token, value_loss_per_token,
                               vanilla_pg_per_token)


def ppo_clip_loss(logp, old_logp, advantages, mask, clip_low: float = 0.2,
                  clip_high: float = 0.2, agg_mode: str = "token-mean",
                  norm_len: int | None = None, clip_ratio_c: Optional[float] = None):
    """Aggregated PPO clipped loss (optionally dual-clipped) -> (scalar loss, metrics)."""
    loss_mat, metrics = ppo_clip_per_token(logp, old_logp, advantages, mask, clip_low,
                                           clip_high, clip_ratio_c)
    return aggregate(loss_mat, mask, agg_mode, norm_len), metrics


def vanilla_pg_loss(logp, old_logp, advantages, mask, agg_mode: str = "token-mean",
                    norm_len: int | None = None):
    """Aggregated REINFORCE loss -> (scalar loss, metrics)."""
    loss_mat, metrics = vanilla_pg_per_token(logp, old_logp, advantages, mask)
    return aggregate(loss_mat, mask, agg_mode, norm_len), metrics


def value_loss(values, old_values, returns, mask, clip: float | None = None,
               agg_mode: str = "token-mean", norm_len: int | None = None):
    """Aggregated value loss -> (scalar loss, {"value/clip_frac"})."""
    loss_mat, metrics = value_loss_per_token(values, old_values, returns, mask, clip)
    return aggregate(loss_mat, mask, agg_mode, norm_len), metrics
