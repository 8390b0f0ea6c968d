"""LoRA adapters (peft; QLoRA, Dettmers et al., 2023): base frozen, B at zero at step 0."""
from __future__ import annotations

import contextlib
import copy
import functools
import warnings
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

ALL_LINEAR = "all-linear"  # peft's shorthand: every Linear layer except the output head
LINEAR_TYPES = (nn.Linear, Conv1D)   # GPT-2 style checkpoints use transformers' Conv1D


def linear_module_names(model: nn.Module) -> List[str]:
    """Sorted leaf names of the model's Linear (and Conv1D) modules: valid targets."""
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                   if name and isinstance(m, LINEAR_TYPES)})


def _check_targets(model: nn.Module, target_modules: Union[str, Sequence[str]]) -> Any:
    targets = [str(t) for t in ([target_modules] if isinstance(target_modules, str)
                                else target_modules)]
    if targets == [ALL_LINEAR]:
        return ALL_LINEAR
    valid = linear_module_names(model)
    if ALL_LINEAR in targets:
        raise ValueError(f"LoRA target_modules: '{ALL_LINEAR}' stands alone (got {targets}); "
                         f"use [{ALL_LINEAR}] or module names from: {', '.join(valid)}")
    if not targets:
        raise ValueError("LoRA target_modules is empty; valid Linear module names: "
                         + ", ".join(valid))
    linears = [name for name, m in model.named_modules() if name and isinstance(m, LINEAR_TYPES)]
    missing = [t for t in targets
               if not any(n == t or n.endswith("." + t) for n in linears)]
    if missing:
        raise ValueError(f"LoRA target_modules {missing} not found among the model's Linear "
                         f"modules; valid: {', '.join(valid)} (or '{ALL_LINEAR}')")
    return targets


@contextlib.contextmanager
def quiet_peft():
    """peft 0.21 reads transformers' deprecated ``is_gradient_checkpointing`` (a FutureWarning on
    every wrap, not the user's to act on): silence that warning alone."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def apply_lora(model: nn.Module, r: int, alpha: int, dropout: float,
               target_modules: Union[str, Sequence[str]]):
    """``model`` as a ``PeftModel`` with fresh LoRA adapters; ValueError for a bad setting."""
    try:
        from peft import LoraConfig, PeftModel, TaskType, get_peft_model
    except ImportError:
        raise ImportError("LoRA needs peft (peft==0.21.2, a dependency of rlctl): reinstall rlctl") from None

    if isinstance(model, PeftModel):
        raise ValueError("the model already has peft adapters; apply_lora expects a plain model")
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        raise ValueError(f"invalid LoRA rank r={r!r}; must be an integer > 0")
    if alpha is None or alpha <= 0:
        raise ValueError(f"invalid LoRA alpha={alpha!r}; must be > 0")
    if dropout is None or not 0.0 <= float(dropout) < 1.0:
        raise ValueError(f"invalid LoRA dropout={dropout!r}; must be in [0, 1)")
    targets = _check_targets(model, target_modules)
    config = LoraConfig(task_type=TaskType.CAUSAL_LM, r=int(r), lora_alpha=alpha,
                        lora_dropout=float(dropout), target_modules=targets, bias="none")
    with quiet_peft():
        peft_model = get_peft_model(model, config)
    for name, p in peft_model.named_parameters():  # get_peft_model already does this
        p.requires_grad_("lora_" in name)
    lean_adapters(peft_model)
    return peft_model


def lean_adapters(model: nn.Module) -> None:
    """Each LoRA Linear of ``model`` made a ``_LeanLinear`` (in place). Outside
    autocast, with one active adapter, no variant and not merged, it computes base(x) +
    dropout(x) A^T (s B^T) with one ``addmm`` (in place without grad) instead of peft's
    product, scale and add: the same function and gradients up to rounding; else peft's."""
    from peft.tuners.lora.layer import Linear

    for m in model.modules():
        if type(m) is Linear and type(m.base_layer) is nn.Linear:
            m.__class__ = _lean_class(Linear)


def _not_plain(layer, name: str) -> bool:
    """Does the adapter need peft's own forward: a bias on B, or hooks on its modules or global
    ones (they would see outputs changed in place or miss the direct weight reads; ZeRO-3
    gathers each module's weights by such hooks)?"""
    mods = (layer, layer.base_layer, layer.lora_A[name], layer.lora_B[name])
    return layer.lora_B[name].bias is not None or any(
        m._forward_hooks or m._forward_pre_hooks for m in mods) or \
        bool(nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks)


@functools.lru_cache(maxsize=None)
def _lean_class(peft_linear: type) -> type:
    class _LeanLinear(peft_linear):          # a subclass: peft's isinstance checks still hold
        def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            names = self.active_adapters
            if args or kwargs or self.disable_adapters or self.merged or len(names) != 1 or \
                    names[0] not in self.lora_A or names[0] in self.lora_variant or \
                    x.dtype != self.lora_A[names[0]].weight.dtype or \
                    torch.is_autocast_enabled(x.device.type) or _not_plain(self, names[0]):
                return super().forward(x, *args, **kwargs)
            name = names[0]
            y = self.base_layer(x)                                          # [..., out]
            xa = self.lora_dropout[name](x).reshape(-1, x.shape[-1]) @ self.lora_A[name].weight.t()
            bs = (self.lora_B[name].weight * self.scaling[name]).t()        # [r, out]
            if not torch.is_grad_enabled():
                return y.view(-1, y.shape[-1]).addmm_(xa, bs).view(y.shape)
            return torch.addmm(y.view(-1, y.shape[-1]), xa, bs).view(y.shape)
    _LeanLinear.__module__, _LeanLinear.__qualname__ = __name__, "_LeanLinear"  # pickled by name
    return _LeanLinear


def __getattr__(name: str):
    """``_LeanLinear`` by name (unpickling a LoRA model in another process), made on first use."""
    if name == "_LeanLinear":
        from peft.tuners.lora.layer import Linear
        return _lean_class(Linear)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _as_peft(model):
    from peft import PeftModel

    for m in (model, getattr(model, "policy", None)):   # or PolicyValueModel(peft policy)
        if isinstance(m, PeftModel):
            return m
    raise TypeError(f"expected a PeftModel or a model whose .policy is one, got "
                    f"{type(model).__name__}")


class AdapterDisabledReference(nn.Module):
    """The reference policy: a ``PeftModel`` run with its adapter disabled, eval, no grad."""

    def __init__(self, peft_model):
        super().__init__()
        object.__setattr__(self, "peft_model", peft_model)   # not a submodule: no parameters

    @property
    def config(self):
        return self.peft_model.config

    def _run(self, fn, *args, **kwargs):
        m = self.peft_model
        was_training = m.training
        m.eval()
        try:
            with torch.no_grad(), m.disable_adapter():
                return fn(*args, **kwargs)
        finally:
            m.train(was_training)

    def forward(self, *args, **kwargs):
        return self._run(self.peft_model, *args, **kwargs)

    def generate(self, *args, **kwargs):
        return self._run(self.peft_model.generate, *args, **kwargs)


def reference_for(model) -> AdapterDisabledReference:
    """The adapter-disabled reference of a ``PeftModel`` or a ``PolicyValueModel`` around one."""
    return AdapterDisabledReference(_as_peft(model))


def count_parameters(model: nn.Module, *more: Optional[nn.Module]) -> Tuple[int, int]:
    """(trainable, total) parameters of ``model`` and ``more`` (None skipped), each once."""
    params = {id(p): p for m in (model, *more) if m is not None for p in m.parameters()}
    return (sum(p.numel() for p in params.values() if p.requires_grad),
            sum(p.numel() for p in params.values()))


def save_lora(model, out_dir, tokenizer=None, merged: bool = False, state_dict=None) -> Path:
    """``out_dir`` with the adapter (value head), tokenizer and if ``merged`` a merged copy
    (of the module's weights: not with a gathered ``state_dict``)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    peft_model = _as_peft(model)
    model.save_pretrained(out, state_dict=state_dict)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    if merged:
        full = copy.deepcopy(peft_model).merge_and_unload()
        full.save_pretrained(out / "merged")
        if tokenizer is not None:
            tokenizer.save_pretrained(out / "merged")
    return out
