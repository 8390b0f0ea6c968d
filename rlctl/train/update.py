"""The learner's update: epochs x minibatches of optimizer steps on one rollout, and the
rollout correction's hooks (``algo.rollout_correction``; math: rlctl.core.rollout_correction).

Algorithm-free: the policy loss comes from ``POLICY_LOSSES``, the KL term from
``kl_estimate``, the value loss from ``value_loss_per_token``, extra terms (an entropy
bonus) from ``LOSS_TERMS``; `accumulate_gradients` sums them in one line. Gradient
accumulation is exact for every aggregation mode: each micro-batch adds
``aggregate_sum(...) / agg_denominator(minibatch mask)``. Micro-batches are rows
(``micro_batch_size``), a padded-token budget (``micro_batch_tokens``), or both.
``mask_truncated`` (DAPO's overlong filtering, Yu et al., 2025) zeroes the mask of rows with
no stop id before the update (their rewards still counted in the advantages); a minibatch
left with no token takes no optimizer step."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
from omegaconf import OmegaConf

from rlctl.core import (agg_denominator, aggregate_sum, counted_width, get_policy_loss, kl_estimate,
                        masked_mean, resolve_kl_estimator)
from rlctl.core.losses import active_terms, value_loss_per_token
from rlctl.core.rollout_correction import correction_weights, mismatch_metrics
from rlctl.errors import UserError
from rlctl.models.forward import PromptGroups, learner_forward
from rlctl.train.metrics import Metric, Moments, explained_variance_of, pool, population_std
from rlctl.config.schema import RolloutCorrectionConfig
from rlctl.types import RolloutBatch


@dataclass
class UpdateSettings:
    """The update's arguments from the ``algo``, ``trainer`` and ``rollout`` sections: the
    policy loss and extra terms looked up, the KL estimator resolved for its placement,
    the rollout correction (None: off)."""
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
    micro_batch_tokens: int = 0            # padded tokens per forward; 0: no token budget
    trim_padding: bool = True              # cut each micro-batch to its longest completion
    share_prompts: bool = True             # one prompt forward per distinct prompt
    vf_coef: float = 0.0
    value_clip: Optional[float] = None
    terms: Tuple[Tuple[str, float, Callable], ...] = ()   # (name, coef, fn): rlctl.core.losses
    mask_truncated: bool = False           # rows with no stop id out of the loss (DAPO)
    rollout_correction: Optional[RolloutCorrectionConfig] = None   # sampler/learner mismatch; None: off

    @classmethod
    def from_config(cls, cfg, share_prompts: bool) -> "UpdateSettings":
        """``share_prompts``: ``trainer.share_prompts`` as it applies on the backend."""
        algo, tr, rc = cfg.algo, cfg.trainer, cfg.algo.rollout_correction
        return cls(policy_loss=get_policy_loss(algo.policy_loss), clip_low=algo.clip_eps,
                   clip_high=algo.clip_eps_high if algo.clip_eps_high is not None else algo.clip_eps,
                   clip_ratio_c=algo.clip_ratio_c, agg_mode=algo.loss_agg_mode, norm_len=algo.norm_len,
                   epochs=algo.epochs, minibatches=algo.minibatches,
                   kl_estimator=resolve_kl_estimator(algo.kl.estimator, algo.kl.placement),
                   kl_in_loss=algo.kl.placement == "in_loss", max_grad_norm=tr.max_grad_norm,
                   temperature=cfg.rollout.temperature, micro_batch_size=tr.micro_batch_size,
                   micro_batch_tokens=tr.micro_batch_tokens,
                   vf_coef=algo.vf_coef, value_clip=algo.value_clip, share_prompts=share_prompts,
                   terms=tuple(active_terms({"entropy": algo.get("entropy_coef", 0.0)})),
                   mask_truncated=bool(algo.get("mask_truncated", False)),
                   rollout_correction=(RolloutCorrectionConfig(**OmegaConf.to_container(rc))
                                       if rc.enabled else None))


@dataclass
class UpdateState:
    """Per-call inputs that change over training."""
    kl_coef: float = 0.0
    policy_frozen: bool = False            # critic warm-up: only critic-only weights move


def micro_batches(row_width: torch.Tensor, prompt_len: int, size: int = 0, tokens: int = 0,
                  width: Optional[int] = None) -> List[torch.Tensor]:
    """Row indices (CPU) of each micro-batch: at most ``size`` rows and ``tokens`` padded
    tokens, rows x (prompt_len + widest completion) (0: no limit). ``row_width`` [n]: each
    row's `counted_width`; ``width``: the width every micro-batch keeps (None: its widest
    row). Widest rows first; a row is never split (one over the budget goes alone)."""
    rows = torch.arange(row_width.numel())
    if tokens <= 0:
        return [rows] if size <= 0 or size >= rows.numel() else list(rows.split(size))
    out: List[List[int]] = []
    for r in torch.argsort(row_width, descending=True, stable=True).tolist():
        if out:
            w = width if width is not None else max(int(row_width[out[-1][0]]), 1)   # its widest row
            fits = (len(out[-1]) + 1) * (prompt_len + w) <= tokens
            if fits and (size <= 0 or len(out[-1]) < size):
                out[-1].append(r)
                continue
        out.append([r])
    return [torch.tensor(m, dtype=torch.long) for m in out]


def accumulate_gradients(model, batch: RolloutBatch, s: UpdateSettings, st: UpdateState,
                         critic=None, backend=None, row_width: Optional[torch.Tensor] = None,
                         prompts: Optional[PromptGroups] = None) -> Dict[str, Metric]:
    """Backward of one minibatch's loss, micro-batch by micro-batch; returns metrics
    (token-weighted means of detached tensors; spreads as `Moments`). Does not step or
    zero the optimizer. With a data-parallel ``backend`` the normalisers are summed over
    ranks, so each rank's backward carries its exact share of the global minibatch loss.
    ``row_width``: each row's `counted_width` ([N] long, CPU; found here when not given);
    ``prompts``: which rows share a prompt (found here when not given)."""
    backend = backend or _LOCAL
    if row_width is None:
        row_width = counted_width(batch.mask).cpu()                          # [N]
    if prompts is None and s.share_prompts:
        prompts = PromptGroups.of(batch.input_ids, batch.attention_mask, batch.prompt_len)
    denom = backend.all_reduce(agg_denominator(batch.mask, s.agg_mode, s.norm_len)).clamp(min=1e-12)
    vdenom = backend.all_reduce(batch.mask.sum()).clamp(min=1)           # value term: token-mean
    scale = backend.dp_loss_scale            # undoes the backend's averaging of gradients
    sums: Dict[str, torch.Tensor] = {}       # token-weighted metric sums
    exact: Dict[str, torch.Tensor] = {}      # loss terms: micro-batch shares add up exactly
    pooled: Dict[str, Moments] = {}          # spreads: moments pooled over micro-batches
    corr = s.rollout_correction if s.rollout_correction is not None and \
        not s.rollout_correction.bypass else None
    for rows in micro_batches(row_width, batch.prompt_len, s.micro_batch_size, s.micro_batch_tokens,
                              None if s.trim_padding else batch.mask.shape[1]):   # CPU rows
        width = max(int(row_width[rows].max()), 1) if s.trim_padding else None
        mb = batch.select(rows.to(batch.mask.device), text=False)           # [n, P+T], no host sync
        mb = mb if width is None else mb.cut(width)                          # [n, P + width]
        mask = mb.mask
        f = learner_forward(model, mb.input_ids, mb.attention_mask, mb.prompt_len,
                            s.temperature, with_entropy=True, critic=critic, entropy_grad=bool(s.terms),
                            share_prompts=prompts.rows(rows) if s.share_prompts else False)
        old = mb.old_logprobs if mb.old_logprobs is not None else f.logp.detach()
        loss_mat, metrics = s.policy_loss(f.logp, old, mb.advantages, mask,
                                          s.clip_low, s.clip_high, s.clip_ratio_c)   # [n, T]
        if mb.old_logprobs is not None:      # spread of pi/pi_old (async: pi_old = behaviour)
            ratio = torch.exp((f.logp.detach() - old).clamp(-20, 20))                  # [n, T]
            metrics["policy/ratio_std"] = Moments.of(ratio[None], mask, population_std)
            mb_max = torch.where(mask > 0, ratio, 0.0).max()
            exact["policy/ratio_max"] = torch.maximum(exact["policy/ratio_max"], mb_max) \
                if "policy/ratio_max" in exact else mb_max
        if corr is not None:                 # x pi_old / pi_engine (rlctl.core.rollout_correction)
            loss_mat = loss_mat * correction_weight(mb, corr).to(loss_mat.dtype)
        pg_loss = aggregate_sum(loss_mat, mask, s.agg_mode, s.norm_len) / denom
        terms_loss = 0.0                     # extra terms (an entropy bonus), like the policy loss
        for _, coef, fn in s.terms:
            terms_loss = terms_loss + coef * aggregate_sum(fn(f.logp, f.entropy, mask), mask,
                                                           s.agg_mode, s.norm_len) / denom
        kl_loss = 0.0
        if mb.ref_logprobs is not None:      # one estimate: the loss (in_loss) and policy/kl_ref
            in_loss = st.kl_coef > 0 and s.kl_in_loss and not st.policy_frozen   # warm-up: critic only
            kl_mat = kl_estimate(f.logp if in_loss else f.logp.detach(), mb.ref_logprobs,
                                 s.kl_estimator)                                           # [n, T]
            if in_loss:
                kl_loss = st.kl_coef * aggregate_sum(kl_mat, mask, s.agg_mode, s.norm_len) / denom
            metrics["policy/kl_ref"] = masked_mean(kl_mat.detach(), mask)
            metrics.update(kl_side_by_side(f.logp.detach(), mb.ref_logprobs, mask))
        v_loss = 0.0
        if mb.returns is not None and f.values is not None:    # token-mean over the minibatch
            v_mat, v_metrics = value_loss_per_token(f.values, mb.old_values, mb.returns, mask,
                                                    s.value_clip)                          # [n, T]
            v_loss = (v_mat * mask).sum() / vdenom
            exact["value/loss"] = exact.get("value/loss", 0.0) + v_loss.detach()
            r = mb.returns.detach().double()                   # moments of (R, R - V): 1 - Var ratio
            metrics.update(v_metrics)
            metrics["value/explained_var"] = Moments.of(
                torch.stack([r, r - f.values.detach().double()]), mask, explained_variance_of)
            metrics["value/mean"] = masked_mean(f.values.detach(), mask)
        if st.policy_frozen:                 # critic warm-up: only critic-only weights move
            pg_term, terms_loss = pg_loss.new_zeros(()), 0.0
        else:
            pg_term = pg_loss
        loss = pg_term + terms_loss + kl_loss + s.vf_coef * v_loss     # the loss, term by term
        backend.backward(loss * scale)
        exact["policy/loss"] = exact.get("policy/loss", 0.0) + pg_loss.detach()
        metrics["policy/entropy"] = masked_mean(f.entropy, mask)
        weight = mask.sum()
        for k, v in metrics.items():
            if isinstance(v, Moments):
                pooled[k] = pooled[k].combine(v) if k in pooled else v
            else:
                sums[k] = sums.get(k, 0.0) + v.detach().float() * weight
    total = batch.mask.sum().clamp(min=1)
    out: Dict[str, Metric] = {}
    for k, v in sums.items():
        out[k] = v / total
    out.update(exact)
    out.update(pooled)
    return out


def kl_side_by_side(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor
                    ) -> Dict[str, torch.Tensor]:
    """``kl/k1`` and ``kl/k3``: masked token means of two estimates of KL(pi || ref),
    logged whatever the training estimator so runs stay comparable. [n, T] -> scalars."""
    return {f"kl/{k}": masked_mean(kl_estimate(logp, ref_logp, k).detach(), mask) for k in ("k1", "k3")}


class _LocalBackend:
    """Single-process stand-in (tests call ``accumulate_gradients`` without a backend)."""
    dp_loss_scale = 1.0

    @staticmethod
    def all_reduce(t, op="sum"):
        return t

    @staticmethod
    def backward(loss):
        loss.backward()


_LOCAL = _LocalBackend()


def update_policy(model, backend, batch: RolloutBatch, s: UpdateSettings, st: UpdateState,
                  critic=None, prompts: Optional[PromptGroups] = None) -> Dict[str, Metric]:
    """The optimizer steps for one rollout -> detached metrics: means over the steps, and
    `Moments` pooled over every token (`reduce_metrics` finishes them). ``model``: what
    ``backend.prepare`` returned. ``batch.old_logprobs`` None: a single pass, ratio 1
    exactly. Critic warm-up (``st.policy_frozen``): only critic-only weights move."""
    model.train()
    if s.mask_truncated:     # DAPO's overlong filtering; the advantages were computed before
        batch = batch.replace(mask=batch.mask * (~batch.truncated.bool())[:, None].to(batch.mask.dtype))
    records: Dict[str, List[torch.Tensor]] = {}
    shuffle = s.epochs * s.minibatches > 1
    # [N]; host syncs once per rollout. Last counted column + 1 (= mask.sum(-1) for a
    # single-turn row, whose counted tokens start at column 0 with no gap)
    row_width = counted_width(batch.mask).cpu()
    if prompts is None and s.share_prompts:
        prompts = PromptGroups.of(batch.input_ids, batch.attention_mask, batch.prompt_len)
    for _ in range(s.epochs):
        order = torch.randperm(batch.num_sequences) if shuffle else torch.arange(batch.num_sequences)
        # exactly s.minibatches pieces (chunk gives fewer when N / minibatches is not whole:
        # ranks keeping different numbers of groups would step a different number of times)
        for rows in torch.tensor_split(order, s.minibatches):
            backend.zero_grad()
            mb = batch if not shuffle and s.minibatches == 1 else \
                batch.select(rows.to(batch.mask.device), text=False)
            metrics = accumulate_gradients(model, mb, s, st, critic, backend, row_width[rows],
                                           None if prompts is None else prompts.rows(rows))
            # A non-finite loss (on any rank) skips this optimizer step on every rank, and so
            # does a minibatch with no counted token on any rank (mask_truncated): one
            # collective and one host sync per optimizer step, the only ones in the update.
            bad = (~torch.isfinite(metrics["policy/loss"] + metrics.get("value/loss", 0.0))).float()
            has_tokens = (mb.mask.sum() > 0).to(bad.dtype)
            bad_any, tokens_any = backend.all_reduce(torch.stack([bad, has_tokens]), "max").tolist()
            if s.mask_truncated and not tokens_any:
                backend.zero_grad()                  # every row truncated: no step (Adam would move)
                metrics["optim/grad_norm"] = torch.zeros(())
            elif bad_any:
                backend.zero_grad()
                metrics["optim/grad_norm"] = torch.tensor(float("nan"))
            else:
                metrics["optim/grad_norm"] = backend.step()   # skips itself on a non-finite gradient
            metrics["fault/skipped_steps"] = (~torch.isfinite(metrics["optim/grad_norm"])).float()
            for k, v in metrics.items():
                records.setdefault(k, []).append(v)
    out: Dict[str, Metric] = {}
    for k, v in records.items():
        out[k] = pool(v) if isinstance(v[0], Moments) else torch.stack(v).mean()
    out["fault/skipped_steps"] = torch.stack(records["fault/skipped_steps"]).sum()
    if "policy/ratio_max" in records:
        out["policy/ratio_max"] = torch.stack(records["policy/ratio_max"]).max()
    corr = s.rollout_correction
    if corr is not None and not corr.bypass and batch.engine_logprobs is not None \
            and batch.old_logprobs is not None:     # rollout_corr/*: once per rollout
        m = mismatch_metrics(batch.old_logprobs, batch.engine_logprobs, batch.mask, corr.level,
                             corr.mode, corr.upper, corr.lower)
        out.update({f"rollout_corr/{k}": v for k, v in m.items()})
    return out


def old_policy_inputs(batch: RolloutBatch, corr: Optional[RolloutCorrectionConfig]) -> RolloutBatch:
    """The batch as the old-policy forward sees it: unchanged with the correction off;
    bypass: pi_old := pi_engine in every row; otherwise no old log-probs, so the learner
    computes pi_old for every row (the sampler's stay in ``engine_logprobs``)."""
    if corr is None:
        return batch
    if batch.engine_logprobs is None:
        raise UserError("algo.rollout_correction.enabled=true needs the sampler's log-probs, "
                        "and this rollout source recorded none (engine_logprobs)")
    old = batch.engine_logprobs if corr.bypass else None
    return batch.replace(old_logprobs=old, behaviour_rows=None)


def correction_weight(mb: RolloutBatch, corr: RolloutCorrectionConfig) -> torch.Tensor:
    """The weight [n, T] multiplying each token's policy loss (correction on, no bypass)."""
    if mb.engine_logprobs is None or mb.old_logprobs is None:
        raise UserError("algo.rollout_correction needs both the sampler's log-probs and the "
                        "learner's old ones in the batch (engine_logprobs, old_logprobs)")
    return correction_weights(mb.old_logprobs, mb.engine_logprobs, mb.mask, corr.level, corr.mode,
                              corr.upper, corr.lower)
