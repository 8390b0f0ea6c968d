"""Typed containers passed between rollout, scoring and the learner. Shape letters: B prompts
per step, G samples per prompt, N = B * G sequences, P prompt length (left-padded), T completion
length (right-padded), V vocabulary size."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F


@dataclass
class Example:
    """One prompt of a task: the text fed to the model and what its reward needs."""
    prompt: str
    fields: Dict[str, Any] = field(default_factory=dict)


# How each field of a RolloutBatch is laid out; the operations below go by this alone.
TOKENS = "tokens"              # [N, P+T]: prompt left-padded, completion right-padded
COMPLETION = "completion"      # [N, T] (or [N, 1], broadcast along T)
ROW = "row"                    # [N]
TEXT = "text"                  # a list of N items (strings, or Episode records)
COLUMNS = "columns"            # a dict: name -> a list of N floats
SCALAR = "scalar"              # one value for the whole batch


def _axis(kind: str, optional: bool = False):
    return field(default=None, metadata={"axis": kind}) if optional else field(metadata={"axis": kind})


@dataclass
class RolloutBatch:
    """N = B*G sampled completions and everything the learner needs; each field's layout is its
    axis (TOKENS [N, P+T], COMPLETION [N, T], ROW [N], ...); optional ones may be None. Multi-turn
    rows: the completion holds every turn after the prompt; ``attention_mask`` is 1 on model
    turns and observations, ``mask`` on the model's own tokens only."""
    input_ids: torch.Tensor = _axis(TOKENS)           # long
    attention_mask: torch.Tensor = _axis(TOKENS)      # long; 1 on real prompt and completion tokens
    mask: torch.Tensor = _axis(COMPLETION)            # float; 1 on tokens that count (EOS included)
    truncated: torch.Tensor = _axis(ROW)              # bool; no EOS within the length limit
    rewards: torch.Tensor = _axis(ROW)                # float; task reward of each completion
    group_ids: torch.Tensor = _axis(ROW)              # long; group g is rows g*G .. g*G+G-1
    prompt_len: int = _axis(SCALAR)
    group_size: int = _axis(SCALAR)
    prompts: List[str] = _axis(TEXT)
    completions: List[str] = _axis(TEXT)
    # log pi_old at rollout time (None: the learner's own); log pi_ref (None: no KL term)
    old_logprobs: Optional[torch.Tensor] = _axis(COMPLETION, optional=True)
    ref_logprobs: Optional[torch.Tensor] = _axis(COMPLETION, optional=True)
    advantages: Optional[torch.Tensor] = _axis(COMPLETION, optional=True)  # the estimator's
    old_values: Optional[torch.Tensor] = _axis(COMPLETION, optional=True)  # critic V(s_t)
    returns: Optional[torch.Tensor] = _axis(COMPLETION, optional=True)  # value targets, detached
    # bool: the rows whose old_logprobs are real (the rest placeholders for pi_old); None: all
    behaviour_rows: Optional[torch.Tensor] = _axis(ROW, optional=True)
    # long: learner updates since the weights that sampled each row (async engines)
    staleness: Optional[torch.Tensor] = _axis(ROW, optional=True)
    # {name: [N floats]}: each named reward (0 where missing)
    reward_parts: Optional[Dict[str, List[float]]] = _axis(COLUMNS, optional=True)
    # episodes: each turn's weighted reward on its last token, each row summing to ``rewards``
    token_rewards: Optional[torch.Tensor] = _axis(COMPLETION, optional=True)
    episodes: Optional[List["Episode"]] = _axis(TEXT, optional=True)  # None: single-turn
    # log pi_engine as the sampler drew each token (0 off the mask): rlctl.core.rollout_correction
    engine_logprobs: Optional[torch.Tensor] = _axis(COMPLETION, optional=True)

    @property
    def completion_ids(self) -> torch.Tensor:
        return self.input_ids[:, self.prompt_len:]  # [N, T]

    @property
    def num_sequences(self) -> int:
        return self.input_ids.shape[0]

    def replace(self, **changes) -> "RolloutBatch":
        """A new batch with some fields changed (the others shared, not copied)."""
        return dataclasses.replace(self, **changes)

    def select(self, rows: torch.Tensor, text: bool = True) -> "RolloutBatch":
        """Some rows, every per-row field indexed (``text=False``: no text lists, no host sync)."""
        idx = rows.tolist() if text else []
        picked: Dict[str, Any] = {}
        for name, kind in _AXES:
            value = getattr(self, name)
            if value is None or kind == SCALAR:
                continue
            if kind == TEXT:
                picked[name] = list(map(value.__getitem__, idx))
            elif kind == COLUMNS:
                picked[name] = {}
                for key, column in value.items():
                    picked[name][key] = list(map(column.__getitem__, idx))
            else:
                picked[name] = value[rows]
        return dataclasses.replace(self, **picked)

    def cut(self, width: int) -> "RolloutBatch":
        """The first ``width`` completion columns (prompt kept); exact if the rest is padding."""
        cut: Dict[str, Any] = {}
        for name, kind in _AXES:
            value = getattr(self, name)
            if value is not None and kind == TOKENS:
                cut[name] = value[:, :self.prompt_len + width]               # [N, P+w]
            elif value is not None and kind == COMPLETION:
                cut[name] = value[:, :width]                                 # [N, w]
        return dataclasses.replace(self, **cut)

    @staticmethod
    def concat(batches: Sequence["RolloutBatch"], pad_id: int) -> "RolloutBatch":
        """Batches stacked: prompts left-padded to the longest P, completions right-padded to the
        longest T (``pad_id`` in input_ids, 0 elsewhere); group ids renumbered. An optional field
        missing in some batches is None, except old_logprobs (``_cat_behaviour``)."""
        P = max(b.prompt_len for b in batches)
        T = max(b.mask.shape[1] for b in batches)
        offsets = torch.tensor([0] + [int(b.group_ids.max()) + 1 for b in batches[:-1]]).cumsum(0)
        parts = [b.replace(group_ids=b.group_ids + int(o)) for b, o in zip(batches, offsets)]
        out: Dict[str, Any] = {"prompt_len": P}
        for f in fields(RolloutBatch):
            kind, values = f.metadata["axis"], [getattr(b, f.name) for b in parts]
            if kind == SCALAR or f.name in _PAIRED or any(v is None for v in values):
                continue
            if kind == TEXT:
                out[f.name] = [x for v in values for x in v]
                continue
            if kind == COLUMNS:
                out[f.name] = _cat_columns(values, [b.num_sequences for b in parts])
                continue
            pad = pad_id if f.name == "input_ids" else 0
            out[f.name] = torch.cat([_pad(v, kind, P - b.prompt_len, b.mask.shape[1], T, pad)
                                     for b, v in zip(parts, values)])
        out["old_logprobs"], out["behaviour_rows"] = _cat_behaviour(parts, T)
        out.update({f.name: None for f in fields(RolloutBatch)
                    if f.name not in out and f.default is None})
        return parts[0].replace(**out)


_AXES = tuple((f.name, f.metadata["axis"]) for f in fields(RolloutBatch))   # (name, layout)
_PAIRED = ("old_logprobs", "behaviour_rows")    # stacked together by _cat_behaviour


def _cat_columns(values: Sequence[Dict[str, List[float]]], rows: Sequence[int]) -> Dict[str, List[float]]:
    """Named per-row lists stacked: every name of any batch, 0.0 in the batches without it."""
    names = sorted({k for v in values for k in v})
    return {k: [x for v, n in zip(values, rows) for x in v.get(k, [0.0] * n)] for k in names}


def _cat_behaviour(batches: Sequence[RolloutBatch], T: int):
    """(old_logprobs [N, T], behaviour_rows [N] bool) stacked, each None when not needed: rows
    without old log-probs get 0-filled placeholders, marked False in behaviour_rows."""
    if all(b.old_logprobs is None for b in batches):
        return None, None
    olds, rows = [], []
    for b in batches:
        n, t = b.mask.shape
        has = b.old_logprobs is not None
        old = b.old_logprobs if has else b.mask.new_zeros(n, t)                          # [n, t]
        olds.append(F.pad(old, (0, T - t)))                                              # [n, T]
        rows.append(b.behaviour_rows if b.behaviour_rows is not None and has else
                    torch.full((n,), has, dtype=torch.bool, device=b.mask.device))       # [n]
    behaviour = torch.cat(rows)                                                          # [N]
    return torch.cat(olds), (None if bool(behaviour.all()) else behaviour)


def _pad(x: torch.Tensor, kind: str, left: int, t: int, T: int, value) -> torch.Tensor:
    """One batch's field padded from ``t`` to ``T`` columns (tokens: ``left`` more on the left)."""
    if kind == TOKENS:
        return F.pad(x, (left, T - t), value=value)                  # [n, P+T]
    if kind == COMPLETION and x.shape[1] == t:
        return F.pad(x, (0, T - t), value=value)                     # [n, T]
    return x                                                         # [n], or [n, 1] broadcast


# ---- multi-turn episodes ---------------------------------------------------------------
MODEL, OBSERVATION = "model", "observation"       # Span.role


@dataclass
class Turn:
    """One model turn: the decoded text and the exact sampled token ids (never re-tokenized)."""
    text: str
    ids: List[int]


@dataclass
class Step:
    """An environment's answer to a turn (``observation`` None: nothing appended; then ``done``
    or the model writes again). ``info`` may hold ``stop`` (strings ending the next turn),
    ``success``, ``tool_calls``, ``tool_errors``."""
    observation: Optional[str] = None
    reward: float = 0.0
    done: bool = False
    info: Dict[str, Any] = field(default_factory=dict)


@dataclass
class Span:
    """A piece of an episode's completion: columns [start, end) of ``completion_ids``."""
    role: str                # MODEL or OBSERVATION
    start: int
    end: int
    text: str
    reward: float = 0.0      # the environment's reward for this model turn (0 on observations)
    truncated: bool = False  # observation cut to rollout.episode.max_obs_tokens


# Episode.status: how it ended. Everything but "done" counts as truncated.
DONE, TURN_LIMIT, TOKEN_LIMIT, LENGTH_LIMIT = "done", "turn_limit", "token_limit", "length_limit"


@dataclass
class Episode:
    """How one row's episode went, turn by turn (JSON-serialisable with ``asdict``)."""
    spans: List[Span] = field(default_factory=list)
    status: str = DONE
    success: Optional[bool] = None
    tool_calls: int = 0
    tool_errors: int = 0
    env_errors: int = 0      # steps that raised or passed their time limit
    turn_rewards: List[float] = field(default_factory=list)   # one per model turn

    @property
    def turns(self) -> int:
        return sum(s.role == MODEL for s in self.spans)
