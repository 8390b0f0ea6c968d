"""Per-token KL estimators between the policy and the reference, their placement, and the
KL-coefficient controllers (derivations: docs/math.md, section 7).

Schulman, "Approximating KL Divergence" (2020), tokens sampled from pi_theta:
    k1 = logp - ref_logp                                 unbiased, high variance
    k2 = 0.5 * (logp - ref_logp)**2                      biased, low variance, >= 0
    k3 = exp(ref_logp - logp) - (ref_logp - logp) - 1    unbiased, low variance, >= 0
The gradient each follows depends on the placement (exact enumeration in
tests/core/test_kl_placement.py):
    in_reward (r_t = -beta * k_t, no gradient through k): k1 -> grad KL(pi||ref) exactly
      (Ziegler et al. 2019); k2, k3 biased.
    in_loss (beta * k differentiated): k1 -> 0 in expectation; k2 -> grad KL(pi||ref);
      k3 -> grad KL(ref||pi) (GRPO's choice).
``KL_DEFAULT_ESTIMATOR`` holds each placement's default, ``KL_PLACEMENT_NOTES`` the
warning for the other pairs. ``KL_ESTIMATORS`` entries (``@register_kl(name)``) are
fn(logp [N, T], ref_logp [N, T]) -> [N, T]; verl's names are aliases (``KL_ALIASES``);
``kl_estimate`` also takes "package.module:function".

`kl_shaped_rewards`: r_t = -beta * KL_t on every counted token plus the task reward on the
last counted one (masked gaps allowed; an empty row gives zeros); no_grad.

`AdaptiveKLController` (Ziegler et al. 2019, Sec. 2.2; as TRL's and OpenRLHF's):
    e = clip(KL / target - 1, -0.2, 0.2);  beta <- beta * (1 + e * n_steps / horizon)
with KL per sequence (summed over tokens, averaged over the batch) and n_steps, horizon
counted in sequences (summed over ranks). A non-finite KL keeps beta; the multiplier is
floored at 0. Inputs are upcast to float32; masking and aggregation are the caller's."""
from __future__ import annotations

import math
from typing import Dict, Optional

import torch

from rlctl.registry import Registry

from ._util import acc_dtype, keep, upcast

__all__ = ["kl_k1", "kl_k2", "kl_k3", "kl_estimate", "KL_ESTIMATORS", "KL_ALIASES", "register_kl",
           "KL_PLACEMENTS", "KL_DEFAULT_ESTIMATOR", "KL_PLACEMENT_NOTES", "resolve_kl_estimator",
           "kl_shaped_rewards", "AdaptiveKLController", "FixedKLController"]


# Peers' names (verl: kl / mse / low_var_kl) accepted as aliases.
KL_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}
KL_ESTIMATORS = Registry("KL estimator", aliases=KL_ALIASES)
register_kl = KL_ESTIMATORS.register


@register_kl("k1")
def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return logp - ref_logp  # [N, T]


@register_kl("k2")
def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logp - ref_logp) ** 2  # [N, T]


@register_kl("k3")
def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    log_r = ref_logp - logp  # [N, T]
    # expm1 avoids the cancellation of exp(x) - 1 near x = 0; the clamp removes the last
    # rounding below 0 (k3 >= 0 exactly in real arithmetic; found by the property test)
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
    """Canonical estimator name (aliases mapped; an import path "package.module:function"
    is loaded and returned as given); None: the placement's default (k1 in the reward,
    k3 in the loss). Raises ValueError for unknown names."""
    if placement not in KL_PLACEMENTS:
        raise ValueError(f"unknown KL placement {placement!r}; valid: {', '.join(KL_PLACEMENTS)}")
    if kind is None:
        return KL_DEFAULT_ESTIMATOR[placement]
    return KL_ESTIMATORS.entry(kind).name


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate. logp, ref_logp [N, T] -> [N, T] float32 (float64 kept);
    differentiable in both (which gradient: module doc)."""
    if kind is None:
        raise ValueError("KL estimator None: resolve it with resolve_kl_estimator(kind, placement)")
    fn = KL_ESTIMATORS.get(kind)
    dtype = acc_dtype(logp, ref_logp)
    return fn(upcast(logp, dtype), upcast(ref_logp, dtype))


@torch.no_grad()
def kl_shaped_rewards(rewards: torch.Tensor, logp: torch.Tensor, ref_logp: torch.Tensor,
                      mask: torch.Tensor, beta: float, kind: str = "k1") -> torch.Tensor:
    """Per-token rewards: -beta * kl_estimate on counted tokens, plus rewards[i] on row
    i's last counted token. rewards [N] (or [B, G]); logp, ref_logp, mask [N, T] -> [N, T]
    float32 (float64 kept), 0 where mask == 0."""
    m = keep(mask)  # [N, T]
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
    """A constant KL coefficient with the controller interface (`coef`, `update`,
    `state_dict`, `load_state_dict`)."""

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
    """Ziegler et al.'s proportional controller (module doc). Pure Python floats."""

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
