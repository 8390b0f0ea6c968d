"""Tiny random-init models of the architectures people fine-tune today, built locally.

Each entry rebuilds one transformers architecture in miniature (hidden size 64, a few
layers, a ~400-token byte-level BPE vocabulary trained here as in tests/models/real_arch.py)
with its family's special tokens, chat template and stop ids, and the quirks that matter
for rlctl kept on: grouped key/value heads, tied embeddings, sliding-window layers with a
window shorter than a prompt (16 tokens), logit soft-capping, non-unit logit multipliers,
mixture-of-experts blocks, and in the hybrids the linear-attention / state-space layers
next to attention layers in the layer pattern the configuration itself derives (enough
layers that it holds an attention layer, as released checkpoints do). No weights are
downloaded and nothing is trained: ``build_arch(name, out_dir)`` writes a directory that
``rlctl train model=hf model.name_or_path=DIR`` loads, in about a second.

Architectures (``ARCHS``), with the configuration classes of transformers 5.x:

* dense: llama, qwen2, qwen3, gemma2 (sliding/full alternating, attention and final
  soft-capping), gemma3 (text: sliding and full layers), olmo2, smollm3 (no-RoPE layers),
  mistral (sliding window), phi3, gpt_neox, gpt2 (absolute positions, dropout 0.1)
* mixture of experts: qwen3_moe
* hybrids: qwen3_next (gated DeltaNet + attention every 4th layer, MoE), qwen3_5 (its text
  model: gated DeltaNet + attention every 4th layer), lfm2 (short convolutions, attention at
  layer 2 as LFM2-350M), falcon_h1 (Mamba-2 heads beside attention heads in every layer,
  muP-style multipliers), recurrent_gemma (RG-LRU, RG-LRU, local attention; logit soft cap)
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Dict

import torch

from real_arch import GPT2_TEMPLATE, QWEN_TEMPLATE, SPECS, build_tokenizer

HIDDEN, HEADS, HEAD_DIM, WINDOW = 64, 4, 16, 16

MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} "
    "[/INST]{% else %}{{ m['content'] }}</s>{% endif %}{% endfor %}")
PHI3_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
OLMO2_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
CHATML_BOS_TEMPLATE = "{{ bos_token }}" + QWEN_TEMPLATE

# family -> SPECS-style tokenizer entry (special tokens, roles, BOS on encoding, template,
# stop ids = tokenizer EOS + generation_config.eos_token_id as the released checkpoints)
TOKENIZERS: Dict[str, dict] = {
    "llama": SPECS["llama"], "qwen": SPECS["qwen2"], "gemma": SPECS["gemma"],
    "gpt2": SPECS["gpt2"],
    "neox": dict(specials=["<|endoftext|>", "<|padding|>"],
                 roles=dict(bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                            unk_token="<|endoftext|>"),
                 add_bos=False, template=GPT2_TEMPLATE, stops=["<|endoftext|>"], max_len=512),
    "olmo2": dict(specials=["<|endoftext|>", "<|pad|>"],
                  roles=dict(bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                             pad_token="<|pad|>"),
                  add_bos=False, template=OLMO2_TEMPLATE, stops=["<|endoftext|>"]),
    "smollm3": dict(specials=["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>",
                              "<|finetune_right_pad_id|>"],
                    roles=dict(bos_token="<|begin_of_text|>", eos_token="<|im_end|>",
                               pad_token="<|finetune_right_pad_id|>"),
                    add_bos=False, template=QWEN_TEMPLATE, stops=["<|im_end|>", "<|end_of_text|>"]),
    "mistral": dict(specials=["<unk>", "<s>", "</s>", "[INST]", "[/INST]"],
                    roles=dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>"),
                    add_bos=True, template=MISTRAL_TEMPLATE, stops=["</s>"]),
    "phi3": dict(specials=["<unk>", "<s>", "</s>", "<|endoftext|>", "<|assistant|>", "<|end|>",
                           "<|user|>", "<|system|>"],
                 roles=dict(bos_token="<s>", eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                            unk_token="<unk>"),
                 add_bos=False, template=PHI3_TEMPLATE,
                 stops=["<|endoftext|>", "<|assistant|>", "<|end|>"]),
    "lfm2": dict(specials=["<|pad|>", "<|startoftext|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                 roles=dict(bos_token="<|startoftext|>", eos_token="<|im_end|>", pad_token="<|pad|>"),
                 add_bos=True, template=CHATML_BOS_TEMPLATE, stops=["<|im_end|>"]),
    "falcon_h1": dict(specials=["<|pad|>", "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>",
                                "<|im_end|>"],
                      roles=dict(bos_token="<|begin_of_text|>", eos_token="<|im_end|>",
                                 pad_token="<|pad|>"),
                      add_bos=False, template=QWEN_TEMPLATE, stops=["<|im_end|>", "<|end_of_text|>"]),
}


def _attn(**kw) -> dict:
    """The attention-model fields most configurations share."""
    return dict(hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_attention_heads=HEADS,
                max_position_embeddings=512, **kw)


def _linear_attn() -> dict:
    """Gated DeltaNet sizes (Qwen3-Next, Qwen3.5): 2 key heads, 4 value heads of 16."""
    return dict(linear_conv_kernel_dim=4, linear_key_head_dim=HEAD_DIM, linear_value_head_dim=HEAD_DIM,
                linear_num_key_heads=2, linear_num_value_heads=4, head_dim=HEAD_DIM)


# name -> (tokenizer family, configuration class name, its fields but the vocabulary's ids)
ARCHS: Dict[str, tuple] = {
    "llama": ("llama", "LlamaConfig", _attn(num_hidden_layers=2, num_key_value_heads=2,
                                            tie_word_embeddings=False)),
    "qwen2": ("qwen", "Qwen2Config", _attn(num_hidden_layers=2, num_key_value_heads=2,
                                           tie_word_embeddings=True)),
    "qwen3": ("qwen", "Qwen3Config", _attn(num_hidden_layers=2, num_key_value_heads=2,
                                           head_dim=HEAD_DIM, tie_word_embeddings=True)),
    "gemma2": ("gemma", "Gemma2Config", _attn(
        num_hidden_layers=2, num_key_value_heads=2, head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM,
        sliding_window=WINDOW, final_logit_softcapping=30.0, attn_logit_softcapping=50.0)),
    "gemma3": ("gemma", "Gemma3TextConfig", _attn(
        num_hidden_layers=2, num_key_value_heads=1, head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM,
        sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])),
    "olmo2": ("olmo2", "Olmo2Config", _attn(num_hidden_layers=2, num_key_value_heads=HEADS)),
    "smollm3": ("smollm3", "SmolLM3Config", _attn(num_hidden_layers=4, num_key_value_heads=2,
                                                  tie_word_embeddings=True)),
    "mistral": ("mistral", "MistralConfig", _attn(num_hidden_layers=2, num_key_value_heads=2,
                                                  head_dim=HEAD_DIM, sliding_window=WINDOW)),
    "phi3": ("phi3", "Phi3Config", _attn(num_hidden_layers=2, num_key_value_heads=HEADS)),
    "gpt_neox": ("neox", "GPTNeoXConfig", _attn(num_hidden_layers=2)),
    "gpt2": ("gpt2", "GPT2Config", dict(n_positions=64, n_embd=HIDDEN, n_layer=2, n_head=HEADS)),
    "qwen3_moe": ("qwen", "Qwen3MoeConfig", _attn(
        num_hidden_layers=2, num_key_value_heads=2, head_dim=HEAD_DIM, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)),
    "qwen3_next": ("qwen", "Qwen3NextConfig", _attn(
        num_hidden_layers=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, **_linear_attn())),
    "qwen3_5": ("qwen", "Qwen3_5TextConfig", _attn(num_hidden_layers=4, num_key_value_heads=2,
                                                   **_linear_attn())),
    "lfm2": ("lfm2", "Lfm2Config", _attn(num_hidden_layers=4, num_key_value_heads=2,
                                         full_attn_idxs=[2], block_auto_adjust_ff_dim=False)),
    "falcon_h1": ("falcon_h1", "FalconH1Config", _attn(
        num_hidden_layers=2, num_key_value_heads=2, head_dim=HEAD_DIM, mamba_d_ssm=HIDDEN,
        mamba_n_heads=4, mamba_d_head=HEAD_DIM, mamba_n_groups=1, mamba_d_state=16,
        mamba_chunk_size=16, lm_head_multiplier=0.0390625, embedding_multiplier=5.65685)),
    "recurrent_gemma": ("gemma", "RecurrentGemmaConfig", dict(
        hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_attention_heads=HEADS,
        num_key_value_heads=1, head_dim=HEAD_DIM, lru_width=HIDDEN, num_hidden_layers=3,
        attention_window_size=WINDOW, conv1d_width=4, logits_soft_cap=30.0)),
}
HYBRIDS = ("qwen3_next", "qwen3_5", "lfm2", "falcon_h1", "recurrent_gemma")
# a layer of each hybrid's pattern that attends over the sequence (checked by the tests)
ATTENTION_LAYERS: Dict[str, Callable] = {
    "qwen3_next": lambda c: [i for i, t in enumerate(c.layer_types) if t == "full_attention"],
    "qwen3_5": lambda c: [i for i, t in enumerate(c.layer_types) if t == "full_attention"],
    "lfm2": lambda c: [i for i, t in enumerate(c.layer_types) if t == "full_attention"],
    "falcon_h1": lambda c: list(range(c.num_hidden_layers)),        # attention + Mamba in each
    "recurrent_gemma": lambda c: [i for i, t in enumerate(c.layers_block_type)
                                  if t != "linear_attention"],
}


def build_config(name: str, tok):
    """The architecture's configuration for tokenizer ``tok`` (its ids and vocabulary)."""
    import transformers

    family, cls, fields = ARCHS[name]
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id)
    return getattr(transformers, cls)(vocab_size=len(tok), **ids, **fields)


def build_arch(name: str, out_dir, seed: int = 0) -> Path:
    """Build architecture ``name`` (random init, ``seed``) with its tokenizer and generation
    config (stop ids) into ``out_dir``; returns the directory."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    if name not in ARCHS:
        raise ValueError(f"unknown architecture '{name}'; valid: {', '.join(ARCHS)}")
    family = ARCHS[name][0]
    spec = TOKENIZERS[family]
    tok = build_tokenizer(family, spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(build_config(name, tok))
    stops = [tok.convert_tokens_to_ids(t) for t in spec["stops"]]
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id,
        eos_token_id=stops if len(stops) > 1 else stops[0])
    out = Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out
