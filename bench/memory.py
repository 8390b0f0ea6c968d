"""Peak RSS and s/step of `rlctl train` at a real vocabulary: memory that does not grow with V x T.

    .venv/bin/python bench/memory.py                      # headline: V=151936, T=128
    .venv/bin/python bench/memory.py --table              # + V in {32000, 151936} x T in {64, 256, 512}
    .venv/bin/python bench/memory.py --only 151936:128 --extra hardware.precision=bf16

The model is a 10M-parameter Llama built here (nothing downloaded): hidden 64, 2 layers,
4 heads, tied embeddings, a word-level tokenizer over the sorting task's symbols padded
with filler words to the vocabulary size (151,936 is Qwen2.5's). Random init, so no
completion stops early: every row runs to rollout.max_new_tokens, the worst case.
GRPO on 5-digit sorting, 8 prompts x 8 samples, full fine-tune, one thread, 2 steps; the
second step is timed (time/rollout_s + time/update_s from metrics.jsonl). Each config
runs `rlctl train` in its own wrapper process, whose RUSAGE_CHILDREN ru_maxrss is that
run's peak RSS alone.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from common import markdown, run_rlctl

HIDDEN, LAYERS, HEADS = 64, 2, 4


def build_model(vocab_size: int, out: Path) -> Path:
    """A LlamaForCausalLM with ``vocab_size`` tokens and its tokenizer, saved to ``out``."""
    import torch
    from tokenizers import Tokenizer, pre_tokenizers, processors
    from tokenizers.models import WordLevel
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from rlctl.demo.tiny import SPECIAL_TOKENS, SYMBOLS

    words = SPECIAL_TOKENS + SYMBOLS
    vocab = {w: i for i, w in enumerate(words + [f"w{i}" for i in range(vocab_size - len(words))])}
    tk = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", bos_token="<bos>",
                                  eos_token="<eos>", unk_token="<unk>", padding_side="left",
                                  clean_up_tokenization_spaces=False, model_max_length=1024)
    conf = LlamaConfig(vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                       num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                       max_position_embeddings=1024, tie_word_embeddings=True,
                       pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                       eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(conf)
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id, do_sample=False)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def overrides(model_dir: Path, new_tokens: int, extra) -> list:
    return ["algo=grpo", "task=sorting", "model=hf", f"model.name_or_path={model_dir}",
            "trainer.steps=2", "trainer.prompts_per_step=8", "algo.group_size=8",
            f"rollout.max_new_tokens={new_tokens}", "hardware.num_threads=1",
            "trainer.eval_every=0", "trainer.checkpoint_every=0", *extra]


def one(args) -> None:
    """Wrapper process: one `rlctl train`, then its peak RSS and the second step's time."""
    with tempfile.TemporaryDirectory() as tmp:
        summary, rows = run_rlctl(overrides(Path(args.model_dir), args.new_tokens, args.extra),
                                  Path(tmp), "mem")
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2 ** 20   # KiB -> GiB
    last = [r for r in rows if "time/update_s" in r][-1]
    print(json.dumps({"peak_gb": peak, "rollout_s": last["time/rollout_s"],
                      "update_s": last["time/update_s"], "length_mean": last.get("length/mean")}))


def measure(model_dir: Path, new_tokens: int, extra) -> dict:
    cmd = [sys.executable, __file__, "--one", "--model-dir", str(model_dir),
           "--new-tokens", str(new_tokens), *[f"--extra={e}" for e in extra]]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if proc.returncode != 0:
        raise RuntimeError((proc.stderr.strip().splitlines() or ["failed"])[-1])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--table", action="store_true", help="also V x T table")
    p.add_argument("--only", default=None, help="one config V:T")
    p.add_argument("--extra", action="append", default=[], help="an override for rlctl train")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--new-tokens", type=int, default=128, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        return one(args)
    configs = [(151936, 128)]
    if args.only:
        configs = [tuple(int(x) for x in args.only.split(":"))]
    elif args.table:
        configs += [(v, t) for v in (32000, 151936) for t in (64, 256, 512)]
    rows, models = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for v, t in configs:
            if v not in models:
                models[v] = build_model(v, Path(tmp) / f"v{v}")
            r = measure(models[v], t, args.extra)
            rows.append([f"{v:,}", str(t), f"{r['peak_gb']:.2f}", f"{r['rollout_s']:.1f}",
                         f"{r['update_s']:.1f}", f"{r['rollout_s'] + r['update_s']:.1f}"])
            print(" ".join(rows[-1]), flush=True)
    print(markdown(["vocab", "new tokens", "peak RSS GB", "rollout s", "update s", "s/step"], rows))


if __name__ == "__main__":
    main()
