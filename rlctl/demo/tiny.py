"""The embedded tiny model: a seeded small Llama and a word-level tokenizer, built and cached here."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import transformers
from tokenizers import Tokenizer, pre_tokenizers, processors
from tokenizers.models import WordLevel
from transformers import (GenerationConfig, LlamaConfig, LlamaForCausalLM,
                          PreTrainedTokenizerFast)

from rlctl.registry import is_import_path
from rlctl.tasks import TASKS
from rlctl.tasks.arithmetic import ArithmeticTask, spaced
from rlctl.tasks.sorting import SortingTask

log = logging.getLogger(__name__)

# Bump whenever a change here alters the built model (it is part of the cache key).
CODE_VERSION = 1

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
SYMBOLS = [str(d) for d in range(10)] + ["=", "+", "-", "*", ":"]
MAX_POSITIONS = 64
WARMUP_BATCH_SIZE = 64
WARMUP_TASK_SEED = 1234  # the default sorting task's split seed
WARMUP_SORTED_FRAC = 0.2  # share of warm-up answers that are sorted; the rest are permuted
# Warm-up tasks (model.warmup_task); any other registered task name gets the sorting warm-up.
WARMUP_TASKS = ("sorting", "arithmetic")
AGENT_TASKS = ("calculator", "guess_number", "running_sum")   # models: rlctl.demo.tiny_agents
ARITH_WARMUP = {"batch_size": 256, "correct_frac": 1.0, "steps_scale": 2.5}
# transcript segment roles after the prompt: a model turn that ends with <eos>, one cut at a
# stop string (no <eos>), an observation
MODEL, MODEL_CUT, OBS = "model", "model_cut", "obs"
TURNS = (MODEL, MODEL_CUT)
Transcript = List[Tuple[str, str]]   # [(role, text)]: ("prompt", ...), then model/obs turns


def build_tokenizer(extra_words: Sequence[str] = ()):
    """Word-level tokenizer over digits, operators and ``extra_words``; <bos> first, left pads."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + SYMBOLS + list(extra_words))}
    tk = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B:1", special_tokens=[("<bos>", vocab["<bos>"])])
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
        unk_token="<unk>", padding_side="left", clean_up_tokenization_spaces=False,
        model_max_length=MAX_POSITIONS)


def build_model(tokenizer, hidden_size: int, num_layers: int, num_heads: int, seed: int):
    """A freshly initialised LlamaForCausalLM; the global RNG state is left untouched."""
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_heads, max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, do_sample=False)
    return model


def transcript_rows(tokenizer, transcripts: Sequence[Transcript]
                    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, attention_mask, labels) [M, L], loss on model turns only."""
    rows = []
    for tr in transcripts:
        ids = list(tokenizer(tr[0][1])["input_ids"])
        labels = [-100] * len(ids)
        for role, text in tr[1:]:
            seg = tokenizer(text, add_special_tokens=False)["input_ids"]
            if role == MODEL:
                seg = seg + [tokenizer.eos_token_id]
            ids += seg
            labels += seg if role in TURNS else [-100] * len(seg)
        if len(ids) > MAX_POSITIONS:
            raise ValueError(f"a warm-up transcript has {len(ids)} tokens, over the tiny "
                             f"model's {MAX_POSITIONS} positions")
        rows.append((ids, labels))
    width = max(len(i) for i, _ in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for r, (i, lab) in enumerate(rows):
        ids[r, :len(i)], labels[r, :len(i)], mask[r, :len(i)] = (
            torch.tensor(i), torch.tensor(lab), 1)
    return ids, mask, labels


def train_on_rows(model, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor,
                  steps: int, lr: float, seed: int, batch_size: int) -> List[float]:
    """The losses of ``steps`` AdamW steps of cross-entropy on shuffled batches of rows."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses, order = [], torch.empty(0, dtype=torch.long)
    for _ in range(steps):
        if len(order) < batch_size:  # reshuffle each epoch
            order = torch.cat([order, torch.randperm(len(ids), generator=gen)])
        rows, order = order[:batch_size], order[batch_size:]
        out = model(input_ids=ids[rows], attention_mask=mask[rows], labels=labels[rows])
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    model.eval()
    return losses


def build_params(hidden_size: int = 128, num_layers: int = 2, num_heads: int = 4,
                 warmup_steps: int = 0, warmup_lr: float = 1e-3, seed: int = 0,
                 warmup_num_digits: int = 5, warmup_task: str = "sorting") -> Dict[str, object]:
    """Everything that determines the built model (the cache key hashes this)."""
    params = {"code_version": CODE_VERSION, "hidden_size": int(hidden_size),
            "num_layers": int(num_layers), "num_heads": int(num_heads),
            "warmup_steps": int(warmup_steps), "warmup_lr": float(warmup_lr),
            "warmup_batch_size": WARMUP_BATCH_SIZE, "warmup_num_digits": int(warmup_num_digits),
            "warmup_task_seed": WARMUP_TASK_SEED, "warmup_sorted_frac": WARMUP_SORTED_FRAC,
            "seed": int(seed),
            "torch": torch.__version__, "transformers": transformers.__version__}
    if warmup_task != "sorting":  # the arithmetic warm-up's own settings replace sorting's
        params.update({"warmup_task": warmup_task, "warmup_num_digits": 2,
                       **{f"warmup_{k}": v for k, v in ARITH_WARMUP.items()}})
        del params["warmup_sorted_frac"]
    return params


def cache_key(params: Dict[str, object], kind: str = "tiny") -> str:
    """The cache directory's name of a built ``kind`` ("tiny", "tiny-rm") with ``params``."""
    blob = json.dumps(params, sort_keys=True).encode()
    return f"{kind}-" + hashlib.sha256(blob).hexdigest()[:16]


def _warmup_data(params: Dict[str, object]):
    """(prompts, answers, batch size) of the warm-up: answers right with the params' share."""
    rng = random.Random(params["seed"])
    if params.get("warmup_task", "sorting") == "arithmetic":
        task = ArithmeticTask(num_digits=2, ops=["+"], seed=WARMUP_TASK_SEED)
        frac, batch_size = params["warmup_correct_frac"], params["warmup_batch_size"]
    else:
        task = SortingTask(num_digits=params["warmup_num_digits"], seed=WARMUP_TASK_SEED)
        frac, batch_size = params["warmup_sorted_frac"], WARMUP_BATCH_SIZE
    train, answers = task.train_examples(), []
    for ex in train:
        if rng.random() < frac:
            answers.append(task.answer(ex))
        elif isinstance(task, SortingTask):
            digits = list(ex.fields["digits"])
            rng.shuffle(digits)
            answers.append(" ".join(map(str, digits)))
        else:
            width = len(str(abs(ex.fields["answer"])))
            answers.append(spaced(rng.randrange(10 ** (width - 1) if width > 1 else 0, 10 ** width)))
    return [ex.prompt for ex in train], answers, batch_size


def warm_up_and_save(directory: Path, params: Dict[str, object], tokenizer, rows,
                     steps: int, batch_size: int) -> Dict[str, object]:
    """The metadata of ``params``' model trained on ``rows()``, saved into ``directory``."""
    t0 = time.perf_counter()
    model = build_model(tokenizer, params["hidden_size"], params["num_layers"],
                        params["num_heads"], params["seed"])
    losses = train_on_rows(model, *rows(), steps, params["warmup_lr"], params["seed"],
                           batch_size) if steps > 0 else []
    t_train = time.perf_counter() - t0
    model.save_pretrained(directory)  # safetensors
    tokenizer.save_pretrained(directory)
    meta = dict(params, num_parameters=sum(p.numel() for p in model.parameters()),
                final_warmup_loss=losses[-1] if losses else None,
                warmup_seconds=round(t_train, 3), build_seconds=round(time.perf_counter() - t0, 3))
    (directory / "rlctl_tiny.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def _build_into(directory: Path, params: Dict[str, object]) -> Dict[str, object]:
    tokenizer = build_tokenizer()
    prompts, answers, batch_size = _warmup_data(params)
    steps = int(round(params["warmup_steps"] * params.get("warmup_steps_scale", 1)))
    rows = [[("prompt", p), (MODEL, a)] for p, a in zip(prompts, answers)]
    return warm_up_and_save(directory, params, tokenizer,
                            lambda: transcript_rows(tokenizer, rows), steps, batch_size)


def resolve_warmup_task(name: Optional[str]) -> str:
    """The warm-up for task ``name``: its own if it has one, else sorting."""
    if name is None or name in WARMUP_TASKS:
        return name or "sorting"
    if name in TASKS or is_import_path(name):
        return "sorting"
    raise ValueError(f"invalid model.warmup_task '{name}'; valid: {', '.join(WARMUP_TASKS)} "
                     f"(other tasks: {', '.join(sorted(set(TASKS) - set(WARMUP_TASKS)))} "
                     "get the sorting warm-up)")


def build_tiny(hidden_size: int = 128, num_layers: int = 2, num_heads: int = 4,
               warmup_steps: int = 0, warmup_lr: float = 1e-3, seed: int = 0,
               warmup_num_digits: int = 5, cache_dir: Optional[os.PathLike] = None,
               warmup_task: str = "sorting") -> Path:
    """Directory of the tiny model (model + tokenizer), built on first use (``build_cached``)."""
    params = build_params(hidden_size, num_layers, num_heads, warmup_steps, warmup_lr, seed,
                          warmup_num_digits, resolve_warmup_task(warmup_task))
    final, meta = build_cached(cache_dir, cache_key(params), lambda tmp: _build_into(tmp, params))
    if meta is not None:
        log.info("built tiny model in %.1f s (%d params, %d warm-up steps): %s",
                 meta["build_seconds"], meta["num_parameters"], params["warmup_steps"], final)
    return final


def cache_root(cache_dir: Optional[os.PathLike] = None) -> Path:
    """The rlctl cache: ``cache_dir``, else ``$RLCTL_CACHE``, else ``~/.cache/rlctl``."""
    return Path(cache_dir).expanduser() if cache_dir else Path(
        os.environ.get("RLCTL_CACHE") or Path.home() / ".cache" / "rlctl")


def build_cached(cache_dir: Optional[os.PathLike], name: str, build):
    """(root / name, ``build(tmp_dir)``'s result or None if already built), root ``cache_dir``,
    ``$RLCTL_CACHE`` or ``~/.cache/rlctl``; the temporary directory is renamed into place."""
    root = cache_root(cache_dir)
    final = root / name
    if final.is_dir():
        return final, None
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
    try:
        meta = build(tmp)
        try:
            os.rename(tmp, final)  # atomic; fails if a racing builder got there first
        except OSError:
            if not final.is_dir():
                raise
            log.info("%s was built concurrently; using that copy", final.name)
            return final, None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final, meta
