"""The generation engine protocol, and the ``torch`` engine: rlctl's own sampler behind it.

An engine turns prompts given as token ids into completions (docs/engines.md):

    generate(prompts [[int]], Sampling, seed=None) -> [Completion] (one per prompt, in order)
    update_weights(version, tensors, kind="full"|"adapter")   the weights the next call uses
    health() -> {"status": "ok", "weights_version": int}

A ``Completion`` holds the sampled token ids up to and including the first stop id, the
log-prob of each, log softmax(logits / temperature)[token], taken before any top-k
renormalisation (the learner's definition: rollout/sampler.py), and the finish reason:
"stop" (a stop id was sampled) or "length" (``max_new_tokens`` reached). Temperature 0 is
greedy decoding; its log-probs are log softmax(logits)[token].

``TorchEngine`` runs ``rollout.sampler.sample`` in this process with the prompt sharing of
``rollout.generate`` (each distinct prompt prefilled once): for the same prompts, settings
and seed it draws the same tokens as ``generate`` (tests/rollout/test_engine.py). A seed
is applied inside ``torch.random.fork_rng``: the caller's random state is left as it was.
A seed may also be a torch CPU RNG state (``torch.get_rng_state()``): sampling starts from
it and ``rng_state`` holds the state after, so a caller that sets it back has drawn the
tokens from its own stream (a local engine at max_staleness=0: the synchronous loop).
The engine's lock serialises generation in the process (the global RNG is shared), so two
engines served from one process by threads stay reproducible.
"""
from __future__ import annotations

import contextlib
import hashlib
import threading
from dataclasses import dataclass
from typing import Dict, List, Optional, Protocol, Sequence, Tuple

import torch

from rlctl.errors import UserError
from rlctl.models.kv_share import cache_keyword, shared_prefill, state_in_modules
from rlctl.models.value import PolicyValueModel
from rlctl.rollout.generate import sample, sampling_precision
from rlctl.rollout.weights import load_adapter, load_full
from rlctl.tasks.prompt_budget import context_length

STOP, LENGTH = "stop", "length"
_GENERATION = threading.Lock()     # the global RNG and the model are shared by the threads


@dataclass(frozen=True)
class Sampling:
    """What to draw: at most ``max_new_tokens`` tokens from softmax(logits / temperature)
    (0: greedy), optionally restricted to the ``top_k`` largest (0: off), ending at the
    first of ``stop_ids`` (the complete stop set: nothing is added to it)."""
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
    version: int

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling,
                 seed: Optional[int] = None) -> List[Completion]: ...

    def update_weights(self, version: int, tensors: Dict[str, torch.Tensor],
                       kind: str = "full") -> None: ...

    def health(self) -> Dict[str, object]: ...


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
    """The seed of the ``index``-th request a batch is split into: ``seed`` itself for the
    first (a batch sent whole samples as the torch engine does with ``seed``), a hash of
    (seed, index) for the others, so the result does not depend on which server ran it."""
    if seed is None or index == 0:
        return seed
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class TorchEngine:
    """rlctl's sampler in this process. ``pad_id``: the id finished rows and left padding
    use (the tokenizer's pad id). ``share_prompts``: prefill each distinct prompt once.
    ``chunk_size``: cut a batch into requests of that many prompts, request j seeded with
    ``chunk_seed(seed, j)``, as the server engine cuts it (None: one request).
    ``sample_dtype``: the sampling forwards' precision (rollout/precision.py)."""

    def __init__(self, model, pad_id: int, version: int = 0, share_prompts: bool = True,
                 chunk_size: Optional[int] = None, sample_dtype: str = "float32"):
        self.model = model.policy if isinstance(model, PolicyValueModel) else model
        self.pad_id, self.version, self.share_prompts = int(pad_id), int(version), share_prompts
        self.chunk_size, self.sample_dtype = chunk_size, sample_dtype
        self.rng_state: Optional[torch.Tensor] = None   # after a call seeded with a state
        self.key = cache_keyword(self.model)
        if self.key is None:
            raise UserError(f"{type(self.model).__name__}'s forward takes no KV cache: the "
                            "torch engine samples with one (rlctl's lean loop)")
        self.device = next(self.model.parameters()).device
        self.vocab_size = int(self.model.get_input_embeddings().num_embeddings)
        self.context = context_length(self.model)        # None: not bounded here
        self._base: Dict[str, torch.Tensor] = {}        # weights an adapter is merged onto

    def health(self) -> Dict[str, object]:
        return {"status": "ok", "weights_version": self.version}

    def update_weights(self, version: int, tensors: Dict[str, torch.Tensor],
                       kind: str = "full") -> None:
        """Full weights (every parameter by name) or a LoRA adapter's tensors
        (rollout/weights.py: merged onto the weights served before the first adapter)."""
        with _GENERATION:
            if kind == "full":
                load_full(self.model, tensors)
                self._base = {}
            elif kind == "adapter":
                load_adapter(self.model, tensors, self._base)
            else:
                raise UserError(f"unknown weights kind '{kind}'; valid: full, adapter")
            self.version = int(version)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling,
                 seed: Optional[int] = None) -> List[Completion]:
        check_sampling(sampling)
        check_prompts(prompts, self.vocab_size)
        size = self.chunk_size or len(prompts)
        return [c for j in range(0, len(prompts), size)
                for c in self._request(prompts[j:j + size], sampling, chunk_seed(seed, j // size))]

    def _request(self, prompts, sampling: Sampling, seed: Optional[int]) -> List[Completion]:
        longest = max(len(p) for p in prompts)
        if self.context and longest + sampling.max_new_tokens > self.context:
            raise UserError(f"a prompt of {longest} tokens + max_tokens {sampling.max_new_tokens} "
                            f"exceeds the model's context of {self.context} positions")
        with _GENERATION, _seeded(seed, self.device), sampling_precision(self.model, self.sample_dtype):
            if state_in_modules(self.model) and len({len(p) for p in prompts}) > 1:
                out = self._per_length(prompts, sampling)
            else:
                out = self._batch(prompts, sampling)
            if isinstance(seed, torch.Tensor):
                self.rng_state = torch.get_rng_state()
            return out

    def _per_length(self, prompts, sampling: Sampling) -> List[Completion]:
        """A model that lets left padding reach its recurrent state (``generate``'s
        ``_per_length``): each prompt length unpadded, in order of length."""
        out: List[Optional[Completion]] = [None] * len(prompts)
        for n in sorted({len(p) for p in prompts}):
            rows = [i for i, p in enumerate(prompts) if len(p) == n]
            for i, c in zip(rows, self._batch([prompts[i] for i in rows], sampling)):
                out[i] = c
        return out

    def _batch(self, prompts, sampling: Sampling) -> List[Completion]:
        ids, mask = left_padded(prompts, self.pad_id, self.device)                 # [N, P]
        cache = shared_prefill(self.model, ids, mask) if self.share_prompts else None
        greedy = sampling.temperature == 0     # top-1 of softmax(logits): the argmax
        seqs, logp = sample(self.model, ids, mask, sampling.max_new_tokens,
                            1.0 if greedy else sampling.temperature, 1 if greedy else sampling.top_k,
                            sampling.stop_ids, self.pad_id, self.key, cache, keep_logprobs=True)
        return completions(seqs[:, ids.shape[1]:], logp, sampling.stop_ids, self.version)


def left_padded(prompts, pad_id: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Token id lists -> (ids [N, P] left-padded with ``pad_id``, attention mask [N, P]),
    as a left-padding tokenizer lays them out."""
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), P, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):] = torch.tensor(list(p), dtype=torch.long)
        mask[i, P - len(p):] = 1
    return ids.to(device), mask.to(device)


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
    """Within: the global RNG seeded with ``seed``, an int or a CPU RNG state (nothing
    changed for None); the state before is restored after."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        if isinstance(seed, torch.Tensor):
            torch.set_rng_state(seed)
        else:
            torch.manual_seed(int(seed))
        yield
