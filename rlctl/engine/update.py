"""The learner's update: epochs x minibatches of optimizer steps on one rollout.

Algorithm-free: the policy loss comes from the ``POLICY_LOSSES`` registry and the KL
term from ``kl_estimate``; this module never looks at an algorithm's name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from rlctl.core.aggregation import aggregate
from rlctl.core.kl import kl_estimate
from rlctl.core.logprobs import masked_mean
from rlctl.engine.policy import policy_logprobs
from rlctl.types import RolloutBatch


@dataclass
class UpdateSettings:
    """Constructor arguments taken from the ``algo`` and ``trainer`` config sections."""
    policy_loss: callable
    clip_low: float
    clip_high: float
    agg_mode: str
    norm_len: Optional[int]
    epochs: int
    minibatches: int
    kl_coef: float
    kl_estimator: str
    max_grad_norm: float
    temperature: float


def _minibatch_rows(n: int, minibatches: int, shuffle: bool) -> List[torch.Tensor]:
    order = torch.randperm(n) if shuffle else torch.arange(n)
    return list(order.chunk(minibatches))


def update_policy(model, optimizer, scheduler, batch: RolloutBatch, s: UpdateSettings
                  ) -> Dict[str, torch.Tensor]:
    """Run the optimizer steps for one rollout; returns detached metric tensors.

    ``batch.old_logprobs`` None means a single pass (1 epoch, 1 minibatch): the ratio is
    exactly 1 and the old log-probs are the current ones, detached; no extra forward.
    """
    model.train()
    device = batch.input_ids.device
    records: Dict[str, List[torch.Tensor]] = {}
    multi_pass = s.epochs * s.minibatches > 1
    for _ in range(s.epochs):
        for rows in _minibatch_rows(batch.num_sequences, s.minibatches, shuffle=multi_pass):
            mb = batch.select(rows.to(device))
            logp, entropy = policy_logprobs(model, mb.input_ids, mb.attention_mask,
                                            mb.prompt_len, s.temperature, with_entropy=True)
            old = mb.old_logprobs if mb.old_logprobs is not None else logp.detach()
            loss_mat, metrics = s.policy_loss(logp, old, mb.advantages, mb.mask,
                                              s.clip_low, s.clip_high)          # [n, T]
            pg_loss = aggregate(loss_mat, mb.mask, s.agg_mode, s.norm_len)
            loss = pg_loss
            if s.kl_coef > 0:
                kl_mat = kl_estimate(logp, mb.ref_logprobs, s.kl_estimator)     # [n, T]
                loss = loss + s.kl_coef * aggregate(kl_mat, mb.mask, s.agg_mode, s.norm_len)
                metrics["kl_ref"] = masked_mean(kl_mat.detach(), mb.mask)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(
                model.parameters(), s.max_grad_norm if s.max_grad_norm > 0 else float("inf"))
            optimizer.step()
            scheduler.step()
            metrics.update(loss=pg_loss.detach(), entropy=masked_mean(entropy, mb.mask),
                           grad_norm=grad_norm.detach())
            for k, v in metrics.items():
                records.setdefault(k, []).append(v.detach().float())
    return {k: torch.stack(v).mean() for k, v in records.items()}
