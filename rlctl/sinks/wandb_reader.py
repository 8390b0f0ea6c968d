"""Read a wandb offline run file (`run-<id>.wandb`) without the network or `wandb sync`.

wandb 0.31 keeps an offline run only as this binary file (no `wandb-summary.json`) and
no longer ships a Python reader for it, so `rlctl inspect` and the tests read it here.

File layout (the LevelDB log format, as written by wandb-core; checked on real files):

    header   7 bytes: b":W&B", magic u16 LE = 0xBEE1, version u8 = 0
    blocks   32 KiB each, counted from the start of the file (the header sits inside
             the first block); a block is a sequence of chunks:
               crc u32 LE | length u16 LE | type u8 | data[length]
             crc = CRC-32 (IEEE, zlib) of the type byte followed by the data;
             type 1 = full record, 2 = first, 3 = middle, 4 = last part of a record.
             A chunk header never straddles a block: fewer than 7 bytes left in a
             block are zero padding.
    records  each reassembled record is a serialized `wandb_internal_pb2.Record`.

History items name their key either in `key` or as a path in `nested_key`; wandb 0.31
writes every history key (`reward/mean` included, the '/' is kept) as a one-element
`nested_key`. A path of several elements (a logged nested dict) is joined with '.',
as the wandb UI shows it. Values are JSON in `value_json` (or, in newer writers, in the
typed `value` oneof).

A truncated tail (a run killed mid-write) ends the read quietly; a CRC mismatch before
the end raises `ValueError`.

A logged wandb.Table is not in the run file itself: its history row holds a reference
(`<key>._type` = "table-file", `<key>.path`) to a JSON file under the run's `files/`
folder; `read_wandb_tables` follows it.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Any, Iterator

MAGIC_IDENT = b":W&B"
MAGIC_NUMBER = 0xBEE1
FILE_HEADER = struct.Struct("<4sHB")  # ident, magic, version: 7 bytes
CHUNK_HEADER = struct.Struct("<IHB")  # crc, length, type: 7 bytes
BLOCK_LEN = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def iter_raw_records(path: str | Path) -> Iterator[bytes]:
    """Yield the serialized records of a `.wandb` file, in write order."""
    data = Path(path).read_bytes()
    if len(data) < FILE_HEADER.size:
        raise ValueError(f"{path}: too short for a wandb run file ({len(data)} bytes)")
    ident, magic, version = FILE_HEADER.unpack_from(data, 0)
    if ident != MAGIC_IDENT or magic != MAGIC_NUMBER:
        raise ValueError(f"{path}: not a wandb run file (header {data[:7]!r})")
    if version != 0:
        raise ValueError(f"{path}: unsupported wandb run file version {version}")

    pos = FILE_HEADER.size
    parts: list[bytes] | None = None  # pieces of a record split over blocks
    while True:
        left_in_block = BLOCK_LEN - pos % BLOCK_LEN
        if left_in_block < CHUNK_HEADER.size:
            pos += left_in_block  # zero padding up to the next block
        if pos + CHUNK_HEADER.size > len(data):
            return  # end of file, or a truncated chunk header
        crc, length, ctype = CHUNK_HEADER.unpack_from(data, pos)
        start = pos + CHUNK_HEADER.size
        if ctype == 0 and length == 0:
            # Zero-filled (preallocated or padded) space: skip to the next block.
            pos += BLOCK_LEN - pos % BLOCK_LEN
            continue
        if pos % BLOCK_LEN + CHUNK_HEADER.size + length > BLOCK_LEN:
            raise ValueError(f"{path}: chunk at byte {pos} crosses a block boundary")
        if start + length > len(data):
            return  # truncated tail of a killed run
        chunk = data[start : start + length]
        if zlib.crc32(chunk, zlib.crc32(bytes([ctype]))) != crc:
            raise ValueError(f"{path}: CRC mismatch in chunk at byte {pos}")
        pos = start + length

        if ctype == FULL:
            parts = None
            yield chunk
        elif ctype == FIRST:
            parts = [chunk]
        elif ctype == MIDDLE and parts is not None:
            parts.append(chunk)
        elif ctype == LAST and parts is not None:
            parts.append(chunk)
            yield b"".join(parts)
            parts = None
        else:
            raise ValueError(f"{path}: unexpected chunk type {ctype} at byte {pos}")


def iter_records(path: str | Path) -> Iterator[Any]:
    """Yield parsed `wandb.proto.wandb_internal_pb2.Record` messages."""
    # wandb is optional and slow to import: only for reading a W&B run file
    from wandb.proto import wandb_internal_pb2 as pb

    for raw in iter_raw_records(path):
        record = pb.Record()
        record.ParseFromString(raw)
        yield record


def _item_key(item: Any) -> str:
    if item.key:
        return item.key
    return ".".join(item.nested_key)


def _item_value(item: Any) -> Any:
    kind = item.WhichOneof("value") if "value" in {o.name for o in item.DESCRIPTOR.oneofs} else None
    if kind is None:
        return json.loads(item.value_json) if item.value_json else None
    if kind == "none":
        return None
    if kind == "json":
        return json.loads(item.json)
    return getattr(item, kind)


def read_wandb_history(path: str | Path) -> list[dict[str, Any]]:
    """One dict per committed history row, keys as logged, plus wandb's `_step`,
    `_timestamp` and `_runtime`."""
    rows = []
    for record in iter_records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append({_item_key(it): _item_value(it) for it in record.history.item})
    return rows


def _apply_updates(target: dict[str, Any], updates: Any, removes: Any) -> None:
    for item in updates:
        value = json.loads(item.value_json) if item.value_json else None
        if item.key:
            target[item.key] = value
            continue
        node = target
        *parents, leaf = list(item.nested_key)
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = value
    for item in removes:
        if item.key:
            target.pop(item.key, None)
        elif item.nested_key:
            node = target
            *parents, leaf = list(item.nested_key)
            for name in parents:
                node = node.get(name, {})
            node.pop(leaf, None)


def read_wandb_config(path: str | Path) -> dict[str, Any]:
    """The run config (from the run record and later config updates), without wandb's
    own `_wandb` entry."""
    config: dict[str, Any] = {}
    for record in iter_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            _apply_updates(config, record.run.config.update, [])
        elif kind == "config":
            _apply_updates(config, record.config.update, record.config.remove)
    config.pop("_wandb", None)
    return config


def read_wandb_summary(path: str | Path) -> dict[str, Any]:
    """The final summary: every summary update applied in order, without `_wandb`."""
    summary: dict[str, Any] = {}
    for record in iter_records(path):
        if record.WhichOneof("record_type") == "summary":
            _apply_updates(summary, record.summary.update, record.summary.remove)
    summary.pop("_wandb", None)
    return summary


def find_wandb_run_file(run_dir: str | Path) -> Path | None:
    """The newest `run-<id>.wandb` under `run_dir` (searched recursively), or None."""
    root = Path(run_dir)
    if root.is_file() and root.suffix == ".wandb":
        return root
    if not root.is_dir():
        return None
    files = [p for p in root.rglob("run-*.wandb") if p.is_file()]
    if not files:
        return None
    return max(files, key=lambda p: p.stat().st_mtime_ns)


TABLE_TYPE = "table-file"


def read_wandb_tables(path: str | Path) -> dict[str, dict[str, Any]]:
    """The wandb.Tables of a run, by history key in the order logged:
    {key: {"step": <_step>, "columns": [...], "rows": [[...], ...]}}.

    `path`: the run file, or a directory holding one (`find_wandb_run_file`). A history row
    names a table by `<key>._type` = "table-file" and `<key>.path`, relative to the run's
    `files/` folder, where wandb wrote the table's JSON ({"columns", "data"}). A table whose
    file is missing (a run killed before wandb wrote it) is left out.
    """
    run_file = find_wandb_run_file(path)
    if run_file is None:
        raise ValueError(f"{path}: no wandb run file (run-*.wandb) there")
    files = run_file.parent / "files"
    tables: dict[str, dict[str, Any]] = {}
    for row in read_wandb_history(run_file):
        for name, value in row.items():
            key, dot, field = name.rpartition(".")
            if not (dot and field == "_type" and value == TABLE_TYPE and f"{key}.path" in row):
                continue
            table_file = files / row[f"{key}.path"]
            if not table_file.is_file():
                continue
            body = json.loads(table_file.read_text(encoding="utf-8"))
            tables[key] = {"step": row.get("_step"), "columns": list(body["columns"]),
                           "rows": [list(r) for r in body["data"]]}
    return tables
