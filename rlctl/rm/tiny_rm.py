"""The embedded tiny reward model for 5-digit sorting (``task.reward_model=tiny``; docs/rlhf.md)."""
from __future__ import annotations

import json
import logging
import os
import random
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch
import transformers

from rlctl.demo.tiny import build_cached, build_tiny, build_tokenizer, cache_key
from rlctl.rm.settings import RMConfig
from rlctl.rm.fit import (Pair, classifier_from_lm, fit, pairwise_accuracy, prepare_for_scoring,
                          score_pairs)
from rlctl.tasks.sorting import SortingTask, noisy_answer, positional_reward

log = logging.getLogger(__name__)

CODE_VERSION = 3        # bump when a change here alters the built model (in the cache key)
TASK_SEED = 1234        # the default sorting task's split seed
NUM_DIGITS = 5
NUM_PAIRS = 2048        # training pairs: still limited (an imperfect proxy)
NUM_HELDOUT = 512       # held-out pairs from the eval split, for the stated accuracy
STEPS = 300
BATCH_SIZE = 32
LR = 1e-3
CENTER_COEF = 0.01
POLICY_WARMUP_STEPS = 80   # config/conf/model/tiny.yaml's warmup_steps: the policy's backbone
FITTED_FOR = {"task": "sorting", "num_digits": NUM_DIGITS}   # the prompts it was fitted on


def task_mismatch(task_name: str, num_digits) -> Optional[str]:
    """Why the tiny reward model (5-digit sorting only) does not fit ``task_name``, or None."""
    if task_name == FITTED_FOR["task"] and num_digits == FITTED_FOR["num_digits"]:
        return None
    got = f"task={task_name}" + (f" task.num_digits={num_digits}" if task_name == "sorting" else "")
    return (f"task.reward_model=tiny was fitted on task=sorting task.num_digits={NUM_DIGITS} "
            f"prompts only, not {got}; fit a reward model for this task with rlctl "
            "reward-model train and pass its directory")


def sorting_pairs(examples, n: int, seed: int) -> List[Pair]:
    """``n`` pairs ranked by the positional reward, cycling through ``examples``, ties skipped."""
    rng, pairs, i = random.Random(seed), [], 0
    while len(pairs) < n:
        ex, i = examples[i % len(examples)], i + 1
        digits = ex.fields["digits"]
        a, b = noisy_answer(digits, rng), noisy_answer(digits, rng)
        ra, rb = positional_reward(digits, a), positional_reward(digits, b)
        if ra == rb:
            continue
        win, lose = (a, b) if ra > rb else (b, a)
        pairs.append(Pair(ex.prompt, " ".join(map(str, win)), " ".join(map(str, lose))))
    return pairs


def build_params(seed: int = 0) -> Dict[str, object]:
    """Everything that determines the built reward model (hashed into the cache key)."""
    return {"code_version": CODE_VERSION, "task_seed": TASK_SEED, "num_digits": NUM_DIGITS,
            "num_pairs": NUM_PAIRS, "num_heldout": NUM_HELDOUT, "steps": STEPS,
            "batch_size": BATCH_SIZE, "lr": LR, "center_coef": CENTER_COEF,
            "policy_warmup_steps": POLICY_WARMUP_STEPS, "seed": int(seed),
            "torch": torch.__version__, "transformers": transformers.__version__}


def _build_into(directory: Path, params: Dict[str, object], cache_dir: Optional[Path]) -> Dict:
    t0 = time.perf_counter()
    policy = build_tiny(warmup_steps=POLICY_WARMUP_STEPS, cache_dir=cache_dir)
    tokenizer = build_tokenizer()
    model = classifier_from_lm(str(policy), seed=params["seed"])
    prepare_for_scoring(model, tokenizer)
    task = SortingTask(num_digits=NUM_DIGITS, seed=TASK_SEED)
    train = sorting_pairs(task.train_examples(), NUM_PAIRS, params["seed"])
    held = sorting_pairs(task.eval_examples(), NUM_HELDOUT, params["seed"] + 1)
    losses = fit(model, tokenizer, train, RMConfig(steps=STEPS, lr=LR, batch_size=BATCH_SIZE,
                                                   center_coef=CENTER_COEF), params["seed"])
    acc = pairwise_accuracy(*score_pairs(model, tokenizer, held))
    model.save_pretrained(directory)   # safetensors
    tokenizer.save_pretrained(directory)
    meta = dict(params, fitted_for=FITTED_FOR, heldout_pairwise_accuracy=round(acc, 4),
                final_loss=losses[-1], build_seconds=round(time.perf_counter() - t0, 3))
    (directory / "rlctl_tiny_rm.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def tiny_reward_model_dir(seed: int = 0, cache_dir: Optional[os.PathLike] = None) -> Path:
    """The tiny sorting reward model's directory (classifier + tokenizer), built atomically once."""
    params = build_params(seed)
    policy_cache = Path(cache_dir).expanduser() if cache_dir else None
    final, meta = build_cached(cache_dir, cache_key(params, "tiny-rm"),
                               lambda tmp: _build_into(tmp, params, policy_cache))
    if meta is not None:
        log.info("built tiny reward model in %.1f s (held-out pairwise accuracy %.3f): %s",
                 meta["build_seconds"], meta["heldout_pairwise_accuracy"], final)
    return final
