"""`rlctl train ... --dry-run`: what would be resident, and roughly how much memory per rank.

Nothing is trained and no run directory is written. The estimate counts weights,
gradients and AdamW state (two fp32 moments, plus an fp32 master copy under bf16) with
DeepSpeed ZeRO's partitioning (stage 1: optimizer state / N, 2: + gradients / N,
3: + weights / N), the reference model (a full frozen copy; none with LoRA, whose
reference is the base with the adapter disabled, nor when algo.kl.coef = 0), and a rough
activation term for one micro-batch (about 16 values per hidden unit, layer and token,
kept for backward), generation's key/value cache for a rank's rows, and the logits: with
the fused learner path (rlctl/engine/policy.py) two reused chunk buffers of
``CHUNK_ELEMENTS`` floats plus one decoding step's [n, V] logits in the sampler; on the
full-logits fallback about 4 x tokens x V floats (logits, log-softmax, their gradients).
Real peaks also include the allocator, the framework's own buffers and Python; the
README's Memory section states how far this is from measured runs.
"""
from __future__ import annotations

from typing import Dict, List

from omegaconf import DictConfig
from rich.console import Console
from rich.table import Table

from rlctl.core.logprobs import CHUNK_ELEMENTS
from rlctl.engine.build import model_from_config, quiet_libraries, task_from_config
from rlctl.engine.entries import check_entries
from rlctl.engine.policy import fused_head
from rlctl.engine.trainer import needs_old_forward
from rlctl.models.lora import count_parameters
from rlctl.rollout.sampler import check_training_sampling


def memory_estimate(cfg: DictConfig, trainable: int, total: int, hidden: int, layers: int,
                    vocab: int = 0, fused: bool = True) -> Dict[str, float]:
    """Bytes per rank by component (``fused``: log-probs from hidden states in chunks)."""
    hw, world = cfg.hardware, cfg.hardware.num_processes
    b = 2 if hw.backend == "deepspeed" and hw.precision == "bf16" else 4
    stage = hw.zero_stage if hw.backend == "deepspeed" else 0
    adam = trainable * (8 + (4 if b == 2 else 0))
    out = {
        "weights": total * b / (world if stage >= 3 else 1),
        "gradients": trainable * b / (world if stage >= 2 else 1),
        "optimizer state": adam / (world if stage >= 1 else 1),
        "reference model": 0.0 if (cfg.algo.kl.coef == 0 or cfg.model.lora.enabled) else total * b,
    }
    n = cfg.trainer.prompts_per_step * cfg.algo.group_size // world
    micro = cfg.trainer.micro_batch_size or n // cfg.algo.minibatches
    tokens = micro * (16 + cfg.rollout.max_new_tokens)   # a short prompt + the completion budget
    out["activations (rough)"] = 16.0 * tokens * hidden * layers * b
    out["generation KV cache"] = 2.0 * layers * n * (16 + cfg.rollout.max_new_tokens) * hidden * b
    out["logits"] = (2.0 * CHUNK_ELEMENTS * 4 + n * vocab * 4) if fused else 4.0 * tokens * vocab * 4
    return out


def dry_run(cfg: DictConfig) -> List[str]:
    """Build the models as `train` would, print the plan; returns the printed lines."""


    quiet_libraries(cfg)
    check_entries(cfg)
    task_from_config(cfg)
    check_training_sampling(cfg.rollout.top_k)
    model, critic, _, ref = model_from_config(cfg)
    policy = getattr(model, "policy", model)
    pt, ptotal = count_parameters(model)
    ct, ctotal = count_parameters(critic)
    conf = getattr(policy, "config", None)
    hidden = getattr(conf, "hidden_size", 0) or 0
    layers = getattr(conf, "num_hidden_layers", 0) or 0
    kl = cfg.algo.kl.coef > 0
    resident = [("policy" + (" + value head" if cfg.algo.critic == "shared" else "")
                 + (" (LoRA adapter)" if cfg.model.lora.enabled else ""), f"{ptotal:,}", f"{pt:,}")]
    if critic is not None:
        resident.append(("separate critic", f"{ctotal:,}", f"{ct:,}"))
    if kl:
        what = "adapter disabled: no copy" if ref is not None else "frozen copy of the policy"
        resident.append((f"reference ({what})", "0" if ref is not None else f"{ptotal:,}", "0"))
    passes = cfg.algo.epochs * cfg.algo.minibatches
    needs_old = needs_old_forward(cfg.algo)
    est = memory_estimate(cfg, pt + ct, ptotal + ctotal, hidden, layers,
                          getattr(conf, "vocab_size", 0) or 0, fused_head(model) is not None)
    console = Console()
    table = Table(title="rlctl dry run: resident models")
    for col in ("model", "parameters", "trainable"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for row in resident:
        table.add_row(*row)
    console.print(table)
    mem = Table(title="memory per rank (estimate)",
                caption=f"{cfg.hardware.num_processes} rank(s), backend {cfg.hardware.backend}"
                        + (f", ZeRO {cfg.hardware.zero_stage}" if cfg.hardware.backend == "deepspeed" else ""))
    mem.add_column("component")
    mem.add_column("MiB", justify="right")
    for k, v in est.items():
        mem.add_row(k, f"{v / 2**20:.1f}")
    mem.add_row("total", f"{sum(est.values()) / 2**20:.1f}")
    console.print(mem)
    line = (f"forward passes per step: rollout generate, "
            f"{'old-policy forward, ' if needs_old else ''}{'reference forward, ' if kl else ''}"
            f"{passes} update pass(es)")
    console.print(line, soft_wrap=True)
    return [line]
