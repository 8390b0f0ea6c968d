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
PART = "part"                  # a record of such fields (LogProbs, EpisodePart)


def _axis(kind: str, optional: bool = False):
    return field(default=None, metadata={"axis": kind}) if optional else field(metadata={"axis": kind})


@dataclass(frozen=True)
class LogProbs:
    """Log-probs of the sampled tokens ([N, T]) and their provenance; None: not recorded."""
    old: Optional[torch.Tensor] = _axis(COMPLETION, optional=True)
    """log pi_old: the sampler's (stale rows, episodes), else the learner's before the update
    (Trainer._prepare); None: the learner's own forward stands in (one pass, ratio 1)."""
    engine: Optional[torch.Tensor] = _axis(COMPLETION, optional=True)
    """log pi_engine as the sampler drew each token, 0 off the mask (rollout correction)."""
    ref: Optional[torch.Tensor] = _axis(COMPLETION, optional=True)
    """log pi_ref: the reference model's forward (Trainer._prepare); None: no KL term."""
    behaviour_rows: Optional[torch.Tensor] = _axis(ROW, optional=True)
    """[N] bool, from ``concat``: the rows whose ``old`` is real (the rest placeholders for
    the learner's pi_old); None: every row's."""
    staleness: Optional[torch.Tensor] = _axis(ROW, optional=True)
    """[N] long, from engines: learner updates since the weights that sampled each row."""


@dataclass(frozen=True)
class EpisodePart:
    """What multi-turn rows add: each row's episode and its placed turn rewards."""
    records: List["Episode"] = _axis(TEXT)
    # each turn's weighted reward on its last token, a row summing to ``rewards`` (turn_reward)
    token_rewards: torch.Tensor = _axis(COMPLETION)


@dataclass
class RolloutBatch:
    """N = B*G sampled completions and everything the learner needs; each field's layout is its
    axis (TOKENS [N, P+T], COMPLETION [N, T], ROW [N], ...; PART: a record of such fields);
    optional ones may be None. Multi-turn rows: the completion holds every turn after the
    prompt; ``attention_mask`` is 1 on model turns and observations, ``mask`` on the model's
    own tokens only."""
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
    # {name: [N floats]}: each named reward (0 where missing)
    reward_parts: Optional[Dict[str, List[float]]] = _axis(COLUMNS, optional=True)
    logprobs: LogProbs = field(default_factory=LogProbs, metadata={"axis": PART})
    episodes: Optional[EpisodePart] = _axis(PART, optional=True)       # None: single-turn
    # the learner's, from the rest (Trainer._prepare)
    advantages: Optional[torch.Tensor] = _axis(COMPLETION, optional=True)  # the estimator's
    old_values: Optional[torch.Tensor] = _axis(COMPLETION, optional=True)  # critic V(s_t)
    returns: Optional[torch.Tensor] = _axis(COMPLETION, optional=True)  # value targets, detached

    @property
    def completion_ids(self) -> torch.Tensor:
        return self.input_ids[:, self.prompt_len:]  # [N, T]

    @property
    def num_sequences(self) -> int:
        return self.input_ids.shape[0]

    def replace(self, **changes) -> "RolloutBatch":
        """A new batch with some fields changed (a part given as a dict: only those fields)."""
        for name, value in changes.items():
            if name in _PARTS and isinstance(value, dict):
                changes[name] = dataclasses.replace(getattr(self, name), **value)
        return dataclasses.replace(self, **changes)

    def select(self, rows: torch.Tensor, text: bool = True) -> "RolloutBatch":
        """Some rows, every per-row field indexed (``text=False``: no text lists, no host sync)."""
        idx = rows.tolist() if text else []

        def pick(kind: str, value):
            if kind == TEXT:
                return list(map(value.__getitem__, idx))
            if kind == COLUMNS:
                return {key: list(map(column.__getitem__, idx)) for key, column in value.items()}
            return value[rows]
        return _mapped(self, pick)

    def cut(self, width: int) -> "RolloutBatch":
        """The first ``width`` completion columns (prompt kept); exact if the rest is padding."""
        def cut(kind: str, value):
            if kind == TOKENS:
                return value[:, :self.prompt_len + width]                    # [N, P+w]
            return value[:, :width] if kind == COMPLETION else value         # [N, w]
        return _mapped(self, cut)

    def to(self, device) -> "RolloutBatch":
        """Every tensor on ``device``."""
        return _mapped(self, lambda kind, v: v.to(device) if isinstance(v, torch.Tensor) else v)

    @staticmethod
    def concat(batches: Sequence["RolloutBatch"], pad_id: int) -> "RolloutBatch":
        """Batches stacked: prompts left-padded to the longest P, completions right-padded to the
        longest T (``pad_id`` in input_ids, 0 elsewhere); group ids renumbered. An optional field
        or part missing in some batches is None, except the old log-probs (``_cat_behaviour``)."""
        P = max(b.prompt_len for b in batches)
        T = max(b.mask.shape[1] for b in batches)
        offsets = torch.tensor([0] + [int(b.group_ids.max()) + 1 for b in batches[:-1]]).cumsum(0)
        parts = [b.replace(group_ids=b.group_ids + int(o)) for b, o in zip(batches, offsets)]

        def stack(kind: str, name: str, values: list):
            if name in _PAIRED:
                return None                                                  # below
            if kind == TEXT:
                return [x for v in values for x in v]
            if kind == COLUMNS:
                return _cat_columns(values, [b.num_sequences for b in parts])
            pad = pad_id if name == "input_ids" else 0
            return torch.cat([_pad(v, kind, P - b.prompt_len, b.mask.shape[1], T, pad)
                              for b, v in zip(parts, values)])
        old, behaviour = _cat_behaviour(parts, T)
        return _stacked(parts, stack).replace(prompt_len=P, logprobs=dict(old=old, behaviour_rows=behaviour))


_PARTS = tuple(f.name for f in fields(RolloutBatch) if f.metadata["axis"] == PART)
_PAIRED = ("old", "behaviour_rows")    # LogProbs fields stacked together by _cat_behaviour


def _mapped(record, fn):
    """``record`` with ``fn(kind, value)`` for each field set (parts entered; scalars kept)."""
    changes = {}
    for f in fields(record):
        kind, value = f.metadata["axis"], getattr(record, f.name)
        if value is not None and kind != SCALAR:
            changes[f.name] = _mapped(value, fn) if kind == PART else fn(kind, value)
    return dataclasses.replace(record, **changes)


def _stacked(records: Sequence, stack):
    """One record from several, ``stack(kind, name, values)`` per field (parts entered; scalars
    the first's); a field or part that any of them lacks is None."""
    changes: Dict[str, Any] = {}
    for f in fields(records[0]):
        kind, values = f.metadata["axis"], [getattr(r, f.name) for r in records]
        if kind == SCALAR:
            continue
        changes[f.name] = None if any(v is None for v in values) else \
            _stacked(values, stack) if kind == PART else stack(kind, f.name, values)
    return dataclasses.replace(records[0], **changes)


def _cat_columns(values: Sequence[Dict[str, List[float]]], rows: Sequence[int]) -> Dict[str, List[float]]:
    """Named per-row lists stacked: every name of any batch, 0.0 in the batches without it."""
    names = sorted({k for v in values for k in v})
    return {k: [x for v, n in zip(values, rows) for x in v.get(k, [0.0] * n)] for k in names}


def _cat_behaviour(batches: Sequence[RolloutBatch], T: int):
    """(old [N, T], behaviour_rows [N] bool) stacked, each None when not needed: rows without
    old log-probs get 0-filled placeholders, marked False in behaviour_rows."""
    if all(b.logprobs.old is None for b in batches):
        return None, None
    olds, rows = [], []
    for b in batches:
        n, t = b.mask.shape
        lp = b.logprobs
        has = lp.old is not None
        old = lp.old if has else b.mask.new_zeros(n, t)                                  # [n, t]
        olds.append(F.pad(old, (0, T - t)))                                              # [n, T]
        rows.append(lp.behaviour_rows if lp.behaviour_rows is not None and has else
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
    """An environment's answer to a turn (``observation`` None: nothing appended). ``info`` may hold
    ``stop`` (strings ending the next turn), ``success``, ``tool_calls``, ``tool_errors``."""
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
