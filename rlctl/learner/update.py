"""The learner's update: epochs x minibatches of optimizer steps on one rollout.

Algorithm-free: the policy loss comes from the ``POLICY_LOSSES`` registry, the KL term
from ``kl_estimate``, the value loss from ``value_loss_per_token``, extra terms (an
entropy bonus) from ``rlctl.core.losses``; this module never looks at an algorithm's name.

``mask_truncated`` (DAPO's overlong filtering, Yu et al., 2025): rows with no stop id
have their mask zeroed here, before the update, so they add nothing to any loss term or
metric; their rewards still counted in the advantages (group means and stds are computed
before, unchanged). A minibatch left with no token takes no optimizer step.

Gradient accumulation over micro-batches is exact for every aggregation mode: each
micro-batch contributes ``aggregate_sum(...) / agg_denominator(minibatch mask)``, i.e.
its share of the numerator over the *minibatch's* denominator (token count, or count of
non-empty rows, times norm_len for seq-mean-token-sum-norm), so the summed gradient
equals the gradient of the minibatch aggregate (tested against the full-batch loss).
Micro-batches are rows (``micro_batch_size``) or a padded-token budget
(``micro_batch_tokens``, `micro_batches`), or both.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
from omegaconf import OmegaConf

from rlctl.core import (agg_denominator, aggregate_sum, counted_width, get_policy_loss, kl_estimate,
                        masked_mean, resolve_kl_estimator)
from rlctl.core.losses import active_terms, value_loss_per_token
from rlctl.learner.correction import batch_metrics, weighted
from rlctl.learner.forward import PromptGroups, learner_forward
from rlctl.learner.stats import Metric, Moments, explained_variance_of, pool, population_std
from rlctl.schema import RolloutCorrectionConfig
from rlctl.types import RolloutBatch


@dataclass
class UpdateSettings:
    """The update's arguments, derived from the ``algo``, ``trainer`` and ``rollout``
    sections (``from_config``): the policy loss looked up in its registry, clip_high's
    default, the KL estimator resolved for its placement, the active extra loss terms,
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
        """From the composed config's ``algo``, ``trainer`` and ``rollout`` sections;
        ``share_prompts``: ``trainer.share_prompts`` as it applies on the backend
        (``policy.prompt_sharing``)."""
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


def _chunks(rows: torch.Tensor, size: int) -> List[torch.Tensor]:
    return [rows] if size <= 0 or size >= rows.numel() else list(rows.split(size))


def micro_batches(row_width: torch.Tensor, prompt_len: int, size: int = 0, tokens: int = 0,
                  width: Optional[int] = None) -> List[torch.Tensor]:
    """Row indices (CPU) of each micro-batch: at most ``size`` rows (0: any number) and at
    most ``tokens`` padded tokens, rows x (prompt_len + widest completion among them)
    (0: no budget). ``row_width`` [n]: each row's completion width (`counted_width`: last
    counted column + 1); ``width``: the completion width every micro-batch keeps (None:
    trimmed to its widest row). Rows are taken widest first, so similar widths share a
    micro-batch; a row is never split, so one wider than the budget alone is a
    micro-batch by itself."""
    rows = torch.arange(row_width.numel())
    if tokens <= 0:
        return _chunks(rows, size)
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


def take_rows(batch: RolloutBatch, rows: torch.Tensor, width: Optional[int] = None) -> RolloutBatch:
    """Rows (a CPU index) of the batch, completion columns cut to ``width`` (None: all
    T); no text lists and no host sync (the learner needs neither)."""
    out = batch.select(rows.to(batch.mask.device), text=False)             # [n, P+T]
    return out if width is None else out.cut(width)                        # [n, P+width]


def accumulate_gradients(model, batch: RolloutBatch, s: UpdateSettings, st: UpdateState,
                         critic=None, backend=None, row_width: Optional[torch.Tensor] = None,
                         prompts: Optional[PromptGroups] = None) -> Dict[str, Metric]:
    """Backward of one minibatch's loss, micro-batch by micro-batch; returns metrics
    (token-weighted means of detached tensors; spreads as `Moments` pooled over the
    micro-batches). Does not step or zero the optimizer.

    With a data-parallel ``backend`` the normalisers are summed over ranks, so each
    rank's backward carries its exact share of the global minibatch loss.
    ``row_width``: each row's last counted column + 1 ([N] long on the CPU, `counted_width`;
    found here, one host sync, when not given; a multi-turn row's mask sums to less, its
    observations being 0): each micro-batch is cut to its widest row (``s.trim_padding``).
    ``prompts``: which rows share a prompt (found here when not given), for prompt sharing."""
    backend = backend or _LOCAL
    if row_width is None:
        row_width = counted_width(batch.mask).cpu()                          # [N]
    if prompts is None and s.share_prompts:
        prompts = PromptGroups.of(batch.input_ids, batch.attention_mask, batch.prompt_len)
    denom = backend.all_reduce_sum(agg_denominator(batch.mask, s.agg_mode, s.norm_len)).clamp(min=1e-12)
    vdenom = backend.all_reduce_sum(batch.mask.sum()).clamp(min=1)           # value term: token-mean
    scale = backend.dp_loss_scale            # undoes the backend's averaging of gradients
    sums: Dict[str, torch.Tensor] = {}       # token-weighted metric sums
    exact: Dict[str, torch.Tensor] = {}      # loss terms: micro-batch shares add up exactly
    peak: Dict[str, torch.Tensor] = {}       # maxima over micro-batches
    pooled: Dict[str, Moments] = {}          # spreads: moments pooled over micro-batches
    for rows in micro_batches(row_width, batch.prompt_len, s.micro_batch_size, s.micro_batch_tokens,
                              None if s.trim_padding else batch.mask.shape[1]):   # CPU rows
        width = max(int(row_width[rows].max()), 1) if s.trim_padding else None
        mb = take_rows(batch, rows, width)                                    # [n, P + width]
        f = learner_forward(model, mb.input_ids, mb.attention_mask, mb.prompt_len,
                            s.temperature, with_entropy=True, critic=critic, entropy_grad=bool(s.terms),
                            share_prompts=prompts.rows(rows) if s.share_prompts else False)
        old = mb.old_logprobs if mb.old_logprobs is not None else f.logp.detach()
        metrics_ratio = {}
        if mb.old_logprobs is not None:      # spread of pi/pi_old (async: pi_old = behaviour)
            metrics_ratio, mb_max = _ratio_spread(f.logp.detach(), old, mb.mask)
            peak["policy/ratio_max"] = torch.maximum(peak["policy/ratio_max"], mb_max) \
                if "policy/ratio_max" in peak else mb_max
        loss_mat, metrics = s.policy_loss(f.logp, old, mb.advantages, mb.mask,
                                          s.clip_low, s.clip_high, s.clip_ratio_c)   # [n, T]
        loss_mat = weighted(loss_mat, mb, s.rollout_correction)   # x pi_old / pi_engine (off: as is)
        metrics.update(metrics_ratio)
        pg_loss = aggregate_sum(loss_mat, mb.mask, s.agg_mode, s.norm_len) / denom
        loss = pg_loss.new_zeros(()) if st.policy_frozen else pg_loss + _extra_terms(f, mb, s, denom)
        if mb.ref_logprobs is not None:
            kl_loss, kl_metrics = _kl_term(f.logp, mb, s, st)
            loss = loss + kl_loss / denom
            metrics.update(kl_metrics)
        if mb.returns is not None and f.values is not None:
            v_loss, v_metrics = _value_term(f.values, mb, s, vdenom)
            loss = loss + s.vf_coef * v_loss
            exact["value/loss"] = exact.get("value/loss", 0.0) + v_loss.detach()
            metrics.update(v_metrics)
        backend.backward(loss * scale)
        weight = mb.mask.sum()
        exact["policy/loss"] = exact.get("policy/loss", 0.0) + pg_loss.detach()
        metrics["policy/entropy"] = masked_mean(f.entropy, mb.mask)
        _gather(metrics, weight, sums, pooled)
    total = batch.mask.sum().clamp(min=1)
    return {**{k: v / total for k, v in sums.items()}, **exact, **peak, **pooled}


def _gather(metrics: Dict[str, Metric], weight: torch.Tensor, sums: Dict[str, torch.Tensor],
            pooled: Dict[str, Moments]) -> None:
    """Adds one micro-batch's metrics: token means weighted by its ``weight`` tokens into
    ``sums``, `Moments` pooled into ``pooled``."""
    for k, v in metrics.items():
        if isinstance(v, Moments):
            pooled[k] = pooled[k].combine(v) if k in pooled else v
        else:
            sums[k] = sums.get(k, 0.0) + v.detach().float() * weight


def _extra_terms(f, mb: RolloutBatch, s: "UpdateSettings", denom: torch.Tensor) -> torch.Tensor:
    """Sum of coef * aggregated term matrix (rlctl.core.losses), each over the minibatch's
    policy-loss denominator like the policy loss; 0 without terms."""
    total = f.logp.new_zeros(())
    for _, coef, fn in s.terms:
        term = fn(f.logp, f.entropy, mb.mask)                                         # [n, T]
        total = total + coef * aggregate_sum(term, mb.mask, s.agg_mode, s.norm_len) / denom
    return total


def _ratio_spread(logp: torch.Tensor, old: torch.Tensor, mask: torch.Tensor):
    """({"policy/ratio_std": moments of the counted ratios}, their max) of pi / pi_old;
    logp, old [n, T]. The std (population) is finished over the whole update."""
    ratio = torch.exp((logp - old).clamp(-20, 20))                                    # [n, T]
    return ({"policy/ratio_std": Moments.of(ratio[None], mask, population_std)},
            torch.where(mask > 0, ratio, 0.0).max())


def _kl_term(logp: torch.Tensor, mb: RolloutBatch, s: "UpdateSettings", st: "UpdateState"):
    """(kl_coef * aggregate_sum of the KL estimate when it is in the loss, else 0; metrics).
    One estimate serves the loss and ``policy/kl_ref``; ``kl/k1``, ``kl/k3`` are logged beside it."""
    in_loss = st.kl_coef > 0 and s.kl_in_loss and not st.policy_frozen   # warm-up: critic only
    kl_mat = kl_estimate(logp if in_loss else logp.detach(), mb.ref_logprobs, s.kl_estimator)  # [n, T]
    term = st.kl_coef * aggregate_sum(kl_mat, mb.mask, s.agg_mode, s.norm_len) if in_loss \
        else logp.new_zeros(())
    metrics = {"policy/kl_ref": masked_mean(kl_mat.detach(), mb.mask)}
    metrics.update(kl_side_by_side(logp.detach(), mb.ref_logprobs, mb.mask))
    return term, metrics


def _value_term(values: torch.Tensor, mb: RolloutBatch, s: "UpdateSettings", vdenom: torch.Tensor):
    """(this micro-batch's share of the token-mean value loss, value metrics); values [n, T]."""
    v_mat, v_metrics = value_loss_per_token(values, mb.old_values, mb.returns, mb.mask,
                                            s.value_clip)                            # [n, T]
    metrics = {**v_metrics,                                         # value/clip_frac
               # moments of (R, R - V), finished over the whole update: 1 - Var[R - V] / Var[R]
               "value/explained_var": Moments.of(_returns_and_residuals(mb.returns, values), mb.mask,
                                                 explained_variance_of),
               "value/mean": masked_mean(values.detach(), mb.mask)}
    return (v_mat * mb.mask).sum() / vdenom, metrics


def _returns_and_residuals(returns: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """[2, n, T] float64: R and R - V (the residual taken in float64)."""
    r = returns.detach().double()                                                     # [n, T]
    return torch.stack([r, r - values.detach().double()])


def kl_side_by_side(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor
                    ) -> Dict[str, torch.Tensor]:
    """``kl/k1`` and ``kl/k3``: masked token means of two estimates of KL(pi || ref),
    logged whatever the training estimator so runs stay comparable. [n, T] -> scalars."""
    return {f"kl/{k}": masked_mean(kl_estimate(logp, ref_logp, k).detach(), mask) for k in ("k1", "k3")}


class _LocalBackend:
    """Single-process stand-in (tests call ``accumulate_gradients`` without a backend)."""
    dp_loss_scale = 1.0

    @staticmethod
    def all_reduce_sum(t):
        return t

    @staticmethod
    def backward(loss):
        loss.backward()


_LOCAL = _LocalBackend()


def update_policy(model, backend, batch: RolloutBatch, s: UpdateSettings, st: UpdateState,
                  critic=None, prompts: Optional[PromptGroups] = None) -> Dict[str, Metric]:
    """Run the optimizer steps for one rollout; returns detached metric tensors: means
    over the optimizer steps, and `Moments` (``policy/ratio_std``,
    ``value/explained_var``) pooled over every token the steps saw, which
    `rlctl.learner.stats.reduce_metrics` finishes (over ranks too).

    ``model`` is what the backend returned from ``prepare`` (the module to call).
    ``batch.old_logprobs`` None means a single pass (1 epoch, 1 minibatch): the ratio is
    exactly 1 and the old log-probs are the current ones, detached; no extra forward.
    During critic warm-up (``st.policy_frozen``) the policy loss is left out and the
    values are computed from a detached backbone, so only critic-only weights move.
    """
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
            mb = batch if not shuffle and s.minibatches == 1 else take_rows(batch, rows)
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
    out = {k: pool(v) if isinstance(v[0], Moments) else torch.stack(v).mean() for k, v in records.items()}
    out["fault/skipped_steps"] = torch.stack(records["fault/skipped_steps"]).sum()
    if "policy/ratio_max" in records:
        out["policy/ratio_max"] = torch.stack(records["policy/ratio_max"]).max()
    out.update(batch_metrics(batch, s.rollout_correction))     # rollout_corr/*: once per rollout
    return out
