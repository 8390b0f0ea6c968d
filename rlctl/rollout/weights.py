"""Weights sent to an engine: full parameters or a LoRA adapter, as safetensors.

* full: one tensor per parameter of the served model, named as ``named_parameters()``
  names it (tied weights once; a Hugging Face ``model.safetensors`` has the same names).
  Every parameter must be present with its shape; values are cast to its dtype.
* adapter: for each adapted module M (its name in the served, unwrapped model),
  ``M.lora_A`` [r, in] and ``M.lora_B`` [out, r] with LoRA's scaling (alpha / r)
  already multiplied into B. The served weight becomes W0 + B @ A (transposed for
  transformers' ``Conv1D``), where W0 is the weight served before the first adapter of
  this base: each adapter replaces the previous one, never adds to it.

The kind travels in the safetensors metadata (``rlctl.kind``); a file without it is full
weights. ``to_bytes``/``from_bytes`` are the HTTP body of ``POST /update_weights``;
``read_dir`` reads a directory (or file) of ``*.safetensors`` for the shared-directory route.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Dict, Tuple

import torch
from safetensors import safe_open
from safetensors.torch import load as st_load, save as st_save
from transformers.pytorch_utils import Conv1D

from rlctl.errors import UserError

KINDS = ("full", "adapter")
KIND_KEY = "rlctl.kind"


def to_bytes(tensors: Dict[str, torch.Tensor], kind: str = "full") -> bytes:
    if kind not in KINDS:
        raise UserError(f"unknown weights kind '{kind}'; valid: {', '.join(KINDS)}")
    flat = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    return st_save(flat, metadata={KIND_KEY: kind})


def from_bytes(data: bytes) -> Tuple[Dict[str, torch.Tensor], str]:
    """safetensors bytes -> (tensors, kind). UserError for bytes that are not safetensors."""
    try:
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + n])
        tensors = st_load(data)
    except Exception as exc:         # json's, safetensors' and slicing errors alike
        raise UserError(f"the body is not a safetensors file ({type(exc).__name__})") from None
    kind = (header.get("__metadata__") or {}).get(KIND_KEY, "full")
    return tensors, _checked_kind(kind)


def read_dir(path: str) -> Tuple[Dict[str, torch.Tensor], str]:
    """A ``.safetensors`` file or a directory of them -> (tensors, kind); all files of a
    directory must be of one kind."""
    p = Path(path)
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
    if not p.exists() or not files:
        raise UserError(f"'{path}' is neither a .safetensors file nor a directory holding some")
    tensors, kinds = {}, set()
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as handle:
                kinds.add((handle.metadata() or {}).get(KIND_KEY, "full"))
                tensors.update({k: handle.get_tensor(k) for k in handle.keys()})
        except Exception as exc:      # safetensors raises its own error types
            raise UserError(f"cannot read {f}: {exc}") from None
    if len(kinds) > 1:
        raise UserError(f"'{path}' mixes weights kinds {sorted(kinds)}; one kind per update")
    return tensors, _checked_kind(kinds.pop())


def prune_versions(root: Path, prefix: str, version: int) -> None:
    """Removes the ``root``/<prefix><n> directories of pushes older than the one before
    ``version`` (every server has loaded a newer one; the one before may still be read)."""
    for old in Path(root).glob(prefix + "*"):
        n = old.name[len(prefix):]
        if old.is_dir() and n.isdigit() and int(n) < version - 1:
            shutil.rmtree(old, ignore_errors=True)


def _checked_kind(kind: str) -> str:
    if kind not in KINDS:
        raise UserError(f"weights kind '{kind}' in the metadata is unknown; valid: {', '.join(KINDS)}")
    return kind


@torch.no_grad()
def load_full(model, tensors: Dict[str, torch.Tensor]) -> None:
    """Copy every parameter from ``tensors``; nothing is changed when any name is
    missing, unknown or of the wrong shape."""
    params = dict(model.named_parameters())
    unknown = sorted(set(tensors) - set(params))
    missing = sorted(set(params) - set(tensors))
    if unknown or missing:
        what = f"unknown tensor '{unknown[0]}'" if unknown else f"parameter '{missing[0]}' missing"
        raise UserError(f"full weights must name every parameter of the served model: {what} "
                        f"({len(unknown)} unknown, {len(missing)} missing of {len(params)})")
    for name, p in params.items():
        if tuple(tensors[name].shape) != tuple(p.shape):
            raise UserError(f"tensor '{name}' has shape {tuple(tensors[name].shape)}; the served "
                            f"parameter has {tuple(p.shape)}")
    for name, p in params.items():
        p.copy_(tensors[name])


@torch.no_grad()
def load_adapter(model, tensors: Dict[str, torch.Tensor], base: Dict[str, torch.Tensor]) -> None:
    """Merge an adapter (module docstring) onto the weights in ``base`` (filled here with
    a copy of each adapted weight on its first adapter)."""
    modules = dict(model.named_modules())
    pairs = {}
    for key in tensors:
        name, _, part = key.rpartition(".")
        if part not in ("lora_A", "lora_B") or not isinstance(modules.get(name), (torch.nn.Linear, Conv1D)):
            raise UserError(f"adapter tensor '{key}' is not <linear module>.lora_A|lora_B of "
                            "the served model")
        pairs.setdefault(name, {})[part] = tensors[key]
    deltas = {}
    for name, ab in pairs.items():
        if set(ab) != {"lora_A", "lora_B"}:
            raise UserError(f"adapter module '{name}' needs both lora_A and lora_B")
        weight = modules[name].weight
        delta = ab["lora_B"].double() @ ab["lora_A"].double()                 # [out, in]
        if isinstance(modules[name], Conv1D):
            delta = delta.T                                                   # Conv1D: [in, out]
        if tuple(delta.shape) != tuple(weight.shape):
            raise UserError(f"adapter for '{name}' makes shape {tuple(delta.shape)}; its weight "
                            f"has {tuple(weight.shape)}")
        deltas[name] = delta
    for name in set(base) - set(deltas):        # adapted before, not now: back to W0
        modules[name].weight.copy_(base[name])
    for name, delta in deltas.items():
        weight = modules[name].weight
        w0 = base.setdefault(name, weight.detach().clone())
        weight.copy_((w0.double() + delta.to(w0.device)).to(weight.dtype))
