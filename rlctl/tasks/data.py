"""Data-driven tasks (``task=jsonl``, docs/extending.md): prompts from data files, user rewards."""
from __future__ import annotations

import csv
import json
import math
import random
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from rlctl.tasks.task import RAW_PROMPT, SOURCE, register_task, task_options
from rlctl.tasks.scoring import RewardScorer
from rlctl.errors import DataError
from rlctl.tasks.rewards import RewardFn, parse_rewards
from rlctl.types import Example

# refused when read: far beyond any context (attention over T^2 positions)
MAX_PROMPT_CHARS = 1_000_000
Located = List[Tuple[str, Dict[str, Any]]]   # (where in the file, e.g. "a.jsonl:7", row)

FORMATS = ("auto", "jsonl", "json", "csv", "tsv", "parquet", "arrow", "hf")
_SUFFIX = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".csv": "csv",
           ".tsv": "tsv", ".parquet": "parquet", ".pq": "parquet", ".arrow": "arrow"}


def _pyarrow(what: str, path: Path):
    try:   # imported only for the Parquet/Arrow/datasets formats (a one-line error without it)
        import pyarrow
    except ImportError:
        raise DataError(f"reading {what} ('{path}') needs pyarrow: pip install pyarrow") from None
    return pyarrow


def _read_jsonl(path: Path) -> Located:
    rows = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{n}: invalid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{n}: each line must be a JSON object, "
                                 f"got {type(row).__name__}")
            rows.append((f"{path}:{n}", row))
    return rows


def _read_json(path: Path) -> Located:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return _read_jsonl(path)  # JSON Lines saved as .json
    if isinstance(data, dict) and len(data) == 1 and isinstance(next(iter(data.values())), list):
        data = next(iter(data.values()))  # {"data": [...]}
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise DataError(f"{path}: expected a JSON array of objects (or JSON Lines)")
    return _numbered(path, data, "item")


def _numbered(path: Path, rows: List[Dict[str, Any]], what: str) -> Located:
    return [(f"{path}: {what} {n}", r) for n, r in enumerate(rows, 1)]


def _read_csv(path: Path, delimiter: str) -> Located:
    with path.open(encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f, delimiter=delimiter)
        return [(f"{path}:{reader.line_num}", dict(r)) for r in reader]


def _read_parquet(path: Path) -> Located:
    _pyarrow("Parquet", path)
    import pyarrow.parquet as pq   # only for Parquet files; _pyarrow checked it is installed
    return _numbered(path, pq.read_table(path).to_pylist(), "row")


def _read_arrow(path: Path) -> Located:
    pa = _pyarrow("Arrow", path)
    with pa.memory_map(str(path)) as f:
        try:
            table = pa.ipc.open_stream(f).read_all()   # datasets' save_to_disk
        except pa.ArrowInvalid:
            f.seek(0)
            table = pa.ipc.open_file(f).read_all()
    return _numbered(path, table.to_pylist(), "row")


_READERS = {"jsonl": _read_jsonl, "json": _read_json, "csv": lambda p: _read_csv(p, ","),
            "tsv": lambda p: _read_csv(p, "\t"), "parquet": _read_parquet, "arrow": _read_arrow}


def _read_hf_dir(path: Path, key: str) -> Located:
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        raise DataError(f"{key}: '{path}' holds the splits {', '.join(splits)}; point it at "
                         f"one of them (e.g. {path / (splits[0] if splits else 'train')})")
    state = path / "state.json"
    if state.is_file():
        files = [path / d["filename"] for d in json.loads(state.read_text()).get("_data_files", [])]
        return [row for f in files for row in _read_arrow(f)]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in _SUFFIX)
    kinds = {_SUFFIX[p.suffix] for p in files}
    if not files:
        raise DataError(f"{key}: directory '{path}' has no data files "
                         f"({', '.join(sorted(_SUFFIX))}) and is not a saved datasets directory")
    if len(kinds) > 1:
        raise DataError(f"{key}: directory '{path}' mixes formats ({', '.join(sorted(kinds))}); "
                         "point it at one file")
    return [row for f in files for row in _READERS[_SUFFIX[f.suffix]](f)]


def load_records(path: Any, fmt: str = "auto", key: str = "task.train_path",
                 located: bool = False) -> List[Any]:
    """Rows of a data file or directory as dicts (``located``: (where, row)); ValueError naming ``key``."""
    if fmt not in FORMATS:
        raise DataError(f"invalid task.format '{fmt}'; valid: {', '.join(FORMATS)}")
    p = Path(str(path)).expanduser()
    if not p.exists():
        raise DataError(f"{key}: no such file or directory '{path}'")
    if fmt == "auto":
        if p.is_dir():
            fmt = "hf"
        elif p.suffix.lower() in _SUFFIX:
            fmt = _SUFFIX[p.suffix.lower()]
        else:
            raise DataError(f"{key}: cannot tell the format of '{path}' from its name; set "
                             f"task.format to one of {', '.join(FORMATS[1:])}")
    try:
        if fmt == "hf":
            if not p.is_dir():
                raise DataError(f"{key}: task.format=hf needs a directory, got the file '{path}'")
            rows = _read_hf_dir(p, key)
        else:
            if p.is_dir():
                raise DataError(f"{key}: '{path}' is a directory; use task.format=hf or auto")
            rows = _READERS[fmt](p)
    except UnicodeDecodeError as exc:
        raise DataError(f"{key}: '{path}' is not UTF-8 text ({exc.reason})") from None
    except OSError as exc:
        raise DataError(f"{key}: cannot read '{path}': {exc.strerror or exc}") from None
    except DataError:
        raise
    except Exception as exc:  # noqa: BLE001 - e.g. pyarrow's errors on a corrupt file
        raise DataError(f"{key}: cannot read '{path}' as {fmt}: {type(exc).__name__}: "
                         f"{' '.join(str(exc).split())[:160]}") from None
    if not rows:
        raise DataError(f"{key}: '{path}' has no rows")
    return rows if located else [r for _, r in rows]


def prompt_example(prompt: Any, fields: Dict[str, Any], where: str, key: str) -> Example:
    """The Example of a row's prompt (text, or chat messages kept in ``RAW_PROMPT`` with the
    last user message as text); DataError, one line, for anything else or an oversized one."""
    size = len(prompt) if isinstance(prompt, str) else len(json.dumps(prompt, default=str))
    if size > MAX_PROMPT_CHARS:
        raise DataError(f"{key}: {where}: the prompt has {size} characters, more than the "
                        f"{MAX_PROMPT_CHARS} any model here can take; shorten or drop that row")
    if isinstance(prompt, str):
        return Example(prompt=prompt, fields=fields)
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
        # chat messages: rendered by the chat template (prompt_format=chat) at bind time
        text = next((m.get("content", "") for m in reversed(prompt) if m.get("role") == "user"), "")
        return Example(prompt=str(text), fields={**fields, RAW_PROMPT: prompt})
    raise DataError(f"{key}: {where}: the prompt must be text (or chat messages), got "
                    f"{type(prompt).__name__}")


def check_messages(task, examples: Sequence[Example], field: str) -> None:
    """Chat-message prompts need ``task.prompt_format=chat`` (DataError, one line)."""
    if task_options(task).prompt_format != "chat" and any(RAW_PROMPT in ex.fields for ex in examples):
        raise DataError(f"the prompt field '{field}' holds chat messages; set task.prompt_format=chat")


@register_task("jsonl")
class DataTask:
    """Rows' ``prompt_field`` as prompts, other columns (or ``fields``) to the rewards; held
    out without ``eval_path``: ``num_eval`` rows (10%). Correct: reward >= the threshold."""

    name = "jsonl"

    def __init__(self, train_path: Optional[str] = None, eval_path: Optional[str] = None,
                 format: str = "auto", prompt_field: str = "prompt",
                 fields: Optional[Sequence[str]] = None, reward_fn: Optional[str] = None,
                 rewards: Optional[Sequence[Any]] = None, correct_threshold: float = 1.0,
                 num_eval: Optional[int] = None, seed: int = 1234,
                 reward_model: Optional[str] = None):
        if not train_path:
            raise DataError("task=jsonl needs task.train_path=PATH (a .jsonl, .csv, .parquet "
                             "file or a datasets directory)")
        if not isinstance(correct_threshold, (int, float)) or not math.isfinite(correct_threshold):
            raise DataError(f"invalid task.correct_threshold '{correct_threshold}'; must be a number")
        if num_eval is not None and (not isinstance(num_eval, int) or num_eval < 1):
            raise DataError(f"invalid task.num_eval '{num_eval}'; must be >= 1 (or null)")
        self.prompt_field, self.correct_threshold = prompt_field, float(correct_threshold)
        self.rewards: List[RewardFn] = parse_rewards(reward_fn, rewards, reward_model)
        self.reward_weights = {r.name: r.weight for r in self.rewards}
        # per sample unless a function is batched: a stuck sample leaves those before it scored
        self.score_in_batches = any(r.batched for r in self.rewards)
        train_rows = load_records(train_path, format, "task.train_path", located=True)
        if eval_path:
            eval_rows = load_records(eval_path, format, "task.eval_path", located=True)[:num_eval]
        else:
            if len(train_rows) < 2:
                raise DataError("task.train_path has one row: nothing to hold out for eval; "
                                 "set task.eval_path")
            k = num_eval if num_eval is not None else max(1, len(train_rows) // 10)
            if k >= len(train_rows):
                raise DataError(f"task.num_eval={k} leaves no training rows out of "
                                 f"{len(train_rows)}; set task.eval_path or a smaller num_eval")
            order = list(range(len(train_rows)))
            random.Random(seed).shuffle(order)
            held = set(order[:k])
            eval_rows = [train_rows[i] for i in sorted(held)]
            train_rows = [r for i, r in enumerate(train_rows) if i not in held]
        self.field_names = self._field_names([r for _, r in train_rows], fields)
        for r in self.rewards:
            r.check_fields(self.field_names, "task.reward_fn" if reward_fn else "task.rewards")
        self._train = [self._example(r, where, "task.train_path") for where, r in train_rows]
        self._eval = [self._example(r, where, "task.eval_path" if eval_path else "task.train_path")
                      for where, r in eval_rows]

    def _field_names(self, rows, fields) -> List[str]:
        if not any(self.prompt_field in r for r in rows):
            raise DataError(f"task.prompt_field '{self.prompt_field}' is not a column of the "
                             f"data; columns: {', '.join(map(str, rows[0]))}")
        if fields is None:
            return [str(k) for k in rows[0] if k != self.prompt_field]
        fields = [str(f) for f in fields]
        for f in fields:
            if f not in rows[0]:
                raise DataError(f"task.fields: '{f}' is not a column of the data; columns: "
                                 f"{', '.join(map(str, rows[0]))}")
        return fields

    def _example(self, row: Dict[str, Any], where: str, key: str) -> Example:
        if self.prompt_field not in row:
            raise DataError(f"{key}: {where} has no '{self.prompt_field}' (task.prompt_field)")
        fields = {**{f: row.get(f) for f in self.field_names}, SOURCE: where}
        return prompt_example(row[self.prompt_field], fields, where, key)

    def train_examples(self) -> List[Example]:
        self._check_messages()
        return list(self._train)

    def eval_examples(self) -> List[Example]:
        self._check_messages()
        return list(self._eval)

    def _check_messages(self) -> None:
        check_messages(self, self._train[:1] + self._eval[:1], self.prompt_field)

    @staticmethod
    def _args(example: Example):
        fields = {k: v for k, v in example.fields.items() if k not in (RAW_PROMPT, SOURCE)}
        return example.fields.get(RAW_PROMPT, example.prompt), fields

    def reward_components(self, example: Example, completion: str) -> Dict[str, float]:
        """Each reward function's raw value (raises what the user's function raises)."""
        prompt, fields = self._args(example)
        return {r.name: r.call_one(prompt, completion, fields) for r in self.rewards}

    def reward_components_batch(self, examples: Sequence[Example], completions: Sequence[str]
                                ) -> List[Dict[str, float]]:
        args = [self._args(ex) for ex in examples]
        prompts, fields = [a[0] for a in args], [a[1] for a in args]
        out: List[Dict[str, float]] = [{} for _ in examples]
        for r in self.rewards:
            for row, v in zip(out, r.call_batch(prompts, completions, fields)):
                row[r.name] = v
        return out

    def reward(self, example: Example, completion: str) -> float:
        """The weighted total through ``RewardScorer`` (``task.on_reward_error``), no time limit."""
        with RewardScorer(self, timeout_s=0) as scorer:
            return scorer.score_batch([example], [completion])[0]

    def correct_from_reward(self, example: Example, reward: float) -> bool:
        return reward >= self.correct_threshold

    def is_correct(self, example: Example, completion: str) -> bool:
        return self.correct_from_reward(example, self.reward(example, completion))
