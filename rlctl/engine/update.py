"""The learner's update: epochs x minibatches of optimizer steps on one rollout.

Algorithm-free: the policy loss comes from the ``POLICY_LOSSES`` registry, the KL term
from ``kl_estimate``, the value loss from ``value_loss_per_token``; this module never
looks at an algorithm's name.

Gradient accumulation over micro-batches is exact for every aggregation mode: each
micro-batch contributes ``aggregate_sum(...) / agg_denominator(minibatch mask)``, i.e.
its share of the numerator over the *minibatch's* denominator (token count, or count of
non-empty rows, times norm_len for seq-mean-token-sum-norm), so the summed gradient
equals the gradient of the minibatch aggregate (tests/engine/test_update.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, FrozenSet, List, Optional

import torch

from rlctl.core import agg_denominator, aggregate_sum, explained_variance, kl_estimate, masked_mean
from rlctl.core.losses import value_loss_per_token
from rlctl.engine.policy import learner_forward
from rlctl.types import RolloutBatch


@dataclass
class UpdateSettings:
    """Constructor arguments taken from the ``algo`` and ``trainer`` config sections."""
    policy_loss: Callable
    clip_low: float
    clip_high: float
    agg_mode: str
    norm_len: Optional[int]
    epochs: int
    minibatches: int
    kl_estimator: str
    kl_in_loss: bool
    max_grad_norm: float
    temperature: float
    clip_ratio_c: Optional[float] = None
    micro_batch_size: int = 0              # sequences per forward; 0: the whole minibatch
    vf_coef: float = 0.0
    value_clip: Optional[float] = None


@dataclass
class UpdateState:
    """Per-call inputs that change over training."""
    kl_coef: float = 0.0
    policy_frozen: bool = False            # critic warm-up: only critic-only params move
    critic_only: FrozenSet[int] = field(default_factory=frozenset)


def _chunks(rows: torch.Tensor, size: int) -> List[torch.Tensor]:
    return [rows] if size <= 0 or size >= rows.numel() else list(rows.split(size))


def accumulate_gradients(model, batch: RolloutBatch, s: UpdateSettings, st: UpdateState,
                         critic=None) -> Dict[str, torch.Tensor]:
    """Backward of one minibatch's loss, micro-batch by micro-batch; returns metrics
    (token-weighted means of detached tensors). Does not step or zero the optimizer."""
    denom = agg_denominator(batch.mask, s.agg_mode, s.norm_len)             # policy / KL terms
    vdenom = batch.mask.sum().clamp(min=1)                                  # value term: token-mean
    sums: Dict[str, torch.Tensor] = {}       # token-weighted metric sums
    exact: Dict[str, torch.Tensor] = {}      # loss terms: micro-batch shares add up exactly
    for rows in _chunks(torch.arange(batch.num_sequences, device=batch.mask.device),
                        s.micro_batch_size):
        mb = batch.select(rows)
        f = learner_forward(model, mb.input_ids, mb.attention_mask, mb.prompt_len,
                            s.temperature, with_entropy=True, critic=critic)
        old = mb.old_logprobs if mb.old_logprobs is not None else f.logp.detach()
        loss_mat, metrics = s.policy_loss(f.logp, old, mb.advantages, mb.mask,
                                          s.clip_low, s.clip_high, s.clip_ratio_c)   # [n, T]
        pg_loss = aggregate_sum(loss_mat, mb.mask, s.agg_mode, s.norm_len) / denom
        loss = pg_loss * (0.0 if st.policy_frozen else 1.0)
        if st.kl_coef > 0 and s.kl_in_loss:
            kl_mat = kl_estimate(f.logp, mb.ref_logprobs, s.kl_estimator)  # [n, T]
            loss = loss + st.kl_coef * aggregate_sum(kl_mat, mb.mask, s.agg_mode, s.norm_len) / denom
        if mb.ref_logprobs is not None:
            metrics["kl_ref"] = masked_mean(kl_estimate(f.logp.detach(), mb.ref_logprobs,
                                                        s.kl_estimator), mb.mask)
        if mb.returns is not None and f.values is not None:
            v_mat, v_metrics = value_loss_per_token(f.values, mb.old_values, mb.returns, mb.mask,
                                                    s.value_clip)       # [n, T]
            v_loss = (v_mat * mb.mask).sum() / vdenom
            loss = loss + s.vf_coef * v_loss
            exact["value/loss"] = exact.get("value/loss", 0.0) + v_loss.detach()
            metrics.update({"value/clip_frac": v_metrics.get("clip_frac", torch.zeros(())),
                            "value/explained_var": explained_variance(f.values.detach(), mb.returns,
                                                                      mb.mask),
                            "value/mean": masked_mean(f.values.detach(), mb.mask)})
        loss.backward()
        weight = mb.mask.sum()
        exact["loss"] = exact.get("loss", 0.0) + pg_loss.detach()
        metrics["entropy"] = masked_mean(f.entropy, mb.mask)
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + v.detach().float() * weight
    total = batch.mask.sum().clamp(min=1)
    return {**{k: v / total for k, v in sums.items()}, **exact}


def update_policy(model, optimizer, scheduler, batch: RolloutBatch, s: UpdateSettings,
                  st: UpdateState, critic=None) -> Dict[str, torch.Tensor]:
    """Run the optimizer steps for one rollout; returns detached metric tensors.

    ``batch.old_logprobs`` None means a single pass (1 epoch, 1 minibatch): the ratio is
    exactly 1 and the old log-probs are the current ones, detached; no extra forward.
    """
    model.train()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    records: Dict[str, List[torch.Tensor]] = {}
    shuffle = s.epochs * s.minibatches > 1
    for _ in range(s.epochs):
        order = torch.randperm(batch.num_sequences) if shuffle else torch.arange(batch.num_sequences)
        for rows in order.chunk(s.minibatches):
            optimizer.zero_grad(set_to_none=True)
            metrics = accumulate_gradients(model, batch.select(rows.to(batch.mask.device)), s, st, critic)
            if st.policy_frozen:
                for p in params:
                    if id(p) not in st.critic_only:
                        p.grad = None
            grad_norm = torch.nn.utils.clip_grad_norm_(
                [p for p in params if p.grad is not None],
                s.max_grad_norm if s.max_grad_norm > 0 else float("inf"))
            optimizer.step()
            scheduler.step()
            metrics["grad_norm"] = grad_norm.detach()
            for k, v in metrics.items():
                records.setdefault(k, []).append(v)
    return {k: torch.stack(v).mean() for k, v in records.items()}
