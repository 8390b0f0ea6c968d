"""The backends (``BACKENDS``: torch, deepspeed, fsdp2): exact data-parallel forward, backward, step."""
from __future__ import annotations

import contextlib
import os
import re
import socket
from datetime import timedelta
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy,
                                    fully_shard)
from torch.distributed.tensor import DTensor
from safetensors.torch import load_file, load_model, save_file, save_model
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from rlctl.config.checks import read_deepspeed_config
from rlctl.errors import TrainingFault
from rlctl.registry import Registry

BACKENDS = Registry("backend")
register_backend = BACKENDS.register


@register_backend("torch")
class TorchBackend:
    """Plain torch, the base of the others: ranks all-reduce gradients over gloo (CPU) or
    nccl (GPU); ``precision`` fp32 or bf16 (``BF16Autocast``); the ZeRO arguments unused."""

    name = "torch"
    lockstep = False           # True: a forward is a collective, every rank runs the same ones

    def __init__(self, device: str = "cpu", zero_stage: int = 0, precision: str = "fp32",
                 deepspeed_config: Optional[str] = None, cpu_offload: bool = False):
        self.rank = int(os.environ.get("RANK", 0))
        self.world_size = int(os.environ.get("WORLD_SIZE", 1))
        self.is_main, self.dp_loss_scale = self.rank == 0, float(self.world_size)
        self.device = torch.device(device)
        if precision not in ("fp32", "bf16"):
            raise ValueError(f"hardware.precision must be fp32 or bf16; got {precision!r}")
        self.precision = precision
        self.module = self.optimizer = self.scheduler = None
        self._params: List[torch.nn.Parameter] = []
        if self.world_size > 1:
            self._join_group()

    def _join_group(self) -> None:
        """Join, once, the process group the launcher's environment describes (env://)."""
        if not dist.is_initialized():
            # on CUDA, gloo beside NCCL: CPU tensors (FSDP2's offloaded shards) reduce too
            dist.init_process_group("cpu:gloo,cuda:nccl" if self.device.type == "cuda" else "gloo",
                                    rank=self.rank, world_size=self.world_size)

    def prepare(self, model, critic, lr: float, betas, weight_decay: float, warmup_steps: int,
                max_grad_norm: float):
        """Build AdamW and the LR schedule for ``model`` (+ a critic) -> the module to call forward."""
        self.max_grad_norm = max_grad_norm
        extra = list(critic.parameters()) if critic is not None else []
        self._params = [p for p in list(model.parameters()) + extra if p.requires_grad]
        fused = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in self._params)
        self.optimizer = torch.optim.AdamW(self._params, lr=lr, betas=tuple(betas),
                                           weight_decay=weight_decay, fused=fused or None)
        warm = max(int(warmup_steps), 0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda i: min(1.0, (i + 1) / warm) if warm else 1.0)
        self.module = model
        self._autocast = BF16Autocast(model, self.device.type) if self.precision == "bf16" else None
        return self._autocast or model

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def _averaged(self) -> List[torch.nn.Parameter]:
        """Average the gradients over ranks; the parameters to clip."""
        grads = self._params           # clip_grad_norm_ skips parameters without a gradient
        if self.world_size > 1:
            grads = [p for p in self._params if p.grad is not None]
            flat = _flatten_dense_tensors([p.grad for p in grads])   # one collective, not one per tensor
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            flat.div_(self.world_size)
            for p, g in zip(grads, _unflatten_dense_tensors(flat, [p.grad for p in grads])):
                p.grad.copy_(g)
        return grads

    def step(self) -> torch.Tensor:
        """Average gradients over ranks, clip, step the optimizer and schedule; the grad norm
        (a plain tensor, the same on every rank)."""
        limit = self.max_grad_norm if self.max_grad_norm > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self._averaged(), limit)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm    # FSDP2: over all shards
        if torch.isfinite(norm):
            self.optimizer.step()
            self.scheduler.step()
        else:                              # skip the update; the caller counts it
            self.zero_grad()
        return norm.detach()

    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Element-wise sum / min / max over ranks: a new float tensor (float64 stays float64,
        others float32) on ``t``'s device; the collective runs on the backend's device."""
        if self.world_size == 1:
            return t
        dtype = torch.float64 if t.dtype == torch.float64 else torch.float32
        out = t.detach().to(self.device, dtype, copy=True)
        dist.all_reduce(out, op=getattr(dist.ReduceOp, op.upper()))
        return out.to(t.device)

    def all_gather_rows(self, t: torch.Tensor) -> Tuple[torch.Tensor, int]:
        """Every rank's rows (counts may differ) -> (all rows, this rank's first row index)."""
        if self.world_size == 1:
            return t, 0
        n = torch.tensor([t.shape[0]], device=self.device)     # on the backend's device:
        counts = [torch.zeros_like(n) for _ in range(self.world_size)]   # NCCL needs it
        dist.all_gather(counts, n)
        counts = [int(c) for c in counts]
        padded = torch.zeros((max(counts),) + tuple(t.shape[1:]), dtype=t.dtype, device=self.device)
        padded[: t.shape[0]] = t.detach()
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded)
        rows = torch.cat([p[:c] for p, c in zip(parts, counts)]).to(t.device)
        return rows, sum(counts[: self.rank])

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def generate_kwargs(self) -> Dict[str, object]:
        return {}

    def unwrap(self):
        """The plain module (for generate, save_pretrained)."""
        return self.module

    def save_state(self, path: Path, critic=None) -> None:
        """Weights, optimizer and schedule into ``path`` (ranks are identical: rank 0 writes)."""
        if self.is_main:
            for name, module in (("model", self.module), ("critic", critic)):
                if module is not None:
                    _save_trained(module, path / f"{name}.safetensors")
            torch.save(self.optimizer.state_dict(), path / "optimizer.pt")
            torch.save(self.scheduler.state_dict(), path / "scheduler.pt")

    def load_state(self, path: Path, critic=None) -> None:
        for name, module in (("model", self.module), ("critic", critic)):
            if module is not None:
                _load_trained(module, path / f"{name}.safetensors", str(self.device))
        self.optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
        self.scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))

    def gathered(self, module):
        """Context in which the module's weights are whole, to save (ZeRO-3 needs it); it
        yields None (save the module's own ``state_dict``) or, on rank 0, a full state dict."""
        return contextlib.nullcontext()

    def sampling(self, module):
        """Context in which ``module`` generates, each rank on its own (ZeRO-3 generates in
        step instead: ``generate_kwargs``); the learner's bf16 copies are dropped first (the
        sampler makes its own; they are made again at the next update)."""
        if getattr(self, "_autocast", None) is not None:
            self._autocast.release()
        return contextlib.nullcontext()

    def close(self) -> None:
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()

    # -- weights to the rollout engines, a bucket at a time (docs/engines.md) --
    def weight_buckets(self, module, bucket_mb: float, names: Optional[Sequence[str]] = None,
                       timeout_s: float = 300.0) -> Iterator[Dict[str, torch.Tensor]]:
        """``module``'s parameters (those in ``names``; all: None), whole, as CPU copies in dicts
        of at most ``bucket_mb`` MiB (a bigger tensor alone in its own), in the module's order.
        Every rank calls it and reads every bucket (ZeRO-3 gathers each bucket's parameters on all
        ranks); a rank not at a bucket within ``timeout_s``: TrainingFault naming it."""
        keep = None if names is None else set(names)
        bucket: List[Tuple[str, torch.nn.Parameter]] = []
        size, limit = 0, bucket_mb * 2**20
        for n, p in module.named_parameters():
            if keep is not None and n not in keep:
                continue
            nbytes = getattr(p, "ds_numel", p.numel()) * p.element_size()   # ZeRO-3: the whole count
            if bucket and size + nbytes > limit:
                yield self._gather_bucket(bucket, timeout_s)
                bucket, size = [], 0
            bucket.append((n, p))
            size += nbytes
        if bucket:
            yield self._gather_bucket(bucket, timeout_s)

    def _gather_bucket(self, bucket, timeout_s: float) -> Dict[str, torch.Tensor]:
        """One bucket's (name, parameter) pairs -> {name: whole CPU copy}, once every rank is here."""
        self._all_here(timeout_s)
        with self.gathered([p for _, p in bucket]):
            return {n: p.detach().to("cpu", copy=True) for n, p in bucket}

    def _all_here(self, timeout_s: float) -> None:
        """Wait for every rank (gloo's monitored barrier); a missing one: TrainingFault naming it."""
        if self.world_size == 1:
            return
        if getattr(self, "_gloo", None) is None:      # the monitored barrier is gloo's alone
            self._gloo = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        try:
            dist.monitored_barrier(self._gloo, timeout=timedelta(seconds=timeout_s))
        except RuntimeError as exc:
            found = re.search(r"[Rr]anks? ([\d, ]+) failed|from rank (\d+)", str(exc))
            who = (found.group(1) or found.group(2)).strip(", ") if found else "?"
            raise TrainingFault(f"rank {who} did not answer within {timeout_s:g} s (hardware."
                                f"dist_timeout_s) while the weights were gathered for the rollout "
                                f"engines (rank {self.rank} waited)") from None


class BF16Autocast(torch.nn.Module):
    """bf16 on the torch backend: the forward under autocast, weights, gradients and AdamW
    state in the model's dtype (Micikevicius et al., 2018); other attributes pass through.
    A frozen float32 ``nn.Linear`` weight (a LoRA base; not the LM head, which the fused
    head reads in its own dtype) runs as one bf16 copy, made again only when the weight
    changes: the values autocast would cast at every forward, one copy kept for backward."""

    def __init__(self, module: torch.nn.Module, device_type: str):
        super().__init__()
        self.module, self.device_type = module, device_type
        # id(weight) -> (the weight, its (version, data_ptr, device) when cast, its bf16 copy)
        self._casts: Dict[int, Tuple[torch.nn.Parameter, tuple, torch.nn.Parameter]] = {}

    def release(self) -> None:
        """Drop the bf16 copies (made again at the next forward)."""
        self._casts = {}

    def _frozen(self) -> List[Tuple[torch.nn.Module, torch.nn.Parameter]]:
        """(module, its bf16 weight) of each frozen float32 Linear, cast when new or changed."""
        modules = list(self.module.modules())
        heads = {id(m.get_output_embeddings()) for m in modules            # Hugging Face models'
                 if callable(getattr(type(m), "get_output_embeddings", None))}
        out, casts = [], {}
        for m in modules:
            w = m._parameters.get("weight") if type(m) is torch.nn.Linear and id(m) not in heads else None
            if w is None or w.requires_grad or w.dtype != torch.float32 or isinstance(w, DTensor):
                continue
            stamp = (w._version, w.data_ptr(), w.device)     # an in-place .data write: unseen
            held, when, cast = self._casts.get(id(w), (None, None, None))
            if held is not w or when != stamp:
                cast = torch.nn.Parameter(w.detach().to(torch.bfloat16), requires_grad=False)
            casts[id(w)] = (w, stamp, cast)
            out.append((m, cast))
        self._casts = casts                  # only the weights there now (replaced ones freed)
        return out

    def forward(self, *args, **kwargs):
        frozen = [(m, m._parameters["weight"], cast) for m, cast in self._frozen()]
        try:
            for m, _, cast in frozen:
                m._parameters["weight"] = cast
            with torch.autocast(self.device_type, dtype=torch.bfloat16):
                return self.module(*args, **kwargs)
        finally:
            for m, w, _ in frozen:
                m._parameters["weight"] = w

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["module"], name)


def merge(base: Dict, override: Dict) -> Dict:
    """``override`` laid over ``base``, nested dicts merged key by key."""
    out = dict(base)
    for k, v in override.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@register_backend("deepspeed")
class DeepSpeedBackend(TorchBackend):
    """DeepSpeed ZeRO 0-3, on CPU too (gloo, no shared-memory comm op, the client AdamW);
    ZeRO-3 ``generate`` with ``synced_gpus``. ``backward`` accumulates, ``step`` updates."""
    name = "deepspeed"

    def __init__(self, device: str, zero_stage: int, precision: str,
                 user_config: Optional[str] = None, cpu_offload: bool = False):
        if device == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        _group_env()
        import deepspeed  # heavy optional dependency (1.7 s): only when this backend runs

        self._ds = deepspeed
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        super().__init__(device, zero_stage, precision)
        self._join_group()
        deepspeed.init_distributed(dist_backend="nccl" if self.device.type == "cuda" else "gloo")
        self.zero_stage, self.lockstep = zero_stage, zero_stage == 3 and self.world_size > 1
        self.user_config = read_deepspeed_config(user_config) if user_config else {}
        self.engine = None

    def ds_config(self, max_grad_norm: float) -> Dict:
        """The user's JSON (if any) with what rlctl must control laid over it."""
        zero = {"stage": self.zero_stage, "overlap_comm": False}
        if self.zero_stage == 3:
            zero["stage3_param_persistence_threshold"] = 0
        must = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                "managed_gradient_accumulation": False,
                "gradient_clipping": max_grad_norm if max_grad_norm > 0 else 0.0,
                "zero_allow_untested_optimizer": True,
                "bf16": {"enabled": self.precision == "bf16"},
                "steps_per_print": 1 << 30, "wall_clock_breakdown": False}
        return merge(merge({"zero_optimization": zero}, self.user_config), must)

    def prepare(self, model, critic, lr, betas, weight_decay, warmup_steps, max_grad_norm):
        if critic is not None:   # a separate critic trains inside the same engine
            model = _Joint(model, critic)
        super().prepare(model, None, lr, betas, weight_decay, warmup_steps, max_grad_norm)
        self.engine, self.optimizer, _, self.scheduler = self._ds.initialize(
            model=model, optimizer=self.optimizer, lr_scheduler=self.scheduler,
            config=self.ds_config(max_grad_norm))
        self.module = self.engine
        return self.engine

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    def step(self) -> torch.Tensor:
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return torch.as_tensor(0.0 if norm is None else float(norm))

    def lr(self) -> float:
        return self.engine.get_lr()[0]

    def generate_kwargs(self):
        return {"synced_gpus": True} if self.zero_stage == 3 and self.world_size > 1 else {}

    def unwrap(self):
        inner = self.engine.module
        return inner.model if isinstance(inner, _Joint) else inner

    def save_state(self, path, critic=None) -> None:
        """Every rank writes its partition through the engine (critic included)."""
        self.engine.save_checkpoint(str(path), tag="deepspeed",
                                    exclude_frozen_parameters=_has_frozen(self.engine.module))

    def load_state(self, path, critic=None) -> None:
        partial = _has_frozen(self.engine.module)    # frozen weights left out: trainable ones checked
        loaded, _ = self.engine.load_checkpoint(
            str(path), tag="deepspeed", load_module_strict=not partial,
            custom_load_fn=(lambda src, dst: _load_partial(dst, src, "the DeepSpeed checkpoint"))
            if partial else None)
        if loaded is None:
            raise ValueError(f"no DeepSpeed checkpoint in {path}")

    def gathered(self, module):
        """Context in which ZeRO-3 partitioned weights (a module's, or a list) are whole on every rank."""
        if self.zero_stage != 3:
            return contextlib.nullcontext()
        params = list(module.parameters()) if isinstance(module, torch.nn.Module) else list(module)
        return self._ds.zero.GatheredParameters(params, modifier_rank=None)


def _has_frozen(module) -> bool:
    return not all(p.requires_grad for p in module.parameters())


def _save_trained(module, file: Path) -> None:
    """The module's weights; only its trainable ones when some are frozen (a LoRA run: the
    adapters and value head; the frozen base is reloaded from the run's config on resume)."""
    if not _has_frozen(module):
        return save_model(module, str(file))
    save_file({n: p.detach().contiguous() for n, p in module.named_parameters() if p.requires_grad},
              str(file))


def _load_trained(module, file: Path, device: str) -> None:
    """Load what ``_save_trained`` wrote; ValueError if a trainable weight is not in the file."""
    if not _has_frozen(module):
        return load_model(module, str(file), device=device)
    _load_partial(module, load_file(str(file), device=device), file.name)


def _load_partial(module, state: dict, what: str) -> None:
    """``state`` into ``module``, which may leave out frozen weights only; else ValueError."""
    missing, unexpected = module.load_state_dict(state, strict=False)
    lost = sorted({n for n, p in module.named_parameters() if p.requires_grad} & set(missing))
    if lost or unexpected:
        raise ValueError(f"{what} does not match the model: missing {lost[:3]}, "
                         f"unexpected {unexpected[:3]}")


class _Joint(torch.nn.Module):
    """Policy + separate critic as one module, so one DeepSpeed engine owns both."""

    def __init__(self, model, critic):
        super().__init__()
        self.model, self.critic = model, critic

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)


@register_backend("fsdp2")
class FSDP2Backend(TorchBackend):
    """PyTorch FSDP2: ``fully_shard`` on each decoder layer (the classes the models name in
    ``_no_split_modules``) and on the root, weights as DTensors sharded over the ranks (the
    policy, a separate critic each its own root); ``precision`` bf16 through
    ``MixedPrecisionPolicy`` (float32 reduction), ``cpu_offload`` through ``CPUOffloadPolicy``.
    A sharded forward is a collective: ranks generate in ``sampling`` (weights whole)."""
    name = "fsdp2"

    def __init__(self, device: str, zero_stage: int = 0, precision: str = "fp32",
                 deepspeed_config: Optional[str] = None, cpu_offload: bool = False):
        _group_env()
        super().__init__(device, zero_stage, precision)
        self._join_group()
        self.lockstep, self.cpu_offload = self.world_size > 1, cpu_offload
        self._roots: List[torch.nn.Module] = []

    def prepare(self, model, critic, lr, betas, weight_decay, warmup_steps, max_grad_norm):
        mp = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if self.precision == "bf16" \
            else MixedPrecisionPolicy()
        offload = CPUOffloadPolicy(pin_memory=self.device.type == "cuda") if self.cpu_offload \
            else OffloadPolicy()
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        self._roots = [m for m in (model, critic) if m is not None]
        for root in self._roots:
            names = {n for m in root.modules() for n in (getattr(m, "_no_split_modules", None) or ())}
            layers = [m for m in root.modules() if type(m).__name__ in names and m is not root]
            for m in layers[::-1] + [root]:          # inner units first
                fully_shard(m, mesh=mesh, mp_policy=mp, offload_policy=offload)
        super().prepare(model, critic, lr, betas, weight_decay, warmup_steps, max_grad_norm)
        return model                        # (no autocast wrapper: the policy casts)

    def _averaged(self) -> List[torch.nn.Parameter]:
        return self._params                 # reduce-scattered (averaged) in the backward

    def _units(self, module) -> List[torch.nn.Module]:
        return [m for m in module.modules() if isinstance(m, FSDPModule)] if module is not None else []

    @contextlib.contextmanager
    def sampling(self, module):
        """Within: ``module``'s weights whole on every rank (all-gathered once, kept through
        forwards), so ranks may run different forwards; sharded again after."""
        units = self._units(module)
        for root in self._roots:        # as a forward through it would: the roots known first
            fully_shard.state(root)._lazy_init()     # (generation may call a submodule)
        for m in units:
            m.set_reshard_after_forward(False, recurse=False)
            m.unshard()
        try:
            yield
        finally:
            for m in units:
                m.reshard()
                m.set_reshard_after_forward(m not in self._roots, recurse=False)

    @contextlib.contextmanager
    def gathered(self, module):
        """Yields ``module``'s full state dict on rank 0 (on the CPU, gathered once; {} on
        the others; None for a module that is not sharded)."""
        if not self._units(module):
            yield None
            return
        yield get_model_state_dict(module, options=StateDictOptions(full_state_dict=True,
                                                                    cpu_offload=True))

    def _gather_bucket(self, bucket, timeout_s: float) -> Dict[str, torch.Tensor]:
        """One bucket's parameters whole: each DTensor's shards all-gathered (on every rank)."""
        self._all_here(timeout_s)
        return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().to("cpu", copy=True)
                for n, p in bucket}

    def _state(self, critic) -> Tuple[torch.nn.Module, StateDictOptions]:
        return _Joint(self.module, critic), StateDictOptions(ignore_frozen_params=True)

    def save_state(self, path: Path, critic=None) -> None:
        """Every rank writes its shards (model, critic, AdamW) with torch.distributed.checkpoint."""
        joint, opts = self._state(critic)
        model, optim = get_state_dict(joint, self.optimizer, options=opts)
        dcp.save({"model": model, "optim": optim}, checkpoint_id=str(path / "fsdp2"))
        if self.is_main:
            torch.save(self.scheduler.state_dict(), path / "scheduler.pt")

    def load_state(self, path: Path, critic=None) -> None:
        """What ``save_state`` wrote, resharded to this world size by DCP."""
        joint, opts = self._state(critic)
        model, optim = get_state_dict(joint, self.optimizer, options=opts)
        state = {"model": model, "optim": optim}
        dcp.load(state, checkpoint_id=str(path / "fsdp2"))
        set_state_dict(joint, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=opts)
        self.scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))

    def close(self) -> None:
        if dist.is_initialized():          # one process too: fully_shard needs a group
            dist.destroy_process_group()


def _group_env() -> None:
    """A one-process group's environment where no launcher set one (a free loopback port)."""
    for key, value in (("LOCAL_RANK", "0"), ("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    if "MASTER_ADDR" not in os.environ:
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(_free_port())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_backend(name: str, device: str, zero_stage: int = 0, precision: str = "fp32",
                  deepspeed_config: Optional[str] = None, cpu_offload: bool = False) -> TorchBackend:
    """The backend registered as ``name`` (``hardware.backend``); ValueError if unknown."""
    return BACKENDS.get(name)(device, zero_stage, precision, deepspeed_config, cpu_offload)
