"""Preference losses as pure torch (docs/math.md, section 12): the Bradley-Terry loss for
reward models (Bradley and Terry, 1952; Ouyang et al., 2022): -log sigmoid(r_c - r_r - m) +
c (r_c + r_r)^2, margin m (Llama 2, Touvron et al., 2023), centring c (Eisenstein et al.,
2023); and the direct preference losses of ``PREFERENCE_LOSSES`` (docs/math.md, section 15):
DPO (Rafailov et al., 2023) with cDPO's label smoothing (Mitchell, 2023), IPO (Azar et al.,
2023) and SimPO (Meng et al., 2024)."""
from __future__ import annotations

from typing import Dict, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from rlctl.registry import Registry

from .logprobs import acc_dtype

# fn(chosen, rejected, ref_chosen, ref_rejected, chosen_len, rejected_len, *, beta,
#    label_smoothing=0.0, gamma=0.0) -> (loss [P], reward_chosen [P], reward_rejected [P]);
# attribute needs_reference: False lets the caller skip the reference forward (None passed).
PREFERENCE_LOSSES = Registry("preference loss", attrs={"needs_reference": (True, False)},
                             dashes=True)
register_preference_loss = PREFERENCE_LOSSES.register
PairLoss = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def bradley_terry_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor,
                       margin: Optional[Union[float, torch.Tensor]] = None,
                       center_coef: float = 0.0) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Mean over P pairs of the loss above; scores [P] (float32 or wider), margin [P], float or
    None -> (loss, detached metrics ``accuracy`` (a tie is wrong), ``bt_loss``,
    ``center_loss`` (before ``center_coef``), ``margin`` (mean r_chosen - r_rejected))."""
    if r_chosen.shape != r_rejected.shape or r_chosen.dim() != 1:
        raise ValueError(f"r_chosen and r_rejected must both be [P]; got "
                         f"{tuple(r_chosen.shape)} and {tuple(r_rejected.shape)}")
    dtype = torch.promote_types(r_chosen.dtype, torch.float32)  # bf16 -> fp32; fp64 stays
    r_chosen, r_rejected = r_chosen.to(dtype), r_rejected.to(dtype)
    diff = r_chosen - r_rejected                                # [P]
    m = 0.0 if margin is None else margin
    if isinstance(m, torch.Tensor):
        m = m.to(diff)                                          # [P]
    bt = F.softplus(-(diff - m))                                # [P] = -log sigmoid(diff - m)
    center = (r_chosen + r_rejected) ** 2                       # [P]
    loss = bt.mean() + center_coef * center.mean()
    metrics = {"accuracy": (diff > 0).float().mean().detach(),
               "bt_loss": bt.mean().detach(), "center_loss": center.mean().detach(),
               "margin": diff.mean().detach()}
    return loss, metrics


# ---- direct preference losses (P pairs; log-probs summed over each completion's tokens) -----
def _pairs(name: str, beta: float, label_smoothing: float, gamma: float, uses: Tuple[str, ...],
           *tensors: Optional[torch.Tensor]) -> Tuple[torch.Tensor, ...]:
    """The [P] inputs in float32 (float64 kept), None kept; ValueError, one line, on a shape
    mismatch, beta <= 0, label_smoothing outside [0, 0.5) or an option ``name`` does not use."""
    if not beta > 0:
        raise ValueError(f"preference loss {name!r}: beta must be > 0, got {beta!r}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"preference loss {name!r}: label_smoothing must be in [0, 0.5), "
                         f"got {label_smoothing!r}")
    for option, value in (("label_smoothing", label_smoothing), ("gamma", gamma)):
        if value != 0 and option not in uses:
            raise ValueError(f"preference loss {name!r} does not use {option} (got {value!r}); "
                             f"set it to 0 or pick a loss that does")
    given = [t for t in tensors if t is not None]
    if any(t.dim() != 1 or t.shape != given[0].shape for t in given):
        raise ValueError(f"preference loss {name!r}: every input must be [P] of one size; got "
                         f"{[tuple(t.shape) for t in given]}")
    dtype = acc_dtype(*given)
    return tuple(None if t is None else t.to(dtype) for t in tensors)


def _smoothed_logistic(z: torch.Tensor, eps: float) -> torch.Tensor:
    """-(1 - eps) log sigmoid(z) - eps log sigmoid(-z) [P], finite for any z (F.softplus is
    not used: it turns linear past 20, off by up to 2e-9)."""
    return -(1.0 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)


@register_preference_loss("sigmoid")
def dpo_sigmoid_loss(chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor,
                     ref_rejected: torch.Tensor, chosen_len: torch.Tensor,
                     rejected_len: torch.Tensor, *, beta: float, label_smoothing: float = 0.0,
                     gamma: float = 0.0) -> PairLoss:
    """DPO (Rafailov et al., 2023): -log sigmoid(beta (log-ratio_c - log-ratio_r)), log-ratio =
    logp - ref_logp summed over the completion; eps = label_smoothing > 0 mixes in the flipped
    label (cDPO, Mitchell, 2023). All [P] -> per-pair loss, rewards beta * log-ratio (detached)."""
    if ref_chosen is None or ref_rejected is None:
        raise ValueError("preference loss 'sigmoid' needs the reference log-probs; got None")
    c, r, rc, rr = _pairs("sigmoid", beta, label_smoothing, gamma, ("label_smoothing",),
                          chosen, rejected, ref_chosen, ref_rejected)
    ratio_c, ratio_r = c - rc, r - rr                                    # [P]
    loss = _smoothed_logistic(beta * (ratio_c - ratio_r), label_smoothing)
    return loss, (beta * ratio_c).detach(), (beta * ratio_r).detach()


@register_preference_loss("ipo")
def ipo_loss(chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, chosen_len: torch.Tensor, rejected_len: torch.Tensor, *,
             beta: float, label_smoothing: float = 0.0, gamma: float = 0.0) -> PairLoss:
    """IPO (Azar et al., 2023, eq. 17, tau = beta): (h - 1 / (2 beta))^2 with h the difference
    of the per-token log-ratios (log-ratio / completion length, as TRL). All [P] -> per-pair
    loss, rewards beta * per-token log-ratio (detached)."""
    if ref_chosen is None or ref_rejected is None:
        raise ValueError("preference loss 'ipo' needs the reference log-probs; got None")
    c, r, rc, rr, lc, lr = _pairs("ipo", beta, label_smoothing, gamma, (), chosen, rejected,
                                  ref_chosen, ref_rejected, chosen_len, rejected_len)
    ratio_c = (c - rc) / lc.clamp(min=1.0)                               # [P]
    ratio_r = (r - rr) / lr.clamp(min=1.0)                               # [P]
    loss = (ratio_c - ratio_r - 1.0 / (2.0 * beta)) ** 2
    return loss, (beta * ratio_c).detach(), (beta * ratio_r).detach()


@register_preference_loss("simpo", needs_reference=False)
def simpo_loss(chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: Optional[torch.Tensor],
               ref_rejected: Optional[torch.Tensor], chosen_len: torch.Tensor,
               rejected_len: torch.Tensor, *, beta: float, label_smoothing: float = 0.0,
               gamma: float = 0.0) -> PairLoss:
    """SimPO (Meng et al., 2024): -log sigmoid(beta logp_c / |c| - beta logp_r / |r| - gamma),
    no reference (ref_* ignored), target margin gamma, label smoothing as cDPO (as TRL's CPO
    trainer). All [P] -> per-pair loss, rewards beta * logp / length (detached)."""
    c, r, lc, lr = _pairs("simpo", beta, label_smoothing, gamma, ("label_smoothing", "gamma"),
                          chosen, rejected, chosen_len, rejected_len)
    reward_c = beta * c / lc.clamp(min=1.0)                              # [P]
    reward_r = beta * r / lr.clamp(min=1.0)                              # [P]
    loss = _smoothed_logistic(reward_c - reward_r - gamma, label_smoothing)
    return loss, reward_c.detach(), reward_r.detach()
