"""DeepSpeed ZeRO 0-3 behind the ``Backend`` interface (the only importer of deepspeed).

Traps handled: ``DS_ACCELERATOR=cpu`` on CPU; the shared-memory comm op that
compiles for ~49 s is switched off; a client torch AdamW (no FusedAdam build);
``gradient_clipping`` always set; ``LOCAL_RANK`` set even for one process, with a gloo
group initialised from the environment (never MPI discovery); client optimizers allowed
under ZeRO; ZeRO-3 ``generate`` with ``synced_gpus=True``; tiny models really
partitioned (``stage3_param_persistence_threshold: 0``).

Gradient accumulation is caller-managed (``managed_gradient_accumulation: false``):
``backward`` only accumulates, ``step`` reduces over ranks (averaging) and updates, so a
minibatch may have any number of micro-batches.
"""
from __future__ import annotations

import contextlib
import os
import socket
from typing import Dict, Optional

import torch

from rlctl.backends.base import Backend, init_process_group, register_backend
from rlctl.config import read_deepspeed_config


def merge(base: Dict, override: Dict) -> Dict:
    out = dict(base)
    for k, v in override.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@register_backend("deepspeed")
class DeepSpeedBackend(Backend):
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
    """Policy + separate critic as one module, so one engine owns both (the trainer
    calls the critic directly; ZeRO-3's per-module hooks still gather its weights)."""

    def __init__(self, model, critic):
        super().__init__()
        self.model = model
        self.critic = critic

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
