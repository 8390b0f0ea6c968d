"""The Bradley-Terry preference loss for reward models (Bradley and Terry, 1952; Ouyang et al.,
2022; docs/math.md, section 12): -log sigmoid(r_c - r_r - m) + c (r_c + r_r)^2, margin m
(Llama 2, Touvron et al., 2023), centring c (Eisenstein et al., 2023)."""
from __future__ import annotations

from typing import Dict, Optional, Tuple, Union

import torch
import torch.nn.functional as F


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
