"""Test-only reader of a wandb offline run file (`run-<id>.wandb`), for the tests that check
what the W&B sink wrote. wandb 0.31 ships no Python reader of its own, so this reads the
record framing (the LevelDB log format) and parses each record with wandb's own protobuf
class, `wandb.proto.wandb_internal_pb2.Record`:

    header   7 bytes: b":W&B", u16 LE 0xBEE1, u8 version 0
    blocks   32 KiB from the file's start, each a run of chunks
             crc u32 LE | length u16 LE | type u8 | data  (crc: CRC-32 of type byte + data;
             type 1 full record, 2 first, 3 middle, 4 last part); under 7 bytes left in
             a block are padding.

History keys come as `key` or as a `nested_key` path (joined with '.'); values are JSON.
A wandb.Table is a history row's reference (`<key>._type` = "table-file", `<key>.path`) to
a JSON file under the run's `files/` folder.
"""
from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Any, Iterator

from wandb.proto import wandb_internal_pb2 as pb

BLOCK_LEN = 32 * 1024
CHUNK = struct.Struct("<IHB")


def iter_records(path: Path) -> Iterator[Any]:
    """The file's `Record` messages in write order; a truncated tail ends the read."""
    data = Path(path).read_bytes()
    assert data[:7] == b":W&B" + struct.pack("<HB", 0xBEE1, 0), f"{path}: not a wandb run file"
    pos, parts = 7, []
    while True:
        if BLOCK_LEN - pos % BLOCK_LEN < CHUNK.size:
            pos += BLOCK_LEN - pos % BLOCK_LEN
        if pos + CHUNK.size > len(data):
            return
        crc, length, kind = CHUNK.unpack_from(data, pos)
        chunk = data[pos + CHUNK.size: pos + CHUNK.size + length]
        if kind == 0 and length == 0:  # zero-filled space: on to the next block
            pos += BLOCK_LEN - pos % BLOCK_LEN
            continue
        if len(chunk) < length:
            return
        assert zlib.crc32(bytes([kind]) + chunk) == crc, f"{path}: CRC mismatch at byte {pos}"
        pos += CHUNK.size + length
        parts = [chunk] if kind in (1, 2) else parts + [chunk]
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(b"".join(parts))
            yield record


def _key(item) -> str:
    return item.key or ".".join(item.nested_key)


def _value(item) -> Any:
    """A history value: JSON in `value_json`, or (newer writers) the typed `value` oneof."""
    kind = item.WhichOneof("value")
    if kind is None or kind == "none":
        return json.loads(item.value_json) if item.value_json else None
    return json.loads(item.json) if kind == "json" else getattr(item, kind)


def read_history(path: Path) -> list[dict[str, Any]]:
    """One dict per history row: the logged keys and wandb's `_step`, `_timestamp`, `_runtime`."""
    return [{_key(it): _value(it) for it in r.history.item}
            for r in iter_records(path) if r.WhichOneof("record_type") == "history"]


def _updates(kinds: tuple[str, ...], path: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for r in iter_records(path):
        kind = r.WhichOneof("record_type")
        if kind not in kinds:
            continue
        record = r.run.config if kind == "run" else getattr(r, kind)
        for item in record.update:
            *parents, leaf = [item.key] if item.key else list(item.nested_key)
            node = out
            for name in parents:
                node = node.setdefault(name, {})
            node[leaf] = json.loads(item.value_json)
    out.pop("_wandb", None)
    return out


def read_config(path: Path) -> dict[str, Any]:
    """The run's config (run record and config updates), without wandb's `_wandb`."""
    return _updates(("run", "config"), path)


def read_summary(path: Path) -> dict[str, Any]:
    """The final summary (every summary update in order), without `_wandb`."""
    return _updates(("summary",), path)


def find_run_file(run_dir: Path) -> Path | None:
    """The newest `run-<id>.wandb` under `run_dir` (or `run_dir` itself if it is one)."""
    root = Path(run_dir)
    if root.suffix == ".wandb" and root.is_file():
        return root
    files = list(root.rglob("run-*.wandb")) if root.is_dir() else []
    return max(files, key=lambda p: p.stat().st_mtime_ns) if files else None


def read_tables(run_dir: Path) -> dict[str, dict[str, Any]]:
    """{history key: {"step", "columns", "rows"}} of the run's logged wandb.Tables whose
    JSON file exists under `files/`."""
    run_file = find_run_file(run_dir)
    assert run_file is not None, f"{run_dir}: no wandb run file (run-*.wandb) there"
    tables = {}
    for row in read_history(run_file):
        for name, value in row.items():
            key = name[: -len("._type")]
            file = run_file.parent / "files" / str(row.get(f"{key}.path"))
            if name.endswith("._type") and value == "table-file" and file.is_file():
                body = json.loads(file.read_text(encoding="utf-8"))
                tables[key] = {"step": row.get("_step"), "columns": list(body["columns"]),
                               "rows": [list(r) for r in body["data"]]}
    return tables
