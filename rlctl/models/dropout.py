"""``model.disable_dropout``: no train-mode randomness in the models rlctl trains or scores with.

The old log-probs (pi_old), the reference's and the critic's values are computed in eval
mode, the update in train mode. With a checkpoint's dropout (GPT-2 ships 0.1) the update
would score its tokens under a randomly thinned network, so at theta = theta_old the
ratio pi / pi_old is not 1 and the gradient belongs to another distribution than the
one sampled. ``disable_dropout`` sets every such probability to 0, as TRL's
``disable_dropout`` does for the policy, reference, value and reward models.

Transformers models read a dropout probability in three ways, and all three are zeroed:

* ``torch.nn.Dropout``-like modules (``p``);
* floats kept on a module at construction (``self.attention_dropout`` passed to the
  attention function as ``dropout=0.0 if not self.training else self.attention_dropout``,
  ``F.dropout(h, p=self.dropout, training=self.training)``, GPT-2's
  ``self.attn_dropout.p``), and LayerDrop's ``self.layerdrop``;
* the config read at forward time (Falcon's ``self.config.attention_dropout``, GPT-Neo,
  Persimmon), in the top-level config and its nested ones (``text_config``).

Names: ``*dropout*``, ``*pdrop*``, ``layerdrop``, and the MoE routers' train-only input
jitter (``jitter_noise``, ``input_jitter_noise``, ``moe_jitter_eps``). PhiMoE's
``router_jitter_noise`` is kept: its router reads it in eval mode as well.

LoRA's ``lora_dropout`` is the user's explicit ``model.lora.dropout``: the builder calls
this before the adapters exist, so it stays as configured. The saved model's config then
records the dropout it was trained with (0).
"""
from __future__ import annotations

from typing import Iterator

from torch import nn

_NAMES = ("dropout", "pdrop")                      # substrings of a dropout probability's name
_EXACT = ("layerdrop", "jitter_noise", "input_jitter_noise", "moe_jitter_eps")


def _is_rate(name: str, value) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value == 0:
        return False
    name = name.lower()
    return name in _EXACT or any(s in name for s in _NAMES)


def _configs(model: nn.Module) -> Iterator:
    """Every config object the model's modules hold, nested ones included (each once)."""
    seen, todo = set(), [getattr(m, "config", None) for m in model.modules()]
    while todo:
        conf = todo.pop()
        if conf is None or id(conf) in seen or not hasattr(conf, "to_dict"):
            continue
        seen.add(id(conf))
        yield conf
        todo.extend(v for v in vars(conf).values() if hasattr(v, "to_dict"))


def disable_dropout(model: nn.Module) -> int:
    """Set every dropout probability of ``model`` to 0 (in place); returns how many
    modules, attributes and config fields were non-zero."""
    changed = 0
    for module in model.modules():
        if isinstance(module, (nn.modules.dropout._DropoutNd, nn.AlphaDropout)) and module.p:
            module.p, changed = 0.0, changed + 1
        for name, value in list(vars(module).items()):
            if not name.startswith("_") and _is_rate(name, value):
                setattr(module, name, 0.0)
                changed += 1
    for conf in _configs(model):
        for name, value in list(vars(conf).items()):
            if not name.startswith("_") and _is_rate(name, value):
                setattr(conf, name, 0.0)
                changed += 1
    return changed
