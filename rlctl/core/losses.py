"""Policy, value and KL loss terms, their aggregation and the KL controllers (docs/math.md,
sections 4 to 8): PPO clip (Schulman et al., 2017) with DAPO's asymmetric and the dual clip
(Ye et al., 2020), vanilla PG (Williams, 1992), GSPO-token (Zheng et al., 2025), CISPO
(MiniMax-M1, 2025), PPO2's value clip; KL estimators k1, k2, k3 (Schulman, 2020). Per-token
losses return ([N, T], metrics); the log-ratio is 0 off the mask, clamped to +-20 before exp."""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Mapping, Optional, Tuple

import torch

from rlctl.registry import Registry

from .logprobs import acc_dtype, masked_mean, masked_sum, upcast

Metrics = Dict[str, torch.Tensor]
LOG_RATIO_CLAMP = 20.0
POLICY_LOSSES = Registry("policy loss", dashes=True)
register_policy_loss = POLICY_LOSSES.register
# Peers' names (verl: kl / mse / low_var_kl) accepted as aliases.
KL_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}
KL_ESTIMATORS = Registry("KL estimator", aliases=KL_ALIASES)
register_kl = KL_ESTIMATORS.register
LOSS_TERMS = Registry("loss term")
register_loss_term = LOSS_TERMS.register
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
             "seq-mean-token-sum-norm")
AGG_ALIASES = {m.replace("-", "_"): m for m in AGG_MODES}   # peers' underscore spellings


# ---- aggregation ------------------------------------------------------------------------
def resolve_agg_mode(mode: str) -> str:
    """Canonical mode name for `mode` or an alias; ValueError listing valid names."""
    canon = AGG_ALIASES.get(mode, mode)
    if canon not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; valid: {', '.join(AGG_MODES)}"
                         f" (underscore spellings accepted)")
    return canon


def aggregate_sum(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str,
                  norm_len: int | None = None) -> torch.Tensor:
    """Numerator of `aggregate`, a sum over rows. loss_mat, mask [N, T] -> scalar (float32,
    float64 kept); `norm_len` only enters the denominator."""
    if (mode if mode in AGG_MODES else resolve_agg_mode(mode)) == "seq-mean-token-mean":
        row_len = upcast(mask, acc_dtype(loss_mat, mask)).sum(-1).clamp(min=1.0)  # [N]
        return (masked_sum(loss_mat, mask, dim=-1) / row_len).sum()
    return masked_sum(loss_mat, mask)    # token-mean, seq-mean-token-sum(-norm)


def agg_denominator(mask: torch.Tensor, mode: str, norm_len: int | None = None
                    ) -> torch.Tensor:
    """Denominator of `aggregate` (detached scalar, >= 1 or norm_len), from the mask only."""
    mode = mode if mode in AGG_MODES else resolve_agg_mode(mode)
    dtype = acc_dtype(mask)
    if mode == "token-mean":
        den = upcast(mask, dtype).sum()
    else:
        den = (upcast(mask, dtype).sum(-1) > 0).to(dtype).sum()    # rows with tokens
    den = den.clamp(min=1.0)
    if mode == "seq-mean-token-sum-norm":
        den = den * float(mask.shape[-1] if norm_len is None else norm_len)
    return den.detach()


def aggregate(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean",
              norm_len: int | None = None) -> torch.Tensor:
    """A per-token loss [N, T] with `mask` [N, T] as one scalar: aggregate_sum / agg_denominator
    (verl's `loss_agg_mode`; docs/math.md, section 8), so micro-batch sums equal the whole."""
    return aggregate_sum(loss_mat, mask, mode, norm_len) / agg_denominator(mask, mode,
                                                                           norm_len)


# ---- shared pieces of the policy losses -----------------------------------------------
def _token_adv(advantages: torch.Tensor, m: torch.Tensor, dtype) -> torch.Tensor:
    """Detached advantages as [N, T] ([N] broadcast along T), 0 off the mask ``m``."""
    adv = upcast(advantages, dtype).detach()
    adv = adv[:, None].expand(m.shape) if adv.dim() == 1 else adv  # [N, T]
    return torch.where(m, adv, 0.0)   # garbage off the mask cannot become NaN


def _log_ratio(lp: torch.Tensor, old_logp: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """log rho = logp - sg(old_logp), 0 where m is False, clamped to +-20. [N, T]."""
    diff = lp - upcast(old_logp, lp.dtype).detach()  # [N, T]
    return torch.where(m, diff, 0.0).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _clipped(weight: torch.Tensor, adv: torch.Tensor, clip_low: float, clip_high: float,
             clip_ratio_c: Optional[float]) -> Tuple[torch.Tensor, torch.Tensor]:
    """max(-A w, -A clip(w)) [N, T], dual-clipped when c is set: for A < 0 min(loss, -A c),
    no gradient where capped; -> (loss, capped [N, T] bool)."""
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c (dual clip) must be > 1 or None, got {clip_ratio_c!r}")
    loss = torch.maximum(-adv * weight, -adv * weight.clamp(1.0 - clip_low, 1.0 + clip_high))
    if clip_ratio_c is None:
        return loss, torch.zeros_like(loss, dtype=torch.bool)
    cap = -adv * clip_ratio_c  # [N, T]
    capped = (adv < 0) & (loss > cap)
    return torch.where(adv < 0, torch.minimum(loss, cap), loss), capped.detach()


def _clip_metrics(log_ratio: torch.Tensor, mask: torch.Tensor, low: torch.Tensor,
                  high: torch.Tensor, dual: Optional[torch.Tensor] = None) -> Metrics:
    """The shared metric dict (detached). log_ratio [N, T]; low, high, dual [N, T] bool."""
    with torch.no_grad():
        log_ratio = log_ratio.detach()
        dtype = log_ratio.dtype
        frac_low = masked_mean(low.to(dtype), mask)
        frac_high = masked_mean(high.to(dtype), mask)
        frac_dual = (masked_mean(dual.to(dtype), mask) if dual is not None
                     else torch.zeros((), dtype=dtype, device=log_ratio.device))
        approx_kl = masked_mean(torch.expm1(log_ratio) - log_ratio, mask)
    return {"policy/clip_frac_low": frac_low, "policy/clip_frac_high": frac_high,
            "policy/clip_frac": frac_low + frac_high, "policy/clip_frac_dual": frac_dual,
            "policy/approx_kl": approx_kl}


# ---- policy losses ------------------------------------------------------------------------
@register_policy_loss("ppo_clip")
def ppo_clip_per_token(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                       mask: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.2,
                       clip_ratio_c: Optional[float] = None) -> Tuple[torch.Tensor, Metrics]:
    """PPO clipped surrogate per token, optionally dual-clipped. logp, old_logp, mask [N, T];
    advantages [N, T] or [N] -> (loss_mat [N, T], 0 off the mask; metrics). Clip fractions:
    low = A < 0 and rho < 1 - lo, high = A > 0 and rho > 1 + hi, dual = capped."""
    dtype = acc_dtype(logp, old_logp, advantages)
    m = mask != 0
    adv = _token_adv(advantages, m, dtype)  # [N, T]
    log_ratio = _log_ratio(upcast(logp, dtype), old_logp, m)  # [N, T]
    ratio = torch.exp(log_ratio)  # [N, T]
    loss, capped = _clipped(ratio, adv, clip_low, clip_high, clip_ratio_c)  # [N, T]
    low = (adv < 0) & (ratio < 1.0 - clip_low)  # [N, T] clipped branch active
    high = (adv > 0) & (ratio > 1.0 + clip_high)
    return torch.where(m, loss, 0.0), _clip_metrics(log_ratio, mask, low, high, capped)


@register_policy_loss("vanilla_pg")
def vanilla_pg_per_token(logp: torch.Tensor, old_logp: Optional[torch.Tensor],
                         advantages: torch.Tensor, mask: torch.Tensor,
                         clip_low: float = 0.2, clip_high: float = 0.2,
                         clip_ratio_c: Optional[float] = None, **ignored
                         ) -> Tuple[torch.Tensor, Metrics]:
    """REINFORCE per token: -A * logp (clip arguments ignored; clip fractions are 0).
    approx_kl is still reported against old_logp when given."""
    dtype = acc_dtype(logp, advantages)
    m = mask != 0
    lp = upcast(logp, dtype)
    adv = _token_adv(advantages, m, dtype)  # [N, T]
    loss_mat = torch.where(m, -adv * lp, 0.0)  # [N, T]
    log_ratio = (torch.zeros_like(lp) if old_logp is None
                 else _log_ratio(lp, old_logp, m))  # [N, T]
    never = torch.zeros_like(m)
    return loss_mat, _clip_metrics(log_ratio, mask, never, never)


@register_policy_loss("gspo")
def gspo_per_token(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                   mask: torch.Tensor, clip_low: float = 3e-4, clip_high: float = 4e-4,
                   clip_ratio_c: Optional[float] = None) -> Tuple[torch.Tensor, Metrics]:
    """GSPO-token loss per token. logp, old_logp, mask [N, T]; advantages [N] or [N, T] ->
    (loss_mat [N, T], metrics); clip fractions count every token of a clipped sequence."""
    dtype = acc_dtype(logp, old_logp, advantages)
    m = mask != 0
    lp = torch.where(m, upcast(logp, dtype), 0.0)  # [N, T]
    log_ratio = _log_ratio(lp, old_logp, m)  # [N, T]
    seq_log_ratio = masked_mean(log_ratio, mask, dim=-1).to(dtype).detach()  # [N] log s_i
    # s_{i,t} = sg[s_i] * exp(logp_t - sg[logp_t]): value s_i, d/d logp_t = s_i
    s_tok = torch.exp(seq_log_ratio[:, None] + (lp - lp.detach()))  # [N, T]
    adv = upcast(advantages, dtype).detach()
    adv = adv if adv.dim() == 1 else masked_mean(adv, mask, dim=-1).to(dtype)  # [N]
    adv = torch.where(m.any(-1), adv, 0.0)[:, None].expand(mask.shape)  # [N, T]
    loss, capped = _clipped(s_tok, adv, clip_low, clip_high, clip_ratio_c)  # [N, T]
    s = s_tok.detach()  # [N, T], s_i on every token of row i
    low = (adv < 0) & (s < 1.0 - clip_low)
    high = (adv > 0) & (s > 1.0 + clip_high)
    return torch.where(m, loss, 0.0), _clip_metrics(log_ratio, mask, low, high, capped)


@register_policy_loss("cispo")
def cispo_per_token(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.2,
                    clip_ratio_c: Optional[float] = None) -> Tuple[torch.Tensor, Metrics]:
    """CISPO loss per token: -sg[clip(rho)] * A * logp (clip_ratio_c ignored). logp,
    old_logp, mask [N, T]; advantages [N, T] or [N] -> (loss_mat [N, T], metrics)."""
    dtype = acc_dtype(logp, old_logp, advantages)
    m = mask != 0
    lp = torch.where(m, upcast(logp, dtype), 0.0)  # [N, T]
    log_ratio = _log_ratio(lp, old_logp, m)  # [N, T]
    ratio = torch.exp(log_ratio.detach())  # [N, T], no gradient
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # sg[clip(rho)]
    loss = -weight * _token_adv(advantages, m, dtype) * lp  # [N, T]
    low, high = ratio < 1.0 - clip_low, ratio > 1.0 + clip_high
    return torch.where(m, loss, 0.0), _clip_metrics(log_ratio, mask, low, high)


# by config name ("-" and "_" interchangeable) or "package.module:function"; ValueError if unknown
get_policy_loss = POLICY_LOSSES.get


# ---- value loss -------------------------------------------------------------------------
def value_loss_per_token(values: torch.Tensor, old_values: Optional[torch.Tensor],
                         returns: torch.Tensor, mask: torch.Tensor,
                         clip: float | None = None) -> Tuple[torch.Tensor, Metrics]:
    """0.5 (V - R)^2 per token, or clipped 0.5 max((V - R)^2, (V_clip - R)^2) with
    V_clip = old_V + clip(V - old_V, -clip, clip). [N, T] each -> (loss_mat [N, T],
    {"value/clip_frac"}: share of counted tokens where the clipped error is larger)."""
    dtype = acc_dtype(values, returns)
    v = upcast(values, dtype)
    ret = upcast(returns, dtype).detach()
    err = (v - ret) ** 2  # [N, T]
    if clip is None:
        loss_mat = 0.5 * err
        clip_frac = torch.zeros((), dtype=dtype, device=v.device)
    else:
        old = upcast(old_values, dtype).detach()
        v_clipped = old + (v - old).clamp(-clip, clip)  # [N, T]
        err_clipped = (v_clipped - ret) ** 2
        loss_mat = 0.5 * torch.maximum(err, err_clipped)
        # the clipped branch counts only where the clamp moved V (not a rounding of old + d)
        taken = ((v - old).abs() > clip) & (err_clipped > err)  # [N, T]
        clip_frac = masked_mean(taken.to(dtype), mask).detach()
    return torch.where(mask != 0, loss_mat, 0.0), {"value/clip_frac": clip_frac}


# ---- extra terms ------------------------------------------------------------------------
@register_loss_term("entropy")
def entropy_bonus(logp: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """-entropy per token ([N, T] -> [N, T]); masked positions are dropped by the aggregation."""
    return -entropy


def active_terms(coefs: Mapping[str, float]) -> List[Tuple[str, float, Callable]]:
    """(name, coef, fn) for each term with a non-zero coefficient, in name order."""
    return [(name, float(c), LOSS_TERMS.get(name)) for name, c in sorted(coefs.items()) if c]


# ---- KL -----------------------------------------------------------------------------------
@register_kl("k1")
def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return logp - ref_logp  # [N, T]


@register_kl("k2")
def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logp - ref_logp) ** 2  # [N, T]


@register_kl("k3")
def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    log_r = ref_logp - logp  # [N, T]
    # expm1: no cancellation near 0; the clamp removes the last rounding below 0 (k3 >= 0)
    return (torch.expm1(log_r) - log_r).clamp(min=0.0)  # [N, T]


KL_PLACEMENTS = ("in_loss", "in_reward")
# The estimator whose gradient in that placement follows a KL divergence without bias.
KL_DEFAULT_ESTIMATOR = {"in_reward": "k1", "in_loss": "k3"}
# (estimator, placement) pairs whose gradient is not what a KL penalty is meant to give.
KL_PLACEMENT_NOTES = {
    ("k1", "in_loss"): "k1 in the loss has zero expected gradient (E[grad log pi] = 0); "
                       "use k2 (grad KL(pi||ref)) or k3 (grad KL(ref||pi)) in the loss",
    ("k2", "in_reward"): "k2 in the reward gives a biased gradient of KL(pi||ref); use k1 in the reward",
    ("k3", "in_reward"): "k3 in the reward gives grad KL(pi||ref) - grad KL(ref||pi), a biased "
                         "gradient; use k1 in the reward",
}


def resolve_kl_estimator(kind: Optional[str], placement: str) -> str:
    """Canonical estimator name (None: the placement's default); ValueError if unknown."""
    if placement not in KL_PLACEMENTS:
        raise ValueError(f"unknown KL placement {placement!r}; valid: {', '.join(KL_PLACEMENTS)}")
    if kind is None:
        return KL_DEFAULT_ESTIMATOR[placement]
    return KL_ESTIMATORS.entry(kind).name


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate. logp, ref_logp [N, T] -> [N, T] float32 (float64 kept);
    differentiable in both (which gradient: docs/math.md, section 7)."""
    if kind is None:
        raise ValueError("KL estimator None: resolve it with resolve_kl_estimator(kind, placement)")
    fn = KL_ESTIMATORS.get(kind)
    dtype = acc_dtype(logp, ref_logp)
    return fn(upcast(logp, dtype), upcast(ref_logp, dtype))


@torch.no_grad()
def kl_shaped_rewards(rewards: torch.Tensor, logp: torch.Tensor, ref_logp: torch.Tensor,
                      mask: torch.Tensor, beta: float, kind: str = "k1") -> torch.Tensor:
    """-beta * kl_estimate on counted tokens plus rewards[i] on row i's last counted token
    (masked gaps allowed; an empty row gives zeros; beta = 0 reads no log-probs). rewards
    [N] (or [B, G]); logp, ref_logp, mask [N, T] -> [N, T] float32 (float64 kept)."""
    m = mask != 0  # [N, T]
    if beta == 0:       # no KL term: the log-probs are not read
        shaped = torch.zeros(m.shape, dtype=acc_dtype(logp, ref_logp), device=m.device)
    else:
        kl = kl_estimate(logp, ref_logp, kind)  # [N, T]
        shaped = torch.where(m, -beta * kl, torch.zeros_like(kl))  # [N, T]
    r = upcast(rewards, shaped.dtype).reshape(-1)  # [N]
    n, t_len = m.shape
    if r.shape[0] != n:
        raise ValueError(f"rewards hold {r.shape[0]} values but mask has {n} rows")
    if t_len == 0:
        return shaped
    pos = torch.arange(t_len, device=m.device).expand(n, t_len)  # [N, T]
    last = torch.where(m, pos, torch.full_like(pos, -1)).max(-1).values  # [N], -1: empty
    bonus = torch.where(last >= 0, r, torch.zeros_like(r))  # [N]
    return shaped.scatter_add(1, last.clamp(min=0)[:, None], bonus[:, None])  # [N, T]


class FixedKLController:
    """A constant KL coefficient with the controller interface."""

    def __init__(self, coef: float):
        self.coef = float(coef)

    def update(self, current_kl: float, n_steps: int) -> float:
        """No change; returns the coefficient."""
        return self.coef

    def state_dict(self) -> Dict[str, float]:
        return {"coef": self.coef}

    def load_state_dict(self, state: Dict[str, float]) -> None:
        self.coef = float(state["coef"])


class AdaptiveKLController(FixedKLController):
    """Ziegler et al.'s (2019) proportional controller; a non-finite KL keeps beta, the
    multiplier is floored at 0. Pure Python floats."""

    def __init__(self, init_coef: float, target: float, horizon: float):
        if not target > 0 or not horizon > 0 or not init_coef >= 0:
            raise ValueError(f"AdaptiveKLController needs init_coef >= 0, target > 0 and "
                             f"horizon > 0; got {init_coef}, {target}, {horizon}")
        super().__init__(init_coef)
        self.target, self.horizon = float(target), float(horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        """coef *= 1 + clip(current_kl / target - 1, -0.2, 0.2) * n_steps / horizon; returns it."""
        kl = float(current_kl)
        if n_steps < 0:
            raise ValueError(f"n_steps must be >= 0, got {n_steps}")
        if not math.isfinite(kl):
            return self.coef
        error = min(max(kl / self.target - 1.0, -0.2), 0.2)
        self.coef *= max(1.0 + error * n_steps / self.horizon, 0.0)
        return self.coef
