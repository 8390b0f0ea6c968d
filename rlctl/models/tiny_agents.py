"""The embedded tiny model for the built-in multi-turn environments (calculator,
guess_number, running_sum): a tokenizer with the environments' words and a warm-up on
episode transcripts, so that the call / answer *format* exists at step 0, not the skill.

``model.warmup_task`` (``${task.name}`` by default) naming one of ``AGENT_WARMUPS`` selects
it (``build_tiny_model``; any other name goes to ``rlctl.models.tiny.build_tiny``, whose
sorting / arithmetic models, vocabulary and cache keys these settings never touch). The
tokenizer is ``build_tokenizer(TINY_AGENT_WORDS)``: the default words keep their ids, the
environments' words follow. The model is initialised as the default one (same seed and
shape, a larger embedding). The warm-up is supervised (AdamW, ``warmup_lr``) on
``episodes`` transcripts that a scripted policy (rlctl.models.agent_scripts) plays
against the environment itself (its default task, training rows only, never the eval
rows), laid out as the episode loop lays them out: ``<bos>`` prompt, each model turn and
its ``<eos>`` (no ``<eos>`` after a turn cut at a stop string), each observation as the
environment wrote it; the loss is on model-turn tokens only (observations and the prompt:
labels -100). The scripted policies know the format, not the skill:

- calculator: with probability ``call_frac`` the first turn is the tool call
  ``<call> calc EXPR </call>`` (EXPR copied from the prompt) and the second copies the
  tool's result; otherwise the first turn is the product itself (plain SFT on 3-digit by
  2-digit products, which the warm-up does not teach: direct answers are ~never exact);
- guess_number: each guess is a number in 1..N, with probability ``narrow_frac`` (per
  turn; 1.0 by default) drawn uniformly from the range the answers so far leave, else
  anywhere in 1..N: legal, consistent moves, not binary search (what RL has to find);
- running_sum: each turn is the right total with probability ``correct_frac``, else a
  random number of as many digits.

The cache key of an agent model covers every parameter, ``AGENT_CODE_VERSION`` and a
digest of the warm-up transcripts themselves, so a change of an environment's text
builds a new model (``rlctl eval`` of the starting model measures it: greedy episodes
on the eval rows).

Calibration (hidden 128, 2 layers, ``warmup_steps`` 80 of conf/model/tiny.yaml times
``steps_scale``, 1 thread, held-out greedy): see ``AGENT_WARMUPS``' comments.
"""
from __future__ import annotations

import hashlib
import json
import logging
import random
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from rlctl.envs.calc import TINY_AGENT_WORDS
from rlctl.models.agent_scripts import MODEL, POLICIES, TURNS, Transcript, play_scripted
from rlctl.models.tiny import (MAX_POSITIONS, build_cached, build_model, build_params,
                               build_tiny, build_tokenizer, cache_key, default_cache_dir,
                               train_on_rows)
from rlctl.tasks import build_task

log = logging.getLogger(__name__)

AGENT_CODE_VERSION = 1   # bump when a change here alters an agent model
# Per task: scripted-policy settings, warm-up batch, steps = warmup_steps * steps_scale,
# turns per scripted (and measured) episode, new tokens per measured turn. Calibration
# (seed 0 unless said; held-out greedy episodes at the recipes' budgets):
# - calculator, call_frac 0.3: 160 steps: tool calls 0.40-0.45 / success 0.28-0.33 (seeds
#   0-2: calls 0.45, 0.20, 0.30), but 4-digit results are copied wrong and GRPO then
#   stalls at 0.82 (it fails every 4-digit product); 320 steps (the setting): calls 0.34,
#   success 0.32 (every call right, every direct answer wrong), GRPO 300 steps -> 0.99.
#   call_frac 0.5: greedy calls every time (0.93 at step 0: the skill already there).
# - guess_number, narrow_frac 1.0, 320 steps: (trained on 12 of the 16 secrets) all 16
#   greedy success 0.88, mean turns 4.5 (first guess 13, not 8); narrow_frac 0.5 or 80
#   steps: guesses repeat after a few turns (0.25 / 6.75-7.75 on 4 secrets). Since the
#   rows are every secret (rlctl/envs/builtin.py): 320 steps, 0.875 / 4.75 on all 16.
# - running_sum, correct_frac 0.5: 80 steps 7% of turns right, 160 steps (the setting) 36%.
AGENT_WARMUPS: Dict[str, Dict[str, float]] = {
    "calculator": {"episodes": 2000, "call_frac": 0.3, "batch_size": 64, "steps_scale": 4.0,
                   "max_turns": 2, "max_new_tokens": 12},
    "guess_number": {"episodes": 2000, "narrow_frac": 1.0, "batch_size": 64, "steps_scale": 4.0,
                     "max_turns": 8, "max_new_tokens": 4},
    "running_sum": {"episodes": 2000, "correct_frac": 0.5, "batch_size": 64, "steps_scale": 2.0,
                    "max_turns": 4, "max_new_tokens": 4},
}


# ---- transcripts and the warm-up batch --------------------------------------------------

def transcript_rows(tokenizer, transcripts: Sequence[Transcript]
                    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, attention_mask, labels) [M, L]: ``<bos>`` prompt, model
    turns + ``<eos>`` (labels = ids), observations (labels -100), as episodes are laid out."""
    rows = []
    for tr in transcripts:
        ids, labels = list(tokenizer(tr[0][1])["input_ids"]), None
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


def warmup_transcripts(name: str, opts, seed: int, tokenizer) -> List[Transcript]:
    """``opts["episodes"]`` scripted episodes of task ``name`` (its default options), on
    its training rows in turn (never its eval rows)."""
    task, rng = build_task(name), random.Random(seed)
    train = task.train_examples()
    return [play_scripted(task, train[i % len(train)], i, POLICIES[name], opts, rng, tokenizer)
            for i in range(int(opts["episodes"]))]


def transcripts_digest(transcripts: Sequence[Transcript]) -> str:
    return hashlib.sha256(json.dumps(transcripts).encode()).hexdigest()[:16]


# ---- build and cache --------------------------------------------------------------------

def agent_params(name: str, hidden_size: int, num_layers: int, num_heads: int,
                 warmup_steps: int, warmup_lr: float, seed: int) -> Dict[str, object]:
    """Everything that determines the agent model of task ``name`` (the cache key hashes
    it), the warm-up transcripts' digest included."""
    params = build_params(hidden_size, num_layers, num_heads, warmup_steps, warmup_lr, seed)
    for key in ("warmup_num_digits", "warmup_sorted_frac", "warmup_batch_size"):
        del params[key]          # sorting's settings; the agent warm-up has its own
    opts = AGENT_WARMUPS[name]
    tokenizer = build_tokenizer(TINY_AGENT_WORDS)
    params.update({"warmup_task": name, "agent_code_version": AGENT_CODE_VERSION,
                   "agent_words": list(TINY_AGENT_WORDS),
                   **{f"warmup_{k}": v for k, v in opts.items()},
                   "warmup_transcripts": transcripts_digest(
                       warmup_transcripts(name, opts, int(seed), tokenizer))})
    return params


def _build_agent_into(directory: Path, params: Dict[str, object]) -> Dict[str, object]:
    t0, name = time.perf_counter(), str(params["warmup_task"])
    opts = AGENT_WARMUPS[name]
    tokenizer = build_tokenizer(TINY_AGENT_WORDS)
    model = build_model(tokenizer, params["hidden_size"], params["num_layers"],
                        params["num_heads"], params["seed"])
    transcripts = warmup_transcripts(name, opts, int(params["seed"]), tokenizer)
    ids, mask, labels = transcript_rows(tokenizer, transcripts)
    steps = int(round(params["warmup_steps"] * opts["steps_scale"]))
    losses = train_on_rows(model, ids, mask, labels, steps, params["warmup_lr"],
                           params["seed"], int(opts["batch_size"]))
    t_train = time.perf_counter() - t0
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    meta = dict(params, num_parameters=sum(p.numel() for p in model.parameters()),
                final_warmup_loss=losses[-1] if losses else None,
                warmup_seconds=round(t_train, 3), build_seconds=round(time.perf_counter() - t0, 3))
    (directory / "rlctl_tiny.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def build_agent_tiny(name: str, hidden_size: int = 128, num_layers: int = 2,
                     num_heads: int = 4, warmup_steps: int = 0, warmup_lr: float = 1e-3,
                     seed: int = 0, cache_dir=None) -> Path:
    """Directory of the agent tiny model of task ``name``, built on first use and cached
    beside the others (``tiny-<hash>``)."""
    params = agent_params(name, hidden_size, num_layers, num_heads, warmup_steps, warmup_lr, seed)
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    final, meta = build_cached(root, cache_key(params), lambda tmp: _build_agent_into(tmp, params))
    if meta is not None:
        log.info("built tiny %s model in %.1f s (%d warm-up steps): %s", name,
                 meta["build_seconds"], steps_of(params), final)
    return final


def steps_of(params: Dict[str, object]) -> int:
    return int(round(params["warmup_steps"] * params["warmup_steps_scale"]))


def build_tiny_model(warmup_task: Optional[str] = "sorting", **kwargs) -> Path:
    """The tiny model for ``warmup_task``: an environment's agent model, else
    ``build_tiny`` (sorting, arithmetic, and the sorting warm-up for other tasks)."""
    if warmup_task in AGENT_WARMUPS:
        kwargs.pop("warmup_num_digits", None)
        return build_agent_tiny(warmup_task, **kwargs)
    return build_tiny(warmup_task=warmup_task, **kwargs)
