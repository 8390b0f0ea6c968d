"""``model.disable_dropout``: pi_old, the reference and the critic run in eval mode and the
update in train mode, so dropout would make pi / pi_old != 1 at theta = theta_old. As TRL's
``disable_dropout``, every probability is 0: dropout modules, and floats on modules and
(nested) configs named ``*dropout*``, ``*pdrop*``, ``layerdrop`` or the MoE routers' train-only
jitter (PhiMoE's ``router_jitter_noise`` is read in eval too: kept). Called before adapters
exist, so ``model.lora.dropout`` stays as configured."""
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
