"""Per-token KL estimators between the policy and the reference model.

Source: Schulman, "Approximating KL Divergence" (2020): with tokens sampled from
pi_theta and log r = ref_logp - logp,
    k1 = logp - ref_logp                         unbiased, high variance, can be < 0
    k2 = 0.5 * (logp - ref_logp)**2              biased, low variance, >= 0
    k3 = exp(ref_logp - logp) - (ref_logp - logp) - 1   unbiased, low variance, >= 0
As *values*, k1 and k3 estimate KL(pi_theta || pi_ref) on samples from pi_theta. What
their *gradients* optimise depends on where the estimate is placed (checked by exact
enumeration on a categorical in tests/core/test_kl_placement.py):

  in_reward: r_t = -beta * k_t enters the return as a constant (no gradient through k);
    the policy gradient of the penalty is E_pi[k(a) grad log pi(a)] = sum_a k(a) grad pi(a).
      k1 -> grad KL(pi || ref), exactly (the classic RLHF shaping, Ziegler et al. 2019);
      k2 -> grad E_pi[k2] - grad KL(pi || ref)        (biased);
      k3 -> grad KL(pi || ref) - grad KL(ref || pi)   (biased).
  in_loss: beta * k is added to the loss and differentiated through log pi at the sampled
    tokens; the expected gradient is E_pi[grad k(a)].
      k1 -> 0: E_pi[grad log pi] = 0, the term does nothing on average;
      k2 -> grad KL(pi || ref)          (the same direction as k1 in the reward);
      k3 -> grad KL(ref || pi)   (the reverse KL: GRPO's choice, a valid regulariser).
So k1 belongs in the reward and k2 or k3 in the loss; ``KL_DEFAULT_ESTIMATOR`` holds the
default of each placement and ``KL_PLACEMENT_NOTES`` the warning for the other pairs.

Registry: ``KL_ESTIMATORS`` (entries added with ``@register_kl(name)``), every entry
fn(logp [N, T], ref_logp [N, T]) -> [N, T]; peers' names are aliases (``KL_ALIASES``);
``kl_estimate`` also takes "package.module:function" (no placement note applies to it).

KL in the reward (`kl_shaped_rewards`): r_t = -beta * KL_t on every counted
token, plus the task reward on the last counted token; then GAE as usual.

KL coefficient controllers: the adaptive one of Ziegler et al. (2019, "Fine-Tuning
Language Models from Human Preferences", Sec. 2.2), as in TRL's and OpenRLHF's
`AdaptiveKLController`:
    e = clip(KL / target - 1, -0.2, 0.2);  beta <- beta * (1 + e * n_steps / horizon)
`current_kl` must be in the units of `target` (Ziegler: per-sequence KL, i.e. summed
over tokens, averaged over the batch); `n_steps` is the number of sequences in that
batch (summed over data-parallel ranks) and `horizon` counts sequences too, as in
Ziegler et al. and TRL: at the clip, the coefficient changes by about a factor e^(+-0.2) every
`horizon` sequences.

Departures: inputs are upcast to float32 so bf16 log-probs do not round the small
differences away; the KL estimators leave masking and aggregation to the caller.
`kl_shaped_rewards` is vectorised over ragged rows: "last token" is the last counted
one (masked gaps allowed), a row with no counted token gets all zeros, and it runs
under no_grad (its output is a reward). The adaptive controller ignores a non-finite
KL (the coefficient is kept) and floors the multiplier at 0, so the coefficient never
becomes NaN or negative.
"""
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
    """Per-token KL estimate. logp, ref_logp [N, T] -> [N, T] float32 (float64 kept).

    Differentiable in both inputs; which divergence its gradient follows depends on the
    placement (module doc): in the reward k1 gives grad KL(pi||ref) exactly and k2, k3 a
    biased gradient; in the loss k1 gives zero expected gradient, k2 grad KL(pi||ref)
    and k3 grad KL(ref||pi)."""
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
    """Ziegler et al.'s proportional controller (see module doc). Pure Python floats."""

    def __init__(self, init_coef: float, target: float, horizon: float):
        if not target > 0 or not horizon > 0 or not init_coef >= 0:
            raise ValueError(f"AdaptiveKLController needs init_coef >= 0, target > 0 and "
                             f"horizon > 0; got {init_coef}, {target}, {horizon}")
        super().__init__(init_coef)
        self.target, self.horizon = float(target), float(horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        """coef *= 1 + clip(current_kl / target - 1, -0.2, 0.2) * n_steps / horizon;
        returns the new coefficient."""
        kl = float(current_kl)
        if n_steps < 0:
            raise ValueError(f"n_steps must be >= 0, got {n_steps}")
        if not math.isfinite(kl):
            return self.coef
        error = min(max(kl / self.target - 1.0, -0.2), 0.2)
        self.coef *= max(1.0 + error * n_steps / self.horizon, 0.0)
        return self.coef
