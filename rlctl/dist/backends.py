"""How the learner steps and ranks talk: the ``Backend`` hierarchy and its registry.

A ``Backend`` gives the module to call for forward passes, ``backward``, ``step`` and
reductions over data-parallel ranks; only this package touches ``torch.distributed``.
Data parallelism is exact: every rank holds whole prompt groups, each rank's loss
numerator is divided by the global normaliser, and gradients averaged over ranks are
scaled back by ``dp_loss_scale`` (= world size), so the update is the same for any N.
``BACKENDS`` (``hardware.backend``): ``torch`` and ``deepspeed`` (ZeRO 0-3; deepspeed is
imported only when it runs), each called ``cls(device, zero_stage, precision,
deepspeed_config)``.
"""
from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from safetensors.torch import load_model, save_model
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from rlctl.config.checks import read_deepspeed_config
from rlctl.registry import Registry

BACKENDS = Registry("backend")
register_backend = BACKENDS.register


def dist_env() -> Tuple[int, int]:
    """(rank, world size) from the launcher's environment (one process if unset)."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def init_process_group(backend: str = "gloo") -> None:
    """Join, once, the process group the launcher's environment describes (env://)."""
    if not dist.is_initialized():
        rank, world_size = dist_env()
        dist.init_process_group(backend, rank=rank, world_size=world_size)


class Backend:
    """Single-process plain torch; the base of the other backends."""

    name = "torch"

    def __init__(self, device: str = "cpu"):
        self.rank, self.world_size = dist_env()
        self.is_main, self.dp_loss_scale = self.rank == 0, float(self.world_size)
        self.device = torch.device(device)
        self.module = None
        self.optimizer = None
        self.scheduler = None
        self._params: List[torch.nn.Parameter] = []

    def prepare(self, model, critic, lr: float, betas, weight_decay: float, warmup_steps: int,
                max_grad_norm: float):
        """Build the optimizer (AdamW) and LR schedule for ``model`` (+ a separate critic);
        returns the module to call for training forward passes."""
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
        return model

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> torch.Tensor:
        """Average gradients over ranks, clip, step the optimizer and schedule; grad norm."""
        grads = self._params           # clip_grad_norm_ skips parameters without a gradient
        if self.world_size > 1:
            grads = [p for p in self._params if p.grad is not None]
            flat = _flatten_dense_tensors([p.grad for p in grads])   # one collective, not one per tensor
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            flat.div_(self.world_size)
            for p, g in zip(grads, _unflatten_dense_tensors(flat, [p.grad for p in grads])):
                p.grad.copy_(g)
        limit = self.max_grad_norm if self.max_grad_norm > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(grads, limit)
        if not torch.isfinite(norm):       # skip the update; the caller counts it
            self.zero_grad()
            return norm.detach()
        self.optimizer.step()
        self.scheduler.step()
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
        dist.all_reduce(out, op={"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN,
                                 "max": dist.ReduceOp.MAX}[op])
        return out.to(t.device)

    all_reduce_sum = all_reduce        # the sum, the default op

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
        if not self.is_main:
            return
        save_model(self.module, str(path / "model.safetensors"))
        if critic is not None:
            save_model(critic, str(path / "critic.safetensors"))
        torch.save(self.optimizer.state_dict(), path / "optimizer.pt")
        torch.save(self.scheduler.state_dict(), path / "scheduler.pt")

    def load_state(self, path: Path, critic=None) -> None:
        load_model(self.module, str(path / "model.safetensors"), device=str(self.device))
        if critic is not None:
            load_model(critic, str(path / "critic.safetensors"), device=str(self.device))
        self.optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
        self.scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))

    def gathered(self, module):
        """Context in which the module's weights are whole (ZeRO-3 needs it to save)."""
        return contextlib.nullcontext()

    def close(self) -> None:
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()


class BF16Autocast(torch.nn.Module):
    """``hardware.precision=bf16`` on the torch backend: the forward in ``torch.autocast(
    bfloat16)``, weights, gradients and AdamW state in the model's own dtype (the fp32 master
    weights of mixed precision, Micikevicius et al., 2018; bf16 needs no loss scaling).
    Other attributes pass through to the wrapped model."""

    def __init__(self, module: torch.nn.Module, device_type: str):
        super().__init__()
        self.module, self.device_type = module, device_type

    def forward(self, *args, **kwargs):
        with torch.autocast(self.device_type, dtype=torch.bfloat16):
            return self.module(*args, **kwargs)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["module"], name)


@register_backend("torch")
class TorchBackend(Backend):
    """Plain torch; several processes all-reduce gradients over gloo (CPU) or nccl (GPU).
    ``precision``: fp32 or bf16 (``BF16Autocast``); ``zero_stage``, ``deepspeed_config``: ignored."""

    def __init__(self, device: str = "cpu", zero_stage: int = 0, precision: str = "fp32",
                 deepspeed_config: Optional[str] = None):
        super().__init__(device)
        if precision not in ("fp32", "bf16"):
            raise ValueError(f"hardware.precision must be fp32 or bf16; got {precision!r}")
        self.precision = precision
        if self.world_size > 1:
            init_process_group("nccl" if self.device.type == "cuda" else "gloo")

    def prepare(self, model, critic, *args, **kwargs):
        """As ``Backend.prepare``; under bf16 the returned module autocasts its forward."""
        module = super().prepare(model, critic, *args, **kwargs)
        return BF16Autocast(module, self.device.type) if self.precision == "bf16" else module


def merge(base: Dict, override: Dict) -> Dict:
    """``override`` laid over ``base``, nested dicts merged key by key."""
    out = dict(base)
    for k, v in override.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@register_backend("deepspeed")
class DeepSpeedBackend(Backend):
    """DeepSpeed ZeRO 0-3. Set up for CPU too (``DS_ACCELERATOR=cpu``, a gloo group from the
    environment, no shared-memory comm op, a client torch AdamW, tiny models really
    partitioned); ZeRO-3 ``generate`` with ``synced_gpus``. Gradient accumulation is the
    caller's: ``backward`` accumulates, ``step`` averages over ranks and updates."""
    name = "deepspeed"

    def __init__(self, device: str, zero_stage: int, precision: str,
                 user_config: Optional[str] = None):
        if device == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        if "MASTER_ADDR" not in os.environ:
            os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(_free_port())
        super().__init__(device)
        import deepspeed  # heavy optional dependency (1.7 s): only when this backend runs

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        init_process_group("nccl" if self.device.type == "cuda" else "gloo")
        deepspeed.init_distributed(dist_backend="nccl" if self.device.type == "cuda" else "gloo")
        self.zero_stage, self.precision = zero_stage, precision
        self.user_config = {}
        if user_config:
            self.user_config = read_deepspeed_config(user_config)   # ConfigError naming the file
        self.engine = None

    def ds_config(self, max_grad_norm: float) -> Dict:
        """The user's JSON (if any) with what rlctl must control laid over it."""
        zero = {"stage": self.zero_stage, "overlap_comm": False}
        if self.zero_stage == 3:
            zero["stage3_param_persistence_threshold"] = 0
        must = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "managed_gradient_accumulation": False,
            "gradient_clipping": max_grad_norm if max_grad_norm > 0 else 0.0,
            "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": self.precision == "bf16"},
            "steps_per_print": 1 << 30,
            "wall_clock_breakdown": False,
        }
        base = merge({"zero_optimization": zero}, self.user_config)
        return merge(base, must)

    def prepare(self, model, critic, lr, betas, weight_decay, warmup_steps, max_grad_norm):
        import deepspeed  # heavy optional dependency: only when this backend runs

        if critic is not None:   # a separate critic trains inside the same engine
            model = _Joint(model, critic)
        super().prepare(model, None, lr, betas, weight_decay, warmup_steps, max_grad_norm)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
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
        self.engine.save_checkpoint(str(path), tag="deepspeed")

    def load_state(self, path, critic=None) -> None:
        loaded, _ = self.engine.load_checkpoint(str(path), tag="deepspeed")
        if loaded is None:
            raise ValueError(f"no DeepSpeed checkpoint in {path}")

    def gathered(self, module):
        """Context in which ZeRO-3 partitioned weights are whole on every rank."""
        import deepspeed  # heavy optional dependency: only when this backend runs

        if self.zero_stage != 3:
            return contextlib.nullcontext()
        return deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None)


class _Joint(torch.nn.Module):
    """Policy + separate critic as one module, so one DeepSpeed engine owns both."""

    def __init__(self, model, critic):
        super().__init__()
        self.model, self.critic = model, critic

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_backend(name: str, device: str, zero_stage: int = 0, precision: str = "fp32",
                  deepspeed_config: Optional[str] = None) -> Backend:
    """The backend registered as ``name`` (``hardware.backend``); ValueError if unknown."""
    return BACKENDS.get(name)(device, zero_stage, precision, deepspeed_config)
