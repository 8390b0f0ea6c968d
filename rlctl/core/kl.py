"""Per-token KL estimators between the policy and the reference model.

Source: Schulman, "Approximating KL Divergence" (2020), as summarised in seed 002
(KL penalty section): with tokens sampled from pi_theta and log r = ref_logp - logp,
    k1 = logp - ref_logp                         unbiased, high variance, can be < 0
    k2 = 0.5 * (logp - ref_logp)**2              biased, low variance, >= 0
    k3 = exp(ref_logp - logp) - (ref_logp - logp) - 1   unbiased, low variance, >= 0
All three estimate KL(pi_theta || pi_ref) on samples from pi_theta. Placement (`in_reward`
shaping vs `in_loss`) is the caller's choice; this module only computes [N, T] values.

Departure: none in the formulas; inputs are upcast to float32 so bf16 log-probs do not
round the small differences away. Masking and aggregation are left to the caller.
"""
from __future__ import annotations

from typing import Callable, Dict

import torch

from ._util import acc_dtype, upcast

__all__ = ["kl_k1", "kl_k2", "kl_k3", "kl_estimate", "KL_ESTIMATORS", "KL_ALIASES"]


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return logp - ref_logp  # [N, T]


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logp - ref_logp) ** 2  # [N, T]


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    log_r = ref_logp - logp  # [N, T]
    return torch.exp(log_r) - log_r - 1.0  # [N, T]


KL_ESTIMATORS: Dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
}

# Peers' names (verl: kl / mse / low_var_kl) accepted as aliases.
KL_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate. logp, ref_logp [N, T] -> [N, T] float32 (float64 kept)."""
    key = KL_ALIASES.get(kind, kind)
    if key not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; valid: {', '.join(sorted(KL_ESTIMATORS))}"
                         f" (aliases: {sorted(KL_ALIASES)})")
    dtype = acc_dtype(logp, ref_logp)
    return KL_ESTIMATORS[key](upcast(logp, dtype), upcast(ref_logp, dtype))
