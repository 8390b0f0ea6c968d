"""SmolLM2-135M-Instruct's architecture through `rlctl train` on one GPU in bf16: seconds
per step and tokens/s, LoRA and full fine-tuning, a few steps each, printed as a table.

    python bench/gpu_real.py --tokenizer /tmp/gguf_cache/smollm2-135m-instruct   # CUDA, 5 steps each
    python bench/gpu_real.py --model DIR          # DIR's config.json (and tokenizer, if it has one)
    python bench/gpu_real.py --device cpu --steps 1                             # a smoke check

Made for a lent GPU machine with no network and little to carry: the weights (540 MB) are
not needed. The model is built here, random-init, from SmolLM2-135M-Instruct's config
(``SMOLLM2`` below, or ``--model DIR``'s config.json); a step's speed does not depend on the
weight values. A random model rarely emits its stop token, so completions run to about
``--new-tokens``: the longest step these settings allow. The tokenizer is ``--tokenizer DIR``
(else ``--model DIR``'s when it has one), else a byte-level BPE trained here on the task's
prompts with ChatML's special tokens (the model keeps its configured vocabulary, so the
embedding and LM head cost the same). The output says which weights and tokenizer it used.

Each mode is one ``rlctl train`` run (bench/common.py) on rlctl's arithmetic in words, two
digits, chat prompts: ``--prompts`` x ``--group`` completions of ``--new-tokens`` a step, GRPO,
LoRA r 8 (lr 5e-4) or full fine-tuning (lr 2e-5), ``hardware.precision=bf16`` (autocast;
fp32 weights and AdamW state) and ``rollout.sample_dtype=bfloat16``. Reported: the median
of time/rollout_s + time/update_s and of perf/tokens_per_s (counted completion tokens / step
time) over the steps after the first (the only one with ``--steps 1``), the generate and
update medians, and the run's peak RSS.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import markdown, run_rlctl  # noqa: E402

# HuggingFaceTB/SmolLM2-135M-Instruct's config.json (Llama, GQA 9/3 heads, tied embeddings)
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, head_dim=64, hidden_act="silu",
               max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
               tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]        # ids 0, 1, 2 as SmolLM2's
TASK = ["task=arithmetic", "task.style=words", "task.num_digits=2", "task.prompt_format=chat",
        "task.num_eval=16"]
MODES = {"lora": ["model.lora.enabled=true", "model.lora.r=8", "model.lora.lr=5e-4"],
         "full": ["trainer.lr=2e-5"]}


def trained_tokenizer():
    """A byte-level BPE (ChatML specials at ids 0-2) trained on the task's prompts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from rlctl.tasks.arithmetic import ArithmeticTask
    corpus = [e.prompt for e in ArithmeticTask(style="words", num_eval=16, max_train=2000)
              .train_examples()] + ["The answer is 94. You are a helpful AI assistant."]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=2000, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=SPECIALS[1], eos_token=SPECIALS[2],
                                   pad_token=SPECIALS[2], unk_token=SPECIALS[0],
                                   clean_up_tokenization_spaces=False)


def build_model_dir(args, out: Path) -> str:
    """A random-init model of the configured architecture and a tokenizer, saved as a Hugging
    Face directory ``out``; returns what was used, in words."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    config = AutoConfig.from_pretrained(args.model) if args.model else LlamaConfig(**SMOLLM2)
    tok_dir = args.tokenizer or (args.model if args.model and any(
        (Path(args.model) / f).is_file() for f in ("tokenizer.json", "tokenizer.model")) else None)
    tok = AutoTokenizer.from_pretrained(tok_dir) if tok_dir else trained_tokenizer()
    if len(tok) > config.vocab_size:
        sys.exit(f"error: the tokenizer has {len(tok)} tokens, more than the model's vocab_size "
                 f"{config.vocab_size}; give a tokenizer of this model (--tokenizer DIR)")
    if not tok.chat_template:
        tok.chat_template = CHATML
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    arch = f"{config.model_type} from {args.model}/config.json" if args.model else \
        "SmolLM2-135M-Instruct's config (in this script)"
    words = f"tokenizer {tok_dir}" if tok_dir else \
        f"a BPE tokenizer trained here ({len(tok)} tokens; no --tokenizer given)"
    n = sum(p.numel() for p in model.parameters())
    return f"random-init weights ({n / 1e6:.1f}M parameters), {arch}; {words}"


def measure(model_dir: Path, args, mode: str, work: Path) -> list:
    hardware = ["hardware=gpu"] if args.device == "cuda" else ["hardware=cpu"]
    summary, rows = run_rlctl([
        "model=hf", f"model.name_or_path={model_dir}", *TASK, *hardware, *MODES[mode],
        f"hardware.precision={args.precision}",
        f"rollout.sample_dtype={'bfloat16' if args.precision == 'bf16' else 'float32'}",
        f"trainer.steps={args.steps}", f"trainer.prompts_per_step={args.prompts}",
        f"algo.group_size={args.group}", f"rollout.max_new_tokens={args.new_tokens}",
        "trainer.eval_every=0", "trainer.checkpoint_every=0", "logger.samples.every=0",
        f"seed={args.seed}"], work, mode)
    rows = [r for r in rows if "time/update_s" in r]
    timed = rows[1:] or rows                    # the first step pays for warm-up

    def med(key):
        return statistics.median(r[key] for r in timed)
    step = statistics.median(r["time/rollout_s"] + r["time/update_s"] for r in timed)
    return [mode, f"{step:.3g}", f"{med('perf/tokens_per_s'):.4g}", f"{med('time/generate_s'):.3g}",
            f"{med('time/update_s'):.3g}", f"{summary.get('peak_rss_mb', float('nan')):.0f}",
            str(len(timed))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a directory whose config.json gives the architecture "
                    "(its weights are not read); default: SmolLM2-135M-Instruct's config")
    ap.add_argument("--tokenizer", help="a directory with the model's tokenizer files")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--modes", default="lora,full", help="comma-separated: lora, full")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes or args.steps < 1:
        sys.exit(f"error: --modes {args.modes!r} / --steps {args.steps}: modes are "
                 f"{', '.join(MODES)}, steps >= 1")
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            sys.exit("error: no CUDA device here; run with --device cpu for a smoke check")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")        # the lent machine has no network
    with tempfile.TemporaryDirectory(prefix="rlctl-gpu-real-") as tmp:
        model_dir = Path(tmp) / "model"
        used = build_model_dir(args, model_dir)
        print(f"model: {used} (speed does not depend on the weight values)", flush=True)
        print(f"device {args.device}, precision {args.precision}, {args.prompts} prompts x "
              f"{args.group} completions x {args.new_tokens} new tokens, {args.steps} steps",
              flush=True)
        table = [measure(model_dir, args, mode, Path(tmp) / "runs") for mode in modes]
    print(markdown(["mode", "s / step", "tokens / s", "generate s", "update s", "peak RSS MB",
                    "steps timed"], table))
    print(json.dumps({"device": args.device, "precision": args.precision, "rows": table}))


if __name__ == "__main__":
    main()
