"""The engine protocol, the ``torch`` engine and the weights format (docs/engines.md)."""
from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Protocol, Sequence, Tuple

import torch
from safetensors import safe_open
from safetensors.torch import load as st_load, save as st_save
from transformers.pytorch_utils import Conv1D

from rlctl.errors import UserError
from rlctl.models.kv_share import cache_keyword, shared_prefill
from rlctl.models.value import PolicyValueModel
from rlctl.rollout.generate import left_padded, length_groups, sample, sampling_precision
from rlctl.tasks.prompt_budget import context_length

STOP, LENGTH = "stop", "length"
KINDS = ("full", "adapter")
KIND_KEY = "rlctl.kind"
_GENERATION = threading.Lock()     # the global RNG and the model are shared by the threads


@dataclass(frozen=True)
class Sampling:
    """At most ``max_new_tokens`` tokens from softmax(logits / temperature) (0: greedy), the
    ``top_k`` largest (0: all), ending at the first of ``stop_ids`` (the complete set)."""
    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    stop_ids: Tuple[int, ...] = ()


@dataclass
class Completion:
    token_ids: List[int]
    logprobs: List[float]
    finish_reason: str              # STOP | LENGTH
    weights_version: int = 0        # the weights that sampled it


class Engine(Protocol):
    """The protocol (module docstring); engines subclass it for ``metrics`` and ``quiet``."""
    version: int

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling,
                 seed: Optional[int] = None) -> List[Completion]: ...

    def update_weights(self, version: int, tensors: Dict[str, torch.Tensor],
                       kind: str = "full", last: bool = True) -> None: ...

    def health(self) -> Dict[str, object]: ...

    def metrics(self) -> Dict[str, float]:
        """The engine's own gauges, logged with the source's metrics."""
        return {}

    def quiet(self) -> None:
        """Say nothing more (a request left behind when the run ends)."""


def check_sampling(sampling: Sampling) -> None:
    """One line (UserError) for settings no engine can honour."""
    if not isinstance(sampling.max_new_tokens, int) or sampling.max_new_tokens < 1:
        raise UserError(f"max_tokens must be an integer >= 1, got {sampling.max_new_tokens!r}")
    if not sampling.temperature >= 0:
        raise UserError(f"temperature must be >= 0 (0: greedy), got {sampling.temperature!r}")
    if not isinstance(sampling.top_k, int) or sampling.top_k < 0:
        raise UserError(f"top_k must be an integer >= 0 (0 or -1: off), got {sampling.top_k!r}")


def check_prompts(prompts, vocab_size: int) -> None:
    """Prompts must be a non-empty list of non-empty lists of token ids in [0, vocab_size)."""
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise UserError("prompt must be a non-empty list of token ids or a list of such lists")
    for i, row in enumerate(prompts):
        if not isinstance(row, (list, tuple)) or not row:
            raise UserError(f"prompt {i} is empty or not a list of token ids")
        bad = next((t for t in row if isinstance(t, bool) or not isinstance(t, int)
                    or not 0 <= t < vocab_size), None)
        if bad is not None:
            raise UserError(f"prompt {i} holds {bad!r}: token ids are integers in "
                            f"[0, {vocab_size}) for this model")


def chunk_seed(seed: Optional[int], index: int) -> Optional[int]:
    """The seed of a batch's ``index``-th request: ``seed`` for the first, a hash of (seed, index)
    for the others, so the result does not depend on which server ran it."""
    if seed is None or index == 0:
        return seed
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class TorchEngine(Engine):
    """rlctl's lean loop (``generate.sample``) in this process: the tokens ``generate`` draws
    for the same prompts, settings and seed. A seed runs in ``fork_rng``; a torch RNG state
    as the seed leaves ``rng_state`` where that stream ended (local engines)."""

    def __init__(self, model, pad_id: int, version: int = 0, share_prompts: bool = True,
                 sample_dtype: str = "float32"):
        self.model = model.policy if isinstance(model, PolicyValueModel) else model
        self.pad_id, self.version, self.share_prompts = int(pad_id), int(version), share_prompts
        self.sample_dtype = sample_dtype
        self.rng_state: Optional[torch.Tensor] = None   # after a call seeded with a state
        self.key = cache_keyword(self.model)
        if self.key is None:
            raise UserError(f"{type(self.model).__name__}'s forward takes no KV cache: the "
                            "torch engine samples with one (rlctl's lean loop)")
        self.device = next(self.model.parameters()).device
        self.vocab_size = int(self.model.get_input_embeddings().num_embeddings)
        self.context = context_length(self.model)        # None: not bounded here
        self._base: Dict[str, torch.Tensor] = {}        # weights an adapter is merged onto
        self._parts: tuple = (None, None, {})            # (version, kind, tensors) of a push in parts

    def health(self) -> Dict[str, object]:
        return {"status": "ok", "weights_version": self.version}

    def update_weights(self, version: int, tensors: Dict[str, torch.Tensor],
                       kind: str = "full", last: bool = True) -> None:
        """Full weights or a LoRA adapter's tensors (docs/engines.md), whole or in parts: a
        version's parts are held until its ``last`` one, then loaded at once (a generate
        samples from the old weights or the new, never a mix)."""
        held = self._parts[2] if self._parts[:2] == (int(version), kind) else {}
        held.update(tensors)
        self._parts = (int(version), kind, held) if not last else (None, None, {})
        if not last:
            return
        with _GENERATION:
            if kind == "full":
                load_full(self.model, held)
                self._base = {}
            elif kind == "adapter":
                load_adapter(self.model, held, self._base)
            else:
                raise UserError(f"unknown weights kind '{kind}'; valid: full, adapter")
            self.version = int(version)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling,
                 seed: Optional[int] = None) -> List[Completion]:
        check_sampling(sampling)
        check_prompts(prompts, self.vocab_size)
        longest = max(len(p) for p in prompts)
        if self.context and longest + sampling.max_new_tokens > self.context:
            raise UserError(f"a prompt of {longest} tokens + max_tokens {sampling.max_new_tokens} "
                            f"exceeds the model's context of {self.context} positions")
        with _GENERATION, _seeded(seed, self.device), sampling_precision(self.model, self.sample_dtype):
            out: List[Optional[Completion]] = [None] * len(prompts)
            for rows in length_groups(self.model, [len(p) for p in prompts]):
                for i, c in zip(rows, self._batch([prompts[i] for i in rows], sampling)):
                    out[i] = c
            if isinstance(seed, torch.Tensor):
                self.rng_state = torch.get_rng_state()
            return out

    def _batch(self, prompts, sampling: Sampling) -> List[Completion]:
        ids, mask = left_padded(prompts, self.pad_id, self.device)                 # [N, P]
        cache = shared_prefill(self.model, ids, mask) if self.share_prompts else None
        greedy = sampling.temperature == 0     # top-1 of softmax(logits): the argmax
        seqs, logp = sample(self.model, ids, mask, sampling.max_new_tokens,
                            1.0 if greedy else sampling.temperature, 1 if greedy else sampling.top_k,
                            sampling.stop_ids, self.pad_id, self.key, cache, keep_logprobs=True)
        return completions(seqs[:, ids.shape[1]:], logp, sampling.stop_ids, self.version)


def completions(new: torch.Tensor, logp: torch.Tensor, stops: Sequence[int],
                version: int) -> List[Completion]:
    """Sampled ids [N, T] and their log-probs [N, T] -> one Completion per row, cut after
    its first stop id ("stop"), else all T tokens ("length")."""
    stop_set = set(int(s) for s in stops)
    out = []
    for row, lp in zip(new.tolist(), logp.double().tolist()):
        end = next((t + 1 for t, tok in enumerate(row) if tok in stop_set), None)
        n = end if end is not None else len(row)
        out.append(Completion(row[:n], lp[:n], STOP if end is not None else LENGTH, version))
    return out


@contextlib.contextmanager
def _seeded(seed: Optional[int], device: torch.device):
    """Within: the global RNG seeded with ``seed`` (an int or a CPU RNG state), restored after."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        if isinstance(seed, torch.Tensor):
            torch.set_rng_state(seed)
        else:
            torch.manual_seed(int(seed))
        yield


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
    """A ``.safetensors`` file or a directory of them (all of one kind) -> (tensors, kind)."""
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


MANIFEST = ".rlctl-written.json"      # the directories rlctl wrote in a shared weight directory


def _written(root: Path) -> List[str]:
    try:
        return list(json.loads((root / MANIFEST).read_text()))
    except (OSError, ValueError):
        return []


def claim_version(root, name: str) -> Path:
    """``root``/``name``, recorded in root's manifest before it is written. A directory of
    that name rlctl did not write is never overwritten: UserError."""
    root, written = Path(root), _written(Path(root))
    if (root / name).exists() and name not in written:
        raise UserError(f"{root / name} exists and was not written by rlctl; rlctl never overwrites "
                        "it: move it, or choose another rollout.server.weight_dir")
    if name not in written:
        root.mkdir(parents=True, exist_ok=True)
        (root / MANIFEST).write_text(json.dumps(written + [name]))
    return root / name


def prune_versions(root, prefix: str, version: int) -> None:
    """Removes the directories rlctl wrote of pushes older than the one before ``version``."""
    root, written = Path(root), _written(Path(root))
    old = [n for n in written if n.startswith(prefix) and n[len(prefix):].isdigit()
           and int(n[len(prefix):]) < version - 1]
    for n in old:
        shutil.rmtree(root / n, ignore_errors=True)
    if old:
        (root / MANIFEST).write_text(json.dumps([n for n in written if n not in old]))


def _checked_kind(kind: str) -> str:
    if kind not in KINDS:
        raise UserError(f"weights kind '{kind}' in the metadata is unknown; valid: {', '.join(KINDS)}")
    return kind


@torch.no_grad()
def load_full(model, tensors: Dict[str, torch.Tensor]) -> None:
    """Copy every parameter from ``tensors``; nothing changes when any name or shape is off."""
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
    """Merge an adapter onto the weights in ``base`` (W0 + B @ A, W0 kept in ``base``)."""
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
