"""tests/wandb_file.py, the tests' reader of W&B offline run files, against files written
by the real wandb 0.31 (offline): the framing it assumes is the one wandb writes."""

import struct
import zlib

import pytest
from wandb_file import BLOCK_LEN, find_run_file, iter_records, read_config, read_history

from rlctl.sinks.wandb_sink import WandbSink

N_STEPS = 3000
BIG = "0123456789" * 8000  # an 80 kB config value: one record over three blocks


@pytest.fixture(scope="module")
def big_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("bigrun")
    sink = WandbSink(run_dir, project="p", name="big", run_config={"big": BIG, "nested": {"a": [1, 2]}})
    for step in range(N_STEPS):
        # a key of varying length makes records end at varying offsets, so some blocks
        # end in zero padding (fewer than 7 bytes left); seen in about every 10th block
        sink.log({"reward/mean": step / 8, "policy/clip_frac": 1 / (step + 1), "x": float(step),
                  "k" * (1 + step % 37): 1.0}, step=step)
    sink.close()
    return sink.run_file


def chunk_types(path):
    """Chunk types in file order, scanned independently of the reader."""
    data = path.read_bytes()
    pos, types = 7, []
    while pos + 7 <= len(data):
        if BLOCK_LEN - pos % BLOCK_LEN < 7:
            pos += BLOCK_LEN - pos % BLOCK_LEN
            continue
        crc, length, ctype = struct.unpack_from("<IHB", data, pos)
        types.append(ctype)
        pos += 7 + length
    return types


def test_header_layout(big_run):
    head = big_run.read_bytes()[:7]
    assert head[:4] == b":W&B"
    assert struct.unpack("<HB", head[4:]) == (0xBEE1, 0)
    # first chunk right after the 7-byte header, CRC over type byte + data
    crc, length, ctype = struct.unpack_from("<IHB", big_run.read_bytes(), 7)
    data = big_run.read_bytes()[14:14 + length]
    assert ctype == 1 and zlib.crc32(bytes([ctype]) + data) == crc


def test_multi_block_file_reads_back_exactly(big_run):
    assert big_run.stat().st_size > 4 * BLOCK_LEN
    types = set(chunk_types(big_run))
    assert {1, 2, 3, 4} <= types  # full, first, middle and last chunks all occur
    history = read_history(big_run)
    assert len(history) == N_STEPS
    for step, row in enumerate(history):
        assert row["_step"] == step
        assert row["reward/mean"] == step / 8
        assert row["policy/clip_frac"] == 1 / (step + 1)
        assert row["x"] == step
        assert row["k" * (1 + step % 37)] == 1
    config = read_config(big_run)
    assert config == {"big": BIG, "nested": {"a": [1, 2]}}


def test_truncated_tail_is_read_up_to_the_cut(big_run, tmp_path):
    data = big_run.read_bytes()
    cut = tmp_path / "cut.wandb"
    cut.write_bytes(data[: len(data) * 2 // 3 + 3])
    rows = read_history(cut)
    assert 0 < len(rows) < N_STEPS
    assert [r["_step"] for r in rows] == list(range(len(rows)))


def test_corruption_and_foreign_files_raise(big_run, tmp_path):
    data = bytearray(big_run.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad = tmp_path / "bad.wandb"
    bad.write_bytes(bytes(data))
    with pytest.raises(AssertionError, match="CRC"):
        read_history(bad)
    other = tmp_path / "other.wandb"
    other.write_bytes(b"PK\x03\x04 not a wandb file")
    with pytest.raises(AssertionError, match="not a wandb run file"):
        list(iter_records(other))


def test_find_run_file(big_run, tmp_path):
    assert find_run_file(tmp_path) is None
    assert find_run_file(tmp_path / "missing") is None
    assert find_run_file(big_run) == big_run
    assert find_run_file(big_run.parents[2]) == big_run
