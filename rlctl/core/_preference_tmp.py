"""TEMPORARY stand-in for the preference registry of rlctl.core.preference (branch dpoloss)."""
import torch.nn.functional as F

from rlctl.registry import Registry

PREFERENCE_LOSSES = Registry("preference loss", attrs={"needs_reference": (True, False)})


@PREFERENCE_LOSSES.register("sigmoid")
def sigmoid(chosen, rejected, ref_chosen, ref_rejected, chosen_len, rejected_len, *, beta,
            label_smoothing=0.0, gamma=0.0):
    r_c, r_r = beta * (chosen - ref_chosen), beta * (rejected - ref_rejected)
    z = r_c - r_r
    loss = -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)
    return loss, r_c.detach(), r_r.detach()
