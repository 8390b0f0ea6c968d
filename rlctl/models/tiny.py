"""The embedded tiny model: a small Llama plus a word-level tokenizer, built locally.

No weights are downloaded. ``build_tiny`` initialises a ``LlamaForCausalLM`` from a
``LlamaConfig`` with a fixed seed, gives it a brief supervised warm-up on the sorting
task (or on arithmetic, see below) so that the policy knows the answer *format* but not
yet the skill, and saves it with ``save_pretrained`` (safetensors + tokenizer) into a
cache directory named by a hash of every input that affects the result.

Warm-up (a departure from plain SFT, measured in the module's calibration): AdamW on
prompt -> answer + EOS, loss on completion tokens only, where the answer is the sorted
digits for a fraction ``WARMUP_SORTED_FRAC`` of the prompts and a random permutation of
the prompt's digits otherwise. Plain SFT on sorted answers learns format and skill at the
same pace (format only reaches ~0.8 when greedy exact-match is already ~0.7), so it
cannot give "format known, skill not"; the permutation answers teach the format (n prompt
digits, then EOS) with little ordering signal. The prompts come from the *training*
split of the default sorting task (seed 1234), never from its held-out eval split.

Calibration (hidden 128, 2 layers, 4 heads, lr 1e-3, batch 64, 1 thread; held-out greedy
exact / format, seeds 0, 1, 2): 40 steps 0.06-0.13 / 0.94-1.0; 80 steps 0.10-0.15 /
1.0 (the default, conf/model/tiny.yaml); 120 steps 0.22-0.29; 150 steps 0.17-0.34.
Plain SFT on sorted answers: 20 steps 0.14 / 0.17, 40 steps 0.69 / 0.80, 150-300 steps
0.93-0.98 (so the architecture can solve the task).

Arithmetic warm-up (``model.warmup_task=arithmetic``, which ``task=arithmetic`` selects
by default): 2-digit addition, prompts from the default arithmetic task's training split
(never its eval split), batch 256, ``warmup_steps * 2.5`` steps (200 for the default 80).
A format-only warm-up (random answers of the right length) leaves the model at ~0.0-0.03
held-out greedy exact and GRPO does not move it in 300 steps with the binary reward, so
this warm-up is plain SFT stopped early, where part of the skill is there. Calibration
(seed 0, 1 thread; held-out greedy exact / format): 80 steps 0.016 / 0.87; 160 steps
0.08; 200 steps 0.36 / 0.96 (the default); 220 steps 0.49; 240 steps 0.53; with 20% of
the answers random instead, 200-240 steps 0.06-0.10. GRPO from the default (``rlctl train
algo=grpo task=arithmetic``, 300 steps, seeds 0-2): 0.36 -> 0.42-0.46; with
``trainer.steps=1000 trainer.prompts_per_step=16`` (~2.5 min): 0.36 -> 0.67.

The write is atomic: the model is built in a temporary sibling directory and renamed
into place, so concurrent builders never see a half-written directory (the loser of a
race discards its copy and uses the winner's; both are identical).
"""
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
# Warm-up tasks (model.warmup_task). Any other registered task name (e.g. jsonl) gets the
# sorting warm-up. The arithmetic warm-up is on 2-digit addition ("1 2 + 3 4 =" -> "4 6")
# from the default arithmetic task's training split; its settings are calibrated below.
WARMUP_TASKS = ("sorting", "arithmetic")
ARITH_WARMUP = {"batch_size": 256, "correct_frac": 1.0, "steps_scale": 2.5}


def build_tokenizer(extra_words: Sequence[str] = ()):
    """Word-level tokenizer over digits and a few operators (then ``extra_words``, e.g. the
    environments' TINY_AGENT_WORDS); prepends <bos>; pads left."""
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


def completion_batch(tokenizer, prompts: Sequence[str], answers: Sequence[str]
                     ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded prompt+answer+EOS: (input_ids, attention_mask, labels), each [b, L].

    ``labels`` is -100 on the prompt and padding, so the loss covers completion tokens
    (EOS included) only.
    """
    rows: List[Tuple[List[int], List[int]]] = []
    for p, a in zip(prompts, answers):
        p_ids = tokenizer(p)["input_ids"]  # <bos> prompt
        a_ids = tokenizer(a, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append((p_ids, a_ids))
    width = max(len(p) + len(a) for p, a in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, (p, a) in enumerate(rows):
        n = len(p) + len(a)
        ids[i, :n] = torch.tensor(p + a)
        mask[i, :n] = 1
        labels[i, len(p):n] = torch.tensor(a)
    return ids, mask, labels


def supervised_warmup(model, tokenizer, prompts: Sequence[str], answers: Sequence[str],
                      steps: int, lr: float, seed: int,
                      batch_size: int = WARMUP_BATCH_SIZE) -> List[float]:
    """``steps`` AdamW steps of completion-only cross-entropy; returns the losses."""
    if steps <= 0:
        return []
    ids, mask, labels = completion_batch(tokenizer, prompts, answers)  # [M, L]
    return train_on_rows(model, ids, mask, labels, steps, lr, seed, batch_size)


def train_on_rows(model, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor,
                  steps: int, lr: float, seed: int, batch_size: int) -> List[float]:
    """``steps`` AdamW steps of cross-entropy on ``labels`` (-100: not counted) over
    shuffled batches of the rows of ``ids`` [M, L]; returns the losses."""
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


def default_cache_dir() -> Path:
    return Path(os.environ.get("RLCTL_CACHE") or Path.home() / ".cache" / "rlctl")


def build_params(hidden_size: int = 128, num_layers: int = 2, num_heads: int = 4,
                 warmup_steps: int = 0, warmup_lr: float = 1e-3, seed: int = 0,
                 warmup_num_digits: int = 5, warmup_task: str = "sorting") -> Dict[str, object]:
    """Everything that determines the built model (the cache key hashes this). The
    sorting warm-up adds no key, so its cache keys are those of before warm-up tasks."""
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


def cache_key(params: Dict[str, object]) -> str:
    blob = json.dumps(params, sort_keys=True).encode()
    return "tiny-" + hashlib.sha256(blob).hexdigest()[:16]


def warmup_answers(task, examples, sorted_frac: float, seed: int) -> List[str]:
    """Sorted answer with probability ``sorted_frac``, else a random permutation."""
    rng = random.Random(seed)
    answers = []
    for ex in examples:
        digits = list(ex.fields["digits"])
        if rng.random() < sorted_frac:
            answers.append(task.answer(ex))
        else:
            rng.shuffle(digits)
            answers.append(" ".join(map(str, digits)))
    return answers


def arithmetic_warmup_answers(task, examples, correct_frac: float, seed: int) -> List[str]:
    """The right answer with probability ``correct_frac``, else a random number with as
    many digits (the format without the skill)."""
    rng = random.Random(seed)
    answers = []
    for ex in examples:
        n = ex.fields["answer"]
        if rng.random() < correct_frac:
            answers.append(task.answer(ex))
        else:
            width = len(str(abs(n)))
            answers.append(spaced(rng.randrange(10 ** (width - 1) if width > 1 else 0, 10 ** width)))
    return answers


def _warmup_data(params: Dict[str, object]):
    """(prompts, answers, batch size) of the warm-up task."""
    if params.get("warmup_task", "sorting") == "arithmetic":
        task = ArithmeticTask(num_digits=2, ops=["+"], seed=WARMUP_TASK_SEED)
        train = task.train_examples()
        return ([ex.prompt for ex in train],
                arithmetic_warmup_answers(task, train, params["warmup_correct_frac"],
                                          params["seed"]), params["warmup_batch_size"])
    task = SortingTask(num_digits=params["warmup_num_digits"], seed=WARMUP_TASK_SEED)
    train = task.train_examples()
    return ([ex.prompt for ex in train],
            warmup_answers(task, train, params["warmup_sorted_frac"], params["seed"]),
            WARMUP_BATCH_SIZE)


def _build_into(directory: Path, params: Dict[str, object]) -> Dict[str, object]:
    t0 = time.perf_counter()
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, params["hidden_size"], params["num_layers"],
                        params["num_heads"], params["seed"])
    prompts, answers, batch_size = _warmup_data(params)
    steps = int(round(params["warmup_steps"] * params.get("warmup_steps_scale", 1)))
    losses = supervised_warmup(model, tokenizer, prompts, answers, steps,
                               params["warmup_lr"], params["seed"], batch_size=batch_size)
    t_train = time.perf_counter() - t0
    model.save_pretrained(directory)  # safetensors
    tokenizer.save_pretrained(directory)
    meta = dict(params, num_parameters=sum(p.numel() for p in model.parameters()),
                final_warmup_loss=losses[-1] if losses else None,
                warmup_seconds=round(t_train, 3),
                build_seconds=round(time.perf_counter() - t0, 3))
    (directory / "rlctl_tiny.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def resolve_warmup_task(name: Optional[str]) -> str:
    """The warm-up for ``name``: itself if it has one, sorting for other registered tasks
    and for a user task by import path (``task.name=myenv.py:make_task``)."""
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
    """Directory of the tiny model (model + tokenizer), building it on first use.

    ``warmup_task``: sorting | arithmetic; the name of any other registered task (e.g.
    jsonl, the default config's ``${task.name}``) means sorting.

    Cached under ``cache_dir`` (default ``$RLCTL_CACHE`` or ``~/.cache/rlctl``) in
    ``tiny-<hash>``, the hash covering every parameter that affects the weights.
    """
    params = build_params(hidden_size, num_layers, num_heads, warmup_steps, warmup_lr, seed,
                          warmup_num_digits, resolve_warmup_task(warmup_task))
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    final, meta = build_cached(root, cache_key(params), lambda tmp: _build_into(tmp, params))
    if meta is not None:
        log.info("built tiny model in %.1f s (%d params, %d warm-up steps): %s",
                 meta["build_seconds"], meta["num_parameters"], params["warmup_steps"], final)
    return final


def build_cached(root: Path, name: str, build):
    """(root / name, what ``build(tmp_dir)`` returned, or None when the directory was
    already there or a concurrent builder won). The build goes into a temporary sibling
    that is renamed into place (atomic), so a reader never sees a half-written model."""
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
