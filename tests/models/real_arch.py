"""Small random-init models of real Hugging Face families, built locally for tests.

Nothing can be downloaded, so each family is rebuilt in miniature with what makes it
different for rlctl: its architecture class and quirks, a byte-level BPE tokenizer trained
here with the ``tokenizers`` library, the family's special tokens, chat template and
generation config (stop ids). ``build_family(name, out_dir)`` writes a directory that
``rlctl train model=hf model.name_or_path=DIR`` loads (safetensors, tokenizer,
generation_config.json).

Families (special tokens and stop ids as the real checkpoints ship them):

* ``llama``: Llama-3-Instruct. ``<|begin_of_text|>`` added by the tokenizer's post-processor
  (and written by the template), tokenizer EOS ``<|end_of_text|>`` (as Llama-3-8B-Instruct
  first shipped), no pad token, generation_config.eos_token_id = [<|end_of_text|>,
  <|eom_id|>, <|eot_id|>]; assistant turns end with ``<|eot_id|>``.
* ``qwen2``: Qwen2.5-Instruct. GQA (2 key/value heads for 4 query heads), tied
  embeddings, EOS ``<|im_end|>``, pad ``<|endoftext|>``, generation_config.eos_token_id =
  [<|im_end|>, <|endoftext|>]. The warm-up ends answers with ``<|endoftext|>``: a stop id
  that is the pad id and not the tokenizer's EOS (the shape issue 14 describes).
* ``gpt2``: absolute position embeddings (``n_positions=64``), Conv1D layers (c_attn,
  c_fc, c_proj), ``<|endoftext|>`` as BOS/EOS, no pad token. GPT-2 ships no chat template,
  so a plain "User: ... / Assistant:" one is given (chat prompts need one).
* ``gemma``: Gemma-1.1-it. ``<bos>`` added on encoding, pad ``<pad>``, EOS ``<eos>``,
  generation_config.eos_token_id = [<eos>, <end_of_turn>], turns end with
  ``<end_of_turn>``; tied embeddings, scaled embeddings, (1 + w) RMSNorm.

Each model gets a short supervised warm-up on chat-rendered sorting prompts -> sorted
digits + the family's end-of-turn token, so that it does end its answers with that
token (random weights would never stop) and stop-id handling can be observed.
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Dict, List, Optional

import torch

FAMILIES = ("llama", "qwen2", "gpt2", "gemma")
VOCAB_SIZE = 400          # 256 byte symbols + ~130 merges + special tokens
HIDDEN, LAYERS, HEADS = 64, 2, 4
WARMUP_STEPS, WARMUP_BATCH, WARMUP_LR = 150, 32, 3e-3

LLAMA_TEMPLATE = (
    "<|begin_of_text|>{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
    "<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
GPT2_TEMPLATE = (
    "{% for m in messages %}{{ 'User' if m['role'] == 'user' else m['role'] | capitalize }}: "
    "{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}")
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")

# name -> special tokens, tokenizer roles, BOS added on encoding, template, stop ids, end of turn
SPECS: Dict[str, dict] = {
    "llama": dict(
        specials=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>"],
        roles=dict(bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>"),
        add_bos=True, template=LLAMA_TEMPLATE, end="<|eot_id|>",
        stops=["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]),
    "qwen2": dict(
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        roles=dict(eos_token="<|im_end|>", pad_token="<|endoftext|>"),
        add_bos=False, template=QWEN_TEMPLATE, end="<|endoftext|>",
        stops=["<|im_end|>", "<|endoftext|>"]),
    "gpt2": dict(
        specials=["<|endoftext|>"],
        roles=dict(bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                   unk_token="<|endoftext|>"),
        add_bos=False, template=GPT2_TEMPLATE, end="<|endoftext|>", stops=["<|endoftext|>"]),
    "gemma": dict(
        specials=["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"],
        roles=dict(bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"),
        add_bos=True, template=GEMMA_TEMPLATE, end="<end_of_turn>",
        stops=["<eos>", "<end_of_turn>"]),
}


def _corpus(n: int = 400, seed: int = 0) -> List[str]:
    """Sorting prompts and answers as the sorting task writes them, plus chat words."""
    from rlctl.tasks.sorting import format_answer, format_prompt

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        digits = [rng.randrange(10) for _ in range(rng.randint(2, 6))]
        rows.append(format_prompt(digits) + " " + format_answer(sorted(digits)))
    words = ("user assistant system model User Assistant: sort the digits in ascending order "
             "You are a helpful assistant. answer")
    return rows + [words] * 20


def build_tokenizer(name: str, spec: Optional[dict] = None):
    """A byte-level BPE tokenizer trained on ``_corpus`` with the family's special tokens
    (``spec``: a ``SPECS``-style entry for a family not listed there)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    spec = spec or SPECS[name]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=spec["specials"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tk.train_from_iterator(_corpus(), trainer)
    if spec["add_bos"]:
        bos = spec["roles"]["bos_token"]
        tk.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tk.token_to_id(bos))])
    else:
        tk.post_processor = processors.ByteLevel(trim_offsets=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, clean_up_tokenization_spaces=False,
                                  model_max_length=spec.get("max_len", 64 if name == "gpt2" else 512),
                                  **spec["roles"])
    tok.chat_template = spec["template"]
    return tok


def _config(name: str, tok):
    import transformers as tf

    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id)
    vocab = len(tok)
    if name == "gpt2":
        return tf.GPT2Config(vocab_size=vocab, n_positions=64, n_embd=HIDDEN, n_layer=LAYERS,
                             n_head=HEADS, **ids)
    common = dict(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                  num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  max_position_embeddings=512, **ids)
    if name == "llama":
        return tf.LlamaConfig(num_key_value_heads=HEADS, tie_word_embeddings=False, **common)
    if name == "qwen2":
        return tf.Qwen2Config(num_key_value_heads=2, tie_word_embeddings=True, **common)
    return tf.GemmaConfig(num_key_value_heads=1, head_dim=HIDDEN // HEADS,
                          tie_word_embeddings=True, **common)


def build_model(name: str, tok, seed: int = 0):
    """The family's ``*ForCausalLM``, random init with ``seed``, and its generation config."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(_config(name, tok))
    stops = [tok.convert_tokens_to_ids(t) for t in SPECS[name]["stops"]]
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id, do_sample=False,
        eos_token_id=stops if len(stops) > 1 else stops[0])
    return model


def warmup(model, tok, name: str, seed: int = 0) -> List[float]:
    """AdamW on chat-rendered sorting prompts (task.prompt_format=chat) -> sorted digits +
    the family's end-of-turn token, loss on the answer tokens only (as rlctl.demo.tiny's
    warm-up, but ending with a token that need not be the tokenizer's EOS). Returns the
    losses."""
    from rlctl.tasks.task import render_chat
    from rlctl.tasks import build_task
    from rlctl.tasks.sorting import format_answer

    examples = build_task("sorting", num_digits=3, prompt_format="chat").train_examples()[:512]
    rows = []
    for ex in examples:
        p = tok(render_chat(tok, ex.prompt))["input_ids"]
        a = tok(format_answer(sorted(ex.fields["digits"])) + SPECS[name]["end"],
                add_special_tokens=False)["input_ids"]
        rows.append((p, a))
    width = max(len(p) + len(a) for p, a in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)             # [M, L], right-padded
    mask, labels = torch.zeros_like(ids), torch.full_like(ids, -100)
    for i, (p, a) in enumerate(rows):
        ids[i, :len(p) + len(a)] = torch.tensor(p + a)
        mask[i, :len(p) + len(a)] = 1
        labels[i, len(p):len(p) + len(a)] = torch.tensor(a)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=WARMUP_LR)
    model.train()
    losses = []
    for _ in range(WARMUP_STEPS):
        rows_ = torch.randint(len(ids), (WARMUP_BATCH,), generator=gen)
        loss = model(input_ids=ids[rows_], attention_mask=mask[rows_], labels=labels[rows_]).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    return losses


def build_family(name: str, out_dir, seed: int = 0) -> Path:
    """Build, warm up and save family ``name`` into ``out_dir`` (safetensors + tokenizer +
    generation config); returns the directory."""
    if name not in SPECS:
        raise ValueError(f"unknown family '{name}'; valid: {', '.join(FAMILIES)}")
    out = Path(out_dir)
    tok = build_tokenizer(name)
    model = build_model(name, tok, seed)
    warmup(model, tok, name, seed)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out
