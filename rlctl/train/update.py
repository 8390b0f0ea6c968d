"""The learner's update (epochs x minibatches of optimizer steps on one rollout), its loss
terms summed in `accumulate_gradients`, exact over micro-batches for every aggregation mode;
``mask_truncated``: DAPO's overlong filtering (Yu et al., 2025)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial, reduce
from typing import Callable, Dict, List, Optional, Tuple

import torch
from omegaconf import OmegaConf

from rlctl.core import (PREFERENCE_LOSSES, agg_denominator, aggregate_sum, counted_width,
                        get_policy_loss, kl_estimate, masked_mean, resolve_kl_estimator)
from rlctl.core.losses import active_terms, value_loss_per_token
from rlctl.core.rollout_correction import correction_weights, mismatch_metrics
from rlctl.errors import UserError
from rlctl.models.forward import PromptGroups, learner_forward
from rlctl.train.metrics import PAIR_METRICS, Metric, Moments, explained_variance_of, population_std
from rlctl.config.schema import AlgoConfig, RolloutCorrectionConfig
from rlctl.types import RolloutBatch


@dataclass
class UpdateSettings:
    """What the update and the advantages take: the config's ``algo``, ``trainer`` and ``rollout``
    sections and what they derive (losses looked up, the KL estimator, the rollout correction)."""
    algo: AlgoConfig
    policy_loss: Callable
    clip_high: float               # algo.clip_eps_high, else algo.clip_eps
    kl_estimator: str
    kl_in_loss: bool
    kl_in_reward: bool
    terms: Tuple[Tuple[str, float, Callable], ...]     # (name, coef, fn): rlctl.core.losses
    rollout_correction: Optional[RolloutCorrectionConfig]
    share_prompts: bool            # one prompt forward per distinct prompt, as the backend allows
    temperature: float             # rollout.temperature
    micro_batch_size: int          # sequences per forward; 0: the whole minibatch
    micro_batch_tokens: int        # padded tokens per forward; 0: no token budget
    max_new_tokens: int            # the overlong limits: rollout.max_new_tokens and
    episode_max_tokens: int        # rollout.episode.max_tokens
    trim_padding: bool = True      # cut each micro-batch to its longest completion
    # the preference loss (algo.loss_type, its options bound), in place of the policy loss:
    # rows 2i and 2i+1 are a pair's chosen and rejected answers; None: RL
    preference: Optional[Callable] = None
    activation_tokens: int = 0     # padded tokens per forward within trainer.activation_mb; 0: any

    @classmethod
    def from_config(cls, cfg, share_prompts: bool, episodic: bool = False,
                    token_bytes: int = 0) -> "UpdateSettings":
        """``share_prompts``: ``trainer.share_prompts`` as it applies on the backend;
        ``episodic``: rows are episodes (``algo.norm_len`` null: their model-token budget);
        ``token_bytes``: stored activations per token (``activation_bytes``; 0: no cap)."""
        algo, tr, ro, rc = cfg.algo, cfg.trainer, cfg.rollout, cfg.algo.rollout_correction
        if algo.norm_len is None:
            ep = ro.episode
            budget = min(ep.max_turns * ro.max_new_tokens, ep.max_tokens) if episodic \
                else ro.max_new_tokens
            algo = OmegaConf.merge(algo, {"norm_len": budget})
        return cls(algo=algo, policy_loss=get_policy_loss(algo.policy_loss),
                   clip_high=algo.clip_eps_high if algo.clip_eps_high is not None else algo.clip_eps,
                   kl_estimator=resolve_kl_estimator(algo.kl.estimator, algo.kl.placement),
                   kl_in_loss=algo.kl.placement == "in_loss",
                   kl_in_reward=algo.kl.placement == "in_reward",
                   terms=tuple(active_terms({"entropy": algo.get("entropy_coef", 0.0)})),
                   rollout_correction=(RolloutCorrectionConfig(**OmegaConf.to_container(rc))
                                       if rc.enabled else None),
                   share_prompts=share_prompts, temperature=ro.temperature,
                   micro_batch_size=tr.micro_batch_size, micro_batch_tokens=tr.micro_batch_tokens,
                   max_new_tokens=ro.max_new_tokens, episode_max_tokens=ro.episode.max_tokens,
                   preference=preference_loss(algo),
                   activation_tokens=activation_mb(tr.activation_mb, cfg.hardware.device) * 2**20
                   // token_bytes if token_bytes else 0)


def activation_mb(value: Optional[int], device: str) -> int:
    """``trainer.activation_mb`` resolved: null is 768 MiB on the CPU (memory, not batch
    width, bounds a CPU step), no limit on an accelerator; 0: no limit."""
    return value if value is not None else 768 if device == "cpu" else 0


def activation_bytes(hidden: int, layers: int, half: bool, checkpointing: bool) -> int:
    """Stored activations per padded token, the rule of docs/memory.md: about 16 values per
    hidden unit and layer (under checkpointing each layer's input, plus one layer's 16), 2
    bytes each under bf16 autocast or 16-bit weights, else 4."""
    return (hidden * (layers + 16) if checkpointing else 16 * hidden * layers) * (2 if half else 4)


def even_split(n: int, size: int, fit: int) -> int:
    """Micro-batch size for ``n`` rows: at most ``size`` (0: any) and ``fit``, the fewest
    micro-batches, as even as can be."""
    cap = max(1, min(size or n, fit, n))
    return -(-n // -(-n // cap))


def preference_loss(algo) -> Optional[Callable]:
    """``algo.loss_type``'s loss with beta, label smoothing and SimPO's gamma bound, or None."""
    name = getattr(algo, "loss_type", None)
    if name is None:
        return None
    return partial(PREFERENCE_LOSSES.get(name), beta=algo.beta, label_smoothing=algo.label_smoothing,
                   gamma=algo.simpo_gamma)


def needs_reference(algo) -> bool:
    """Whether a run needs pi_ref (``algo``: the config's section): a KL term, or a
    preference loss that reads it."""
    name = getattr(algo, "loss_type", None)
    return algo.kl.coef > 0 or (name is not None and PREFERENCE_LOSSES.entry(name).needs_reference)


def pair_sums(loss_fn: Callable, logp: torch.Tensor, mb: RolloutBatch, mask: torch.Tensor
              ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """(the loss summed over the pairs of ``mb`` (rows 2i chosen, 2i+1 rejected), detached sums
    of ``PAIR_METRICS``) from the summed completion log-probs; ``logp`` [2P, T]."""
    seq = (logp * mask).sum(-1)                                                   # [2P]
    ref = (mb.logprobs.ref * mask).sum(-1).to(seq) if mb.logprobs.ref is not None else None  # [2P]
    n = mask.sum(-1).to(seq)                                                      # [2P]
    loss, r_c, r_r = loss_fn(seq[0::2], seq[1::2], None if ref is None else ref[0::2],
                             None if ref is None else ref[1::2], n[0::2], n[1::2])   # [P] each
    lp = seq.detach()
    return loss.sum(), dict(zip(PAIR_METRICS, (
        r_c.sum(), r_r.sum(), (r_c - r_r).sum(), (r_c > r_r).to(lp.dtype).sum(),
        lp[0::2].sum(), lp[1::2].sum())))


@dataclass
class UpdateState:
    """Per-call inputs that change over training."""
    kl_coef: float = 0.0
    policy_frozen: bool = False            # critic warm-up: only critic-only weights move


def micro_batches(row_width: torch.Tensor, prompt_len: int, size: int = 0, tokens: int = 0,
                  width: Optional[int] = None) -> List[torch.Tensor]:
    """Row indices (CPU) of each micro-batch: at most ``size`` rows and ``tokens`` padded tokens
    (0: no limit), widest rows first (``row_width`` [n]; ``width``: a fixed width, else each
    micro-batch's widest row); a row over the budget goes alone."""
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


def accumulate_gradients(model, backend, batch: RolloutBatch, s: UpdateSettings, st: UpdateState,
                         critic=None, row_width: Optional[torch.Tensor] = None,
                         prompts: Optional[PromptGroups] = None,
                         logp_out: Optional[torch.Tensor] = None) -> Dict[str, Metric]:
    """Backward of one minibatch's loss, micro-batch by micro-batch, each rank's exact share of
    the global loss (normalisers summed over ``backend``'s ranks) -> detached metrics.
    ``row_width`` ([N], CPU) and ``prompts``: found here when None; ``logp_out`` [N, T]: filled
    with the forward's log-probs (0 past each micro-batch's width)."""
    a = s.algo
    if row_width is None:
        row_width = counted_width(batch.mask).cpu()                          # [N]
    if prompts is None and s.share_prompts:
        prompts = PromptGroups.of(batch.input_ids, batch.attention_mask, batch.prompt_len)
    pairs = s.preference is not None
    unit = 2 if pairs else 1                 # rows kept in one micro-batch: a pair's two
    denom = backend.all_reduce(batch.mask.new_tensor(batch.num_sequences / 2) if pairs else
                               agg_denominator(batch.mask, a.loss_agg_mode, a.norm_len)).clamp(min=1e-12)
    vdenom = backend.all_reduce(batch.mask.sum()).clamp(min=1)           # value term: token-mean
    scale = backend.dp_loss_scale            # undoes the backend's averaging of gradients
    sums: Dict[str, torch.Tensor] = {}       # token-weighted metric sums
    exact: Dict[str, torch.Tensor] = {}      # loss terms: micro-batch shares add up exactly
    pooled: Dict[str, Moments] = {}          # spreads: moments pooled over micro-batches
    corr = s.rollout_correction if s.rollout_correction is not None and \
        not s.rollout_correction.bypass else None
    size = -(-s.micro_batch_size // unit)
    if s.activation_tokens:                  # trainer.activation_mb: rows of the widest's width
        wide = batch.prompt_len + (max(int(row_width.max()), 1) if s.trim_padding else batch.mask.shape[1])
        size = even_split(row_width.numel() // unit, size, s.activation_tokens // (wide * unit))
    for units in micro_batches(row_width.view(-1, unit).amax(-1) * unit, batch.prompt_len * unit,
                               size, s.micro_batch_tokens,
                               None if s.trim_padding else batch.mask.shape[1] * unit):
        rows = (units[:, None] * unit + torch.arange(unit)).flatten()        # CPU rows
        width = max(int(row_width[rows].max()), 1) if s.trim_padding else None
        mb = batch.select(rows.to(batch.mask.device), text=False)           # [n, P+T], no host sync
        mb = mb if width is None else mb.cut(width)                          # [n, P + width]
        mask = mb.mask
        f = learner_forward(model, mb.input_ids, mb.attention_mask, mb.prompt_len,
                            s.temperature, with_entropy=True, critic=critic, entropy_grad=bool(s.terms),
                            share_prompts=prompts.rows(rows) if s.share_prompts else False)
        if logp_out is not None:
            logp_out[rows.to(logp_out.device), :f.logp.shape[1]] = f.logp.detach().to(logp_out.dtype)
        old = mb.logprobs.old if mb.logprobs.old is not None else f.logp.detach()
        if pairs:                            # the preference loss over the global number of pairs
            pg_loss, pair_metrics = pair_sums(s.preference, f.logp, mb, mask)
            loss_mat, metrics = torch.zeros_like(f.logp), {}
            for k, v in pair_metrics.items():
                exact[k] = exact.get(k, 0.0) + v / denom
        else:
            loss_mat, metrics = s.policy_loss(f.logp, old, mb.advantages, mask,
                                              a.clip_eps, s.clip_high, a.clip_ratio_c)   # [n, T]
        if mb.logprobs.old is not None:      # spread of pi/pi_old (async: pi_old = behaviour)
            ratio = torch.exp((f.logp.detach() - old).clamp(-20, 20))                  # [n, T]
            metrics["policy/ratio_std"] = Moments.of(ratio[None], mask, population_std)
            mb_max = torch.where(mask > 0, ratio, 0.0).max()
            exact["policy/ratio_max"] = torch.maximum(exact["policy/ratio_max"], mb_max) \
                if "policy/ratio_max" in exact else mb_max
        if corr is not None:                 # x pi_old / pi_engine (rlctl.core.rollout_correction)
            loss_mat = loss_mat * correction_weight(mb, corr).to(loss_mat.dtype)
        pg_loss = (pg_loss if pairs else aggregate_sum(loss_mat, mask, a.loss_agg_mode, a.norm_len)) / denom
        terms_loss = 0.0                     # extra terms (an entropy bonus), like the policy loss
        for _, coef, fn in s.terms:
            terms_loss = terms_loss + coef * aggregate_sum(fn(f.logp, f.entropy, mask), mask,
                                                           a.loss_agg_mode, a.norm_len) / denom
        kl_loss = 0.0
        if mb.logprobs.ref is not None:      # one estimate: the loss (in_loss) and policy/kl_ref
            in_loss = st.kl_coef > 0 and s.kl_in_loss and not st.policy_frozen   # warm-up: critic only
            kl_mat = kl_estimate(f.logp if in_loss else f.logp.detach(), mb.logprobs.ref,
                                 s.kl_estimator)                                           # [n, T]
            if in_loss:
                kl_loss = st.kl_coef * aggregate_sum(kl_mat, mask, a.loss_agg_mode, a.norm_len) / denom
            metrics["policy/kl_ref"] = masked_mean(kl_mat.detach(), mask)
            for k in ("k1", "k3"):       # whatever the estimator, so runs stay comparable
                metrics[f"kl/{k}"] = masked_mean(kl_estimate(f.logp.detach(), mb.logprobs.ref, k), mask)
        v_loss = 0.0
        if mb.returns is not None and f.values is not None:    # token-mean over the minibatch
            v_mat, v_metrics = value_loss_per_token(f.values, mb.old_values, mb.returns, mask,
                                                    a.value_clip)                          # [n, T]
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
        loss = pg_term + terms_loss + kl_loss + a.vf_coef * v_loss     # the loss, term by term
        backend.backward(loss * scale)
        exact["policy/loss"] = exact.get("policy/loss", 0.0) + pg_loss.detach()
        metrics["policy/entropy"] = masked_mean(f.entropy.detach(), mask)     # a metric: no graph
        weight = mask.sum()
        for k, v in metrics.items():
            if isinstance(v, Moments):
                pooled[k] = pooled[k].combine(v) if k in pooled else v
            else:
                sums[k] = sums.get(k, 0.0) + v.detach().float() * weight
        # a graph left without a backward (the policy's, in critic warm-up) ends here, not
        # while the next micro-batch's forward runs beside it
        del f, loss_mat, pg_loss, pg_term, loss
    total = batch.mask.sum().clamp(min=1)
    out: Dict[str, Metric] = {}
    for k, v in sums.items():
        out[k] = v / total
    out.update(exact)
    out.update(pooled)
    return out


def update_policy(model, backend, batch: RolloutBatch, s: UpdateSettings, st: UpdateState,
                  critic=None, prompts: Optional[PromptGroups] = None) -> Dict[str, Metric]:
    """The optimizer steps for one rollout (``model``: what ``backend.prepare`` returned) ->
    detached metrics, means over the steps and `Moments` pooled over every token; with the
    sampler's log-probs, ``rollout_corr/*`` (correction off: measured, the first step's rows)."""
    model.train()
    a = s.algo
    if a.mask_truncated:     # DAPO's overlong filtering; the advantages were computed before
        batch = batch.replace(mask=update_mask(batch, a))
    records: Dict[str, List[torch.Tensor]] = {}
    shuffle = a.epochs * a.minibatches > 1
    # [N]; host syncs once per rollout. Last counted column + 1 (= mask.sum(-1) for a
    # single-turn row, whose counted tokens start at column 0 with no gap)
    row_width = counted_width(batch.mask).cpu()
    if prompts is None and s.share_prompts:
        prompts = PromptGroups.of(batch.input_ids, batch.attention_mask, batch.prompt_len)
    corr = s.rollout_correction
    # correction off: the sampler's mismatch measured against the first step's forward (pi_old)
    measure = corr is None and batch.logprobs.engine is not None
    measured: Dict[str, Metric] = {}
    unit = 2 if s.preference is not None else 1      # a pair's rows stay together
    for _ in range(a.epochs):
        n = batch.num_sequences // unit
        order = torch.randperm(n) if shuffle else torch.arange(n)
        # exactly a.minibatches pieces (chunk gives fewer when N / minibatches is not whole:
        # ranks keeping different numbers of groups would step a different number of times)
        for units in torch.tensor_split(order, a.minibatches):
            rows = (units[:, None] * unit + torch.arange(unit)).flatten()
            backend.zero_grad()
            mb = batch if not shuffle and a.minibatches == 1 else \
                batch.select(rows.to(batch.mask.device), text=False)
            logp = torch.zeros_like(mb.logprobs.engine) if measure and not measured else None   # [n, T]
            metrics = accumulate_gradients(model, backend, mb, s, st, critic, row_width[rows],
                                           None if prompts is None else prompts.rows(rows), logp)
            if logp is not None:
                measured = mismatch_metrics(logp, mb.logprobs.engine, mb.mask, "token", "measure", math.inf)
            # A non-finite loss (on any rank) skips this optimizer step on every rank, and so
            # does a minibatch with no counted token on any rank (mask_truncated): one
            # collective and one host sync per optimizer step, the only ones in the update.
            bad = (~torch.isfinite(metrics["policy/loss"] + metrics.get("value/loss", 0.0))).float()
            has_tokens = (mb.mask.sum() > 0).to(bad.dtype)
            bad_any, tokens_any = backend.all_reduce(torch.stack([bad, has_tokens]), "max").tolist()
            if a.mask_truncated and not tokens_any:
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
        out[k] = reduce(Moments.combine, v) if isinstance(v[0], Moments) else torch.stack(v).mean()
    out["fault/skipped_steps"] = torch.stack(records["fault/skipped_steps"]).sum()
    if a.mask_truncated:
        out["rollout/masked_frac"] = batch.truncated.float().mean()
    if "policy/ratio_max" in records:
        out["policy/ratio_max"] = torch.stack(records["policy/ratio_max"]).max()
    lp = batch.logprobs
    if corr is not None and not corr.bypass and lp.engine is not None \
            and lp.old is not None:     # rollout_corr/*: once per rollout
        measured = mismatch_metrics(lp.old, lp.engine, batch.mask, corr.level,
                                    corr.mode, corr.upper, corr.lower)
    out.update({f"rollout_corr/{k}": v for k, v in measured.items()})
    return out


def update_mask(batch: RolloutBatch, algo: AlgoConfig) -> torch.Tensor:
    """The mask [N, T] the loss counts: ``batch.mask``, with ``algo.mask_truncated`` 0 on the
    truncated rows."""
    if not algo.mask_truncated:
        return batch.mask
    return batch.mask * (~batch.truncated.bool())[:, None].to(batch.mask.dtype)


def nothing_trained(values: Dict[str, float]) -> Optional[str]:
    """Why the step's reduced metrics ``values`` show an update that counted no token (its
    loss 0 on every row), naming the knob; None when something trained."""
    if values.get("rollout/masked_frac", 0.0) >= 1.0:
        return ("every row was truncated and algo.mask_truncated=true left it out of the loss: "
                "nothing trained (raise rollout.max_new_tokens or set algo.mask_truncated=false)")
    if values.get("rollout_corr/masked_frac", 0.0) >= 1.0:
        return ("algo.rollout_correction (mode mask) masked every unit, its weight outside "
                "[algo.rollout_correction.lower, upper]: nothing trained (widen the band)")
    return None


def old_policy_inputs(batch: RolloutBatch, corr: Optional[RolloutCorrectionConfig]) -> RolloutBatch:
    """The batch as the old-policy forward sees it (bypass: pi_old := pi_engine)."""
    if corr is None:
        return batch
    if batch.logprobs.engine is None:
        raise UserError("algo.rollout_correction.enabled=true needs the sampler's log-probs, "
                        "and this rollout source recorded none (logprobs.engine)")
    old = batch.logprobs.engine if corr.bypass else None
    return batch.replace(logprobs=dict(old=old, behaviour_rows=None))


def correction_weight(mb: RolloutBatch, corr: RolloutCorrectionConfig) -> torch.Tensor:
    """The weight [n, T] multiplying each token's policy loss (correction on, no bypass)."""
    lp = mb.logprobs
    if lp.engine is None or lp.old is None:
        raise UserError("algo.rollout_correction needs both the sampler's log-probs and the "
                        "learner's old ones in the batch (logprobs.engine, logprobs.old)")
    return correction_weights(lp.old, lp.engine, mb.mask, corr.level, corr.mode,
                              corr.upper, corr.lower)
