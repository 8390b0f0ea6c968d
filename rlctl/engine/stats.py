"""Rollout-side metrics in the schema every algorithm shares (reward/, advantage/, length/;
detached tensors; one sync at log time) and their reduction over data-parallel ranks."""
from __future__ import annotations

from typing import Dict

import torch

from rlctl.core.logprobs import masked_mean
from rlctl.types import RolloutBatch


def rollout_metrics(batch: RolloutBatch) -> Dict[str, torch.Tensor]:
    r = batch.rewards                                          # [N]
    groups = r.view(-1, batch.group_size)                      # [B, G]
    lengths = batch.mask.sum(-1)                               # [N]
    seq_adv = batch.advantages.sum(-1) / lengths.clamp(min=1)  # [N] (constant per row for outcome advantages)
    zero_std = (groups.max(-1).values == groups.min(-1).values).float()   # [B]
    return {
        "reward/mean": r.mean(),
        "reward/std": r.std() if r.numel() > 1 else torch.zeros(()),
        "reward/frac_zero_std_groups": zero_std.mean(),
        "advantage/mean": masked_mean(batch.advantages, batch.mask),
        "advantage/std": seq_adv.std() if seq_adv.numel() > 1 else torch.zeros(()),
        "length/mean": lengths.mean(),
        "length/min": lengths.min(),
        "length/max": lengths.max(),
        "length/truncated_frac": batch.truncated.float().mean(),
    }


POLICY_KEYS = {  # update_policy's metric names -> schema names
    "loss": "policy/loss", "entropy": "policy/entropy", "clip_frac": "policy/clip_frac",
    "clip_frac_low": "policy/clip_frac_low", "clip_frac_high": "policy/clip_frac_high",
    "clip_frac_dual": "policy/clip_frac_dual",
    "approx_kl": "policy/approx_kl", "kl_ref": "policy/kl_ref", "grad_norm": "optim/grad_norm",
}


# Summed over ranks: counts, and the loss terms (each rank's value is its share of the
# global batch's loss: its numerator over the normaliser summed over every rank).
SUMMED = {"perf/step_tokens", "perf/step_sequences", "policy/loss", "value/loss"}
REDUCE_OP = {"length/min": "min", "length/max": "max", "policy/ratio_max": "max"}


def reduce_metrics(metrics: Dict[str, torch.Tensor], backend) -> Dict[str, float]:
    """Floats averaged over data-parallel ranks (min/max/sum where the name says so);
    one host sync (and one collective per reduction kind) for the whole dict."""
    keys = sorted(metrics)
    x = torch.stack([torch.as_tensor(metrics[k], dtype=torch.float32).detach().cpu() for k in keys])
    if backend.world_size > 1:
        avg = backend.all_reduce(x, "sum") / backend.world_size
        lo, hi, total = backend.all_reduce(x, "min"), backend.all_reduce(x, "max"), avg * backend.world_size
        pick = {"min": lo, "max": hi}
        x = torch.stack([total[i] if k in SUMMED else pick.get(REDUCE_OP.get(k), avg)[i]
                         for i, k in enumerate(keys)])
    return dict(zip(keys, x.tolist()))
