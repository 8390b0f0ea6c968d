"""Learned reward models as rewards (docs/rlhf.md; Ouyang et al., 2022), normalised, clipped."""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from rlctl.errors import UserError
from rlctl.models.hf_files import corrupt_safetensors, reward_model_dir, vocab_problem
from rlctl.rm.score import (LAST_ATTENDED, checkpoint_keys, encode, head_names, head_params,
                            last_token_scores, length_limit, pad_id_of, read_positions, render,
                            score_read, untrained_head_problem)
from rlctl.tasks.task import RAW_PROMPT, RESERVED_REWARD_NAMES
from rlctl.tasks.rewards import DEFAULT_MODEL_NAME, check_name_chars, model_entries
from rlctl.types import Example

log = logging.getLogger(__name__)

NORMS = ("none", "running")
BATCH_ROWS = 64          # rows per reward-model forward (bounds activation memory)


STD_FLOOR = 1e-6         # running std below this divides by 1 (all scores so far equal)
Stats = Tuple[int, float, float]   # (count, mean, M2)


def batch_stats(xs: Sequence[float]) -> Stats:
    """(count, mean, M2) of ``xs``, with exactly rounded sums."""
    m = len(xs)
    if m == 0:
        return 0, 0.0, 0.0
    mean = math.fsum(xs) / m
    return m, mean, math.fsum((x - mean) ** 2 for x in xs)


def merged(a: Stats, b: Stats) -> Stats:
    """The statistics of the union of two sets of values (Chan et al.'s pairwise update)."""
    (na, ma, m2a), (nb, mb, m2b) = a, b
    if nb == 0:
        return a
    n, delta = na + nb, mb - ma
    return n, ma + delta * nb / n, m2a + m2b + delta * delta * na * nb / n


def global_batch_stats(batches: Sequence[Sequence[float]]) -> List[Stats]:
    """Each batch's (one per model) statistics over every rank: one float64 all-reduce."""
    local = [batch_stats(b) for b in batches]
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return local
    world, rank = dist.get_world_size(), dist.get_rank()
    device = (torch.device("cuda", torch.cuda.current_device())
              if "nccl" in str(dist.get_backend()) else torch.device("cpu"))
    table = torch.zeros(world, len(local), 3, dtype=torch.float64, device=device)  # [W, M, 3]
    table[rank] = torch.tensor(local, dtype=torch.float64, device=device)
    dist.all_reduce(table)                 # each row is one rank's: the sum is a gather
    rows, out = table.tolist(), []         # one host copy of the [W, M, 3] table
    for j in range(len(local)):
        acc: Stats = (0, 0.0, 0.0)
        for n, mean, m2 in (row[j] for row in rows):
            acc = merged(acc, (int(round(n)), mean, m2))
        out.append(acc)
    return out


@dataclass
class RunningNorm:
    """Count, mean and M2 (sum of squared deviations) of every value seen, float64."""
    count: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def merge(self, m: int, b_mean: float, b_m2: float) -> None:
        """Merge the statistics (count, mean, M2) of another set of values."""
        self.count, self.mean, self.m2 = merged((self.count, self.mean, self.m2),
                                                (m, b_mean, b_m2))

    @property
    def std(self) -> float:
        """Population standard deviation of the values seen (0 before two values)."""
        return math.sqrt(self.m2 / self.count) if self.count else 0.0

    def normalize(self, x: float) -> float:
        return (x - self.mean) / (self.std if self.std > STD_FLOOR else 1.0)

    def state(self) -> Dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state(self, state: Dict[str, Any]) -> None:
        self.count, self.mean, self.m2 = int(state["count"]), float(state["mean"]), float(state["m2"])


def _weights_problem(path: Path) -> Optional[str]:
    if any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").is_file():
        return None
    if any(path.glob("pytorch_model*.bin")) or any(path.glob("*.pt")):
        return ("has pickled weights only (pytorch_model.bin); rlctl loads safetensors only: "
                "re-save it with save_pretrained(..., safe_serialization=True)")
    return "has no model.safetensors"


def _check_config(path: Path, key: str):
    try:
        config = AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{key}: '{path}' is not a Hugging Face model directory "
                         f"({' '.join(str(exc).split())[:120]})") from None
    archs = list(getattr(config, "architectures", None) or [])
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        raise ValueError(f"{key}: '{path}' is not a sequence classifier (architectures: "
                         f"{', '.join(archs) or 'none'}); a reward model is an "
                         "AutoModelForSequenceClassification with num_labels=1")
    if config.num_labels != 1:
        raise ValueError(f"{key}: '{path}' has {config.num_labels} labels; a reward model "
                         "has one (num_labels=1, a scalar score)")
    return config


def _load_tokenizer(path: Path, key: str):
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, TypeError) as exc:
        raise ValueError(f"{key}: '{path}' has no tokenizer the reward model can use "
                         f"({' '.join(str(exc).split())[:100]}); save it beside the "
                         "weights with tokenizer.save_pretrained") from None
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ValueError(f"{key}: the tokenizer in '{path}' has neither a pad nor an "
                             "EOS token; set tokenizer.pad_token and save it again")
        tok.pad_token = tok.eos_token   # masked out: which id pads does not matter
    return tok


class RewardModel:
    """A sequence-classifier reward model; ValueError (one line naming ``key``) if not one."""

    def __init__(self, path: Any, name: str = DEFAULT_MODEL_NAME, weight: float = 1.0,
                 device: str = "cpu", key: str = "task.reward_model"):
        self.name, self.weight, self.key = name, weight, key
        if not Path(str(path)).expanduser().is_dir():
            raise ValueError(f"{key}: no such reward model directory '{path}'")
        self.path = reward_model_dir(Path(str(path)).expanduser())   # a run: its model/
        self.config = _check_config(self.path, key)
        corrupt = corrupt_safetensors(self.path)
        if corrupt:
            raise ValueError(f"{key}: {corrupt}")
        problem = _weights_problem(self.path)
        keys = None if problem else checkpoint_keys(self.path)
        if keys is not None:
            problem = untrained_head_problem(head_names(self.config), keys)
        if problem:
            raise ValueError(f"{key}: '{path}' {problem}")
        self.tokenizer = _load_tokenizer(self.path, key)
        problem = vocab_problem(self.tokenizer, getattr(self.config, "vocab_size", None), self.path)
        if problem:
            raise ValueError(f"{key}: {problem}")
        self.device_name, self.model, self.read_noted = device, None, False
        self.limit = length_limit(self.tokenizer, self.config)   # tokens per scored text
        self.truncated = 0       # texts scored so far that were over the limit
        self.read, self.read_why = score_read(self.config, self.path)  # where the score is read

    def load(self):
        """The classifier, loaded once (on the device, in its saved dtype, eval mode)."""
        if self.model is None:
            device = torch.device(self.device_name)
            if device.type == "cuda" and device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            model, info = AutoModelForSequenceClassification.from_pretrained(
                str(self.path), dtype="auto", use_safetensors=True, output_loading_info=True)
            names = head_params(model)         # transformers' own report, the last word
            problem = untrained_head_problem(names, set(names) - set(info["missing_keys"]))
            if problem:
                raise UserError(f"{self.key}: '{self.path}' {problem}")
            self.model = model.to(device).eval().requires_grad_(False)
        return self.model

    def text(self, example: Example, completion: str) -> str:
        return render(self.tokenizer, example.fields.get(RAW_PROMPT, example.prompt), completion)

    @torch.no_grad()
    def score_texts(self, texts: Sequence[str]) -> List[float]:
        """Raw scores, one per text (the head at the token ``self.read`` names)."""
        model = self.load()
        device = next(model.parameters()).device
        out: List[float] = []
        over = 0
        for start in range(0, len(texts), BATCH_ROWS):
            ids, mask, n = encode(self.tokenizer, texts[start:start + BATCH_ROWS], self.limit)
            over += n
            self._note_read(ids, mask)
            out.extend(last_token_scores(model, ids.to(device), mask.to(device),
                                         self.read).tolist())
        if over and not self.truncated:
            log.warning("reward model '%s' (%s): %d of %d texts are longer than its %d-token "
                        "limit; each keeps its last tokens (and a leading BOS), the end of "
                        "the completion where the score is read (reported once)",
                        self.name, self.path, over, len(texts), self.limit)
        self.truncated += over
        return out

    def _note_read(self, ids: torch.Tensor, mask: torch.Tensor) -> None:
        """Say once when an earlier rlctl fit is read at a pad id (transformers would not)."""
        pad = pad_id_of(self.config)
        if self.read != LAST_ATTENDED or pad is None or self.read_noted:
            return
        last = read_positions(ids, mask, LAST_ATTENDED, None)          # [n]
        if bool((ids[torch.arange(len(ids)), last] == pad).any()):
            self.read_noted = True
            log.warning("reward model '%s' (%s) is %s: its score is read at the last token "
                        "of each text, here the pad id %d, as it was fitted (transformers' "
                        "pooling would read the token before it)", self.name, self.path,
                        self.read_why, pad)

    def score(self, examples: Sequence[Example], completions: Sequence[str]) -> List[float]:
        return self.score_texts([self.text(e, c) for e, c in zip(examples, completions)])


@dataclass
class LearnedRewards:
    """A run's reward models: ``clip(norm(raw))`` per model, weighted and summed."""
    models: List[RewardModel]
    replace_task: bool
    norm: str = "none"
    clip: Optional[float] = None
    norms: Dict[str, RunningNorm] = field(default_factory=dict)
    owner: Any = None      # the first RewardScorer given these models: it updates the statistics

    def __post_init__(self):
        self.norms = {m.name: RunningNorm() for m in self.models}

    def claim(self, scorer) -> bool:
        """True for the scorer that updates the running statistics: the first (training's)."""
        if self.owner is None:
            self.owner = scorer
        return self.owner is scorer

    def shaped(self, name: str, raw: Sequence[float]) -> List[float]:
        values = list(raw)
        if self.norm == "running":
            values = [self.norms[name].normalize(v) for v in values]
        if self.clip is not None:
            values = [min(max(v, -self.clip), self.clip) for v in values]
        return values

    def score(self, examples, completions, update: bool) -> Tuple[List[float], Dict[str, List[float]]]:
        """(weighted sum of the shaped scores [n], raw scores by name). ``update``: the running
        statistics take this batch first, over every rank (a collective: once per step)."""
        total = [0.0] * len(examples)
        raw = {m.name: m.score(examples, completions) for m in self.models}
        if update and self.norm == "running":
            for m, stats in zip(self.models, global_batch_stats([raw[m.name] for m in self.models])):
                self.norms[m.name].merge(*stats)
        for m in self.models:
            for i, v in enumerate(self.shaped(m.name, raw[m.name])):
                total[i] += m.weight * v
        return total, raw

    def state(self) -> Dict[str, Dict[str, float]]:
        return {k: n.state() for k, n in self.norms.items()}

    def load_state(self, state: Dict[str, Dict[str, float]]) -> None:
        for k, s in (state or {}).items():
            if k in self.norms:
                self.norms[k].load_state(s)


def check_names(models: List[RewardModel], taken: Sequence[str]) -> None:
    seen = set(taken)
    for m in models:
        if m.name in RESERVED_REWARD_NAMES or m.name in seen:
            raise ValueError(f"{m.key}: the reward name '{m.name}' is already used; set "
                             "name: to another")
        check_name_chars(m.name, m.key)
        seen.add(m.name)


def build_learned_rewards(reward_model: Optional[str], rewards: Optional[Sequence[Any]],
                          norm: Optional[str], clip: Optional[float], device: str,
                          taken: Sequence[str] = ()) -> Optional[LearnedRewards]:
    """The run's ``LearnedRewards`` (None without a reward model); ValueError, one line."""
    norm = norm or "none"
    if norm not in NORMS:
        raise ValueError(f"invalid task.reward_norm '{norm}'; valid: {', '.join(NORMS)}")
    entries = model_entries(rewards, reward_model)
    if not entries:
        if norm != "none" or clip is not None:
            raise ValueError("task.reward_norm and task.reward_clip apply to reward models; "
                             "set task.reward_model=PATH")
        return None
    models = [RewardModel(e.path, e.name, e.weight, device, e.key) for e in entries]
    check_names(models, taken)
    return LearnedRewards(models, replace_task=bool(reward_model), norm=norm, clip=clip)

