"""A reward model built from a causal LM and fitted on preference pairs with the Bradley-Terry loss."""
from __future__ import annotations

import random
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from transformers import AutoModelForSequenceClassification

from rlctl.core.preference import bradley_terry_loss
from rlctl.rm.settings import RMConfig
from rlctl.tasks.preference import Pair  # noqa: F401  (the pairs the fit reads)
from rlctl.rm.score import LAST_NON_PAD, READ_KEY, keep_end, render, text_scores, token_rows


def classifier_from_lm(path: str, dtype: torch.dtype = torch.float32, seed: int = 0):
    """A 1-output sequence classifier on the causal LM at ``path`` (a new head under ``seed``)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=1, dtype=dtype, use_safetensors=True)
    return model


def prepare_for_scoring(model, tokenizer) -> None:
    """A pad token (EOS if none) on tokenizer and config, and ``READ_KEY``: read at the last non-pad."""
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id
    setattr(model.config, READ_KEY, LAST_NON_PAD)


def scores(model, tokenizer, prompts: Sequence[Any], completions: Sequence[str],
           max_length: Optional[int] = None) -> torch.Tensor:
    """The model's score of each rendered pair, [n] float32 (grad flows when enabled)."""
    texts = [render(tokenizer, p, c) for p, c in zip(prompts, completions)]
    return text_scores(model, tokenizer, texts, max_length)


def pair_counts(tokenizer, pairs: Sequence[Pair], limit: Optional[int]) -> Tuple[int, int]:
    """(pairs with a text over ``limit`` tokens, pairs whose sides read the same once cut)."""
    rows = token_rows(tokenizer, [render(tokenizer, p.prompt, x)
                                  for p in pairs for x in (p.chosen, p.rejected)]) if pairs else []
    cut = [keep_end(r, limit, tokenizer.bos_token_id) for r in rows]
    pairs_at = range(0, len(rows), 2)
    return (sum(rows[i] != cut[i] or rows[i + 1] != cut[i + 1] for i in pairs_at),
            sum(cut[i] == cut[i + 1] for i in pairs_at))


def pair_scores(model, tokenizer, pairs: Sequence[Pair], max_length: Optional[int] = None
                ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(r_chosen [P], r_rejected [P]) in one forward of 2P rows (grad flows when enabled)."""
    r = scores(model, tokenizer, [p.prompt for p in pairs] * 2,
               [p.chosen for p in pairs] + [p.rejected for p in pairs], max_length)  # [2P]
    return r[:len(pairs)], r[len(pairs):]


@torch.no_grad()
def score_pairs(model, tokenizer, pairs: Sequence[Pair], batch_size: int = 64,
                max_length: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Held-out scores of every pair, batched: (r_chosen [P], r_rejected [P])."""
    was_training = model.training
    model.eval()
    chosen, rejected = [], []
    for i in range(0, len(pairs), batch_size):
        c, r = pair_scores(model, tokenizer, pairs[i:i + batch_size], max_length)
        chosen.append(c.cpu())
        rejected.append(r.cpu())
    model.train(was_training)
    return torch.cat(chosen), torch.cat(rejected)


def pairwise_accuracy(r_chosen: torch.Tensor, r_rejected: torch.Tensor) -> float:
    """Share of pairs the model ranks right (a tie counts as wrong)."""
    return float((r_chosen > r_rejected).float().mean()) if len(r_chosen) else float("nan")


def fit(model, tokenizer, pairs: Sequence[Pair], s: RMConfig, seed: int = 0,
        on_step: Optional[Callable[[int, Dict[str, float]], Any]] = None) -> List[float]:
    """``s.steps`` AdamW steps of the Bradley-Terry loss on ``pairs``; ``on_step`` true stops. The losses."""
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=s.weight_decay)
    model.train()
    order: List[int] = []
    losses = []
    for step in range(1, s.steps + 1):
        if len(order) < s.batch_size:
            fresh = list(range(len(pairs)))
            rng.shuffle(fresh)
            order += fresh
        batch = [pairs[i] for i in order[:s.batch_size]]
        order = order[s.batch_size:]
        r_c, r_r = pair_scores(model, tokenizer, batch, s.max_length)   # [P], [P]
        margins = torch.tensor([s.margin if p.margin is None else float(p.margin)
                                for p in batch])                    # [P]
        loss, m = bradley_terry_loss(r_c, r_r, margins.to(r_c.device), s.center_coef)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(
            model.parameters(), s.max_grad_norm if s.max_grad_norm > 0 else float("inf"))
        opt.step()
        losses.append(float(loss.detach()))
        if on_step is not None and on_step(step, {
                "train/loss": losses[-1], "train/accuracy": float(m["accuracy"]),
                "train/bt_loss": float(m["bt_loss"]), "train/margin": float(m["margin"]),
                "optim/grad_norm": float(grad_norm)}):
            break
    model.eval()
    return losses
