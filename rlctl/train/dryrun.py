"""`rlctl train ... --dry-run`: the resident models and an estimate of the memory per rank
by the rules of docs/memory.md. Nothing is trained and no run directory is written."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForSequenceClassification

from rlctl.core.logprobs import CHUNK_ELEMENTS, KEEP_ELEMENTS, default_chunk_tokens, kept_rows
from rlctl.models.forward import fused_head
from rlctl.train.trainer import needs_old_forward
from rlctl.train.update import activation_bytes, activation_mb, even_split, needs_reference
from rlctl.models.lora import count_parameters
from rlctl.config.schema import AlgoConfig

SAMPLE_PROMPTS = 256      # training prompts tokenized for the estimate's prompt length
HALF = ("bfloat16", "float16")


def reference_held(algo) -> bool:
    """A reference model stays in memory while training (not with cached log-probs)."""
    return needs_reference(algo) and not algo.get("precompute_ref_logps", False)


@dataclass(frozen=True)
class MemorySettings:
    """What the estimate reads of five config sections and the prepared task, and derives
    (``rank_rows``)."""
    max_new_tokens: int             # rollout.max_new_tokens
    prompts_per_step: int           # trainer.prompts_per_step
    group_size: int                 # algo.group_size
    minibatches: int                # algo.minibatches
    micro_batch_size: int           # trainer.micro_batch_size (0: the minibatch)
    micro_batch_tokens: int         # trainer.micro_batch_tokens (0: no budget)
    activation_mb: int              # trainer.activation_mb as resolved (0: no limit)
    num_processes: int              # hardware.num_processes
    backend: str                    # hardware.backend
    precision: str                  # hardware.precision
    zero_stage: int                 # hardware.zero_stage (DeepSpeed only)
    dtype: str                      # model.dtype
    gradient_checkpointing: bool    # model.gradient_checkpointing
    lora: bool                      # model.lora.enabled
    reference: bool                 # a reference model held while training (needs_reference)
    prompt_tokens: int              # prompt_tokens(): the longest sampled training prompt

    @classmethod
    def from_config(cls, cfg, prompt_tokens: int) -> "MemorySettings":
        algo, tr, hw, model = cfg.algo, cfg.trainer, cfg.hardware, cfg.model
        return cls(max_new_tokens=cfg.rollout.max_new_tokens, prompts_per_step=tr.prompts_per_step,
                   group_size=algo.group_size, minibatches=algo.minibatches,
                   micro_batch_size=tr.micro_batch_size, micro_batch_tokens=tr.micro_batch_tokens,
                   activation_mb=activation_mb(tr.activation_mb, hw.device), num_processes=hw.num_processes,
                   backend=hw.backend, precision=hw.precision,
                   zero_stage=hw.zero_stage, dtype=model.dtype,
                   gradient_checkpointing=model.gradient_checkpointing, lora=model.lora.enabled,
                   reference=reference_held(algo), prompt_tokens=prompt_tokens)

    @property
    def rank_rows(self) -> int:
        """The rows (completions) of a rank's step."""
        return self.prompts_per_step * self.group_size // self.num_processes


def prompt_tokens(prepared, tokenizer) -> int:
    """Tokens of the longest of the first ``SAMPLE_PROMPTS`` prepared training prompts (after
    the chat template and the prompt budget), encoded as the sampler encodes them. The
    longest, not a percentile: a micro-batch pads every row to its longest, so one long
    prompt drawn into a step sets the whole micro-batch's length."""
    prompts = [ex.prompt for ex in prepared.train[:SAMPLE_PROMPTS]]
    return max((len(ids) for ids in tokenizer(prompts)["input_ids"]), default=0)


def micro_batch(s: MemorySettings, n: int, token_bytes: int = 0) -> Tuple[int, int]:
    """(rows, padded tokens) of the largest micro-batch of a rank's ``n`` rows (``token_bytes``:
    stored activations per token, for ``trainer.activation_mb``; 0: not applied)."""
    seq = s.prompt_tokens + s.max_new_tokens
    rows = max(1, n // s.minibatches)                        # a minibatch's rows
    if s.activation_mb and token_bytes and s.num_processes == 1:
        rows = even_split(rows, s.micro_batch_size, s.activation_mb * 2**20 // (token_bytes * seq))
    elif s.micro_batch_size:
        rows = min(rows, s.micro_batch_size)
    if s.micro_batch_tokens > 0:
        rows = max(1, min(rows, s.micro_batch_tokens // seq))
    return rows, rows * seq


def token_bytes(s: MemorySettings, hidden: int, layers: int) -> int:
    """Stored activations per token (2 bytes a value under bf16 or 16-bit weights, else 4)."""
    return activation_bytes(hidden, layers, s.precision == "bf16" or s.dtype in HALF,
                            s.gradient_checkpointing)


def memory_estimate(s: MemorySettings, trainable: int, total: int, hidden: int, layers: int,
                    vocab: int = 0, fused: bool = True, reward_model_bytes: float = 0.0
                    ) -> Dict[str, float]:
    """Bytes per rank by component (``fused``: log-probs from hidden states in chunks)."""
    world = s.num_processes
    deepspeed_bf16 = s.backend == "deepspeed" and s.precision == "bf16"
    b = 2 if deepspeed_bf16 or s.dtype in HALF else 4              # weights and gradients
    stage = {"deepspeed": s.zero_stage, "fsdp2": 3}.get(s.backend, 0)    # FSDP2 shards as ZeRO-3
    # AdamW's two moments: in the weights' dtype on the torch backend; DeepSpeed bf16 keeps
    # them and an fp32 master copy in fp32
    adam = trainable * (8 + 4 if deepspeed_bf16 else 2 * b)
    out = {
        "weights": total * b / (world if stage >= 3 else 1),
        "gradients": trainable * b / (world if stage >= 2 else 1),
        "optimizer state": adam / (world if stage >= 1 else 1),
        "reference model": total * b if s.reference and not s.lora else 0.0,
    }
    if s.backend == "fsdp2":              # generation runs on the weights whole, in the compute dtype
        out["weights gathered to generate"] = total * (2 if s.precision == "bf16" else b)
    if reward_model_bytes:
        out["reward model(s)"] = reward_model_bytes
    n = s.rank_rows
    rows, tokens = micro_batch(s, n, token_bytes(s, hidden, layers))
    out["activations (rough)"] = float(token_bytes(s, hidden, layers)) * tokens
    out["generation KV cache"] = 2.0 * layers * n * (s.prompt_tokens + s.max_new_tokens) * hidden * b
    # fused: two chunk buffers, the sampler's last logits, the first chunks kept for backward
    kept = kept_rows(rows * s.max_new_tokens, vocab, default_chunk_tokens(vocab), KEEP_ELEMENTS)
    out["logits"] = (2.0 * CHUNK_ELEMENTS + n * vocab + kept * vocab) * 4 if fused else \
        4.0 * tokens * vocab * 4
    return out


def reward_model_sizes(learned) -> List[Tuple[str, int, float]]:
    """(name, parameters, bytes) of each reward model of ``learned``, built on the meta device."""
    out = []
    for m in (learned.models if learned is not None else []):
        with torch.device("meta"):
            skeleton = AutoModelForSequenceClassification.from_config(m.config)
        params = sum(p.numel() for p in skeleton.parameters())
        dtype = getattr(m.config, "dtype", None) or getattr(m.config, "torch_dtype", None)
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype, torch.float32)
        size = torch.empty(0, dtype=dtype if isinstance(dtype, torch.dtype) else torch.float32
                           ).element_size()
        out.append((m.name, params, float(params * size)))
    return out


def _fused(model) -> bool:
    """Whether the learner will use the fused head for ``model`` (``fused_head``, a probe row)."""
    device = next(model.parameters()).device
    inputs = {"input_ids": torch.tensor([[0, 1]], device=device),              # [1, 2]
              "attention_mask": torch.ones((1, 2), dtype=torch.long, device=device)}
    with torch.no_grad():
        return fused_head(model, inputs) is not None


def plan(settings: MemorySettings, algo: AlgoConfig, models, learned) -> List[str]:
    """Print the resident ``models`` and the memory estimate of ``settings``; returns the lines."""
    rms = reward_model_sizes(learned)
    model, critic, _, ref = models
    policy = getattr(model, "policy", model)
    pt, ptotal = count_parameters(model)
    ct, ctotal = count_parameters(critic)
    conf = getattr(policy, "config", None)
    hidden = getattr(conf, "hidden_size", 0) or 0
    layers = getattr(conf, "num_hidden_layers", 0) or 0
    kl = reference_held(algo)
    resident = [("policy" + (" + value head" if algo.critic == "shared" else "")
                 + (" (LoRA adapter)" if settings.lora else ""), f"{ptotal:,}", f"{pt:,}")]
    if critic is not None:
        resident.append(("separate critic", f"{ctotal:,}", f"{ct:,}"))
    if kl:
        what = "adapter disabled: no copy" if ref is not None else "frozen copy of the policy"
        resident.append((f"reference ({what})", "0" if ref is not None else f"{ptotal:,}", "0"))
    for name, params, _ in rms:
        resident.append((f"reward model '{name}' (frozen)", f"{params:,}", "0"))
    passes = algo.epochs * algo.minibatches
    needs_old = needs_old_forward(algo)
    est = memory_estimate(settings, pt + ct, ptotal + ctotal, hidden, layers,
                          getattr(conf, "vocab_size", 0) or 0, _fused(model),
                          sum(size for _, _, size in rms))
    line = (f"forward passes per step: {'pairs read' if algo.get('loss_type') else 'rollout generate'}, "
            f"{'old-policy forward, ' if needs_old else ''}{'reference forward, ' if kl else ''}"
            f"{'reward-model forward, ' if rms else ''}{passes} update pass(es)")
    _print(settings, resident, est, line, micro_batch(settings, settings.rank_rows,
                                                      token_bytes(settings, hidden, layers)))
    return [line]


def _print(s: MemorySettings, resident, est: Dict[str, float], line: str,
           micro: Tuple[int, int]) -> None:
    console = Console()
    table = Table(title="rlctl dry run: resident models")
    for col in ("model", "parameters", "trainable"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for row in resident:
        table.add_row(*row)
    console.print(table)
    rows, tokens = micro
    mem = Table(title="memory per rank (estimate)",
                caption=f"{s.num_processes} rank(s), backend {s.backend}"
                        + (f", ZeRO {s.zero_stage}" if s.backend == "deepspeed" else ""))
    mem.add_column("component")
    mem.add_column("MiB", justify="right")
    for k, v in est.items():
        mem.add_row(k, f"{v / 2**20:.1f}")
    mem.add_row("total", f"{sum(est.values()) / 2**20:.1f}")
    console.print(mem)
    console.print(f"estimated with {s.dtype} weights, hardware.precision={s.precision}; "
                  f"activations of a micro-batch of {rows} row(s) x {tokens // rows} tokens "
                  f"(prompts of {s.prompt_tokens} tokens, the longest of the first {SAMPLE_PROMPTS} "
                  f"training prompts as prepared, + {s.max_new_tokens} new)"
                  + (", gradient checkpointing" if s.gradient_checkpointing else ""),
                  soft_wrap=True)
    console.print(line, soft_wrap=True)
