import json
import math

import numpy as np
import torch

from rlctl.sinks import JsonlSink, read_jsonl


def test_jsonl_round_trip(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    sink = JsonlSink(path)
    rows = [
        {"reward/mean": 0.25, "policy/clip_frac": 0.0, "length/mean": 6.5},
        {"reward/mean": 0.5, "policy/clip_frac": 0.125, "length/mean": 7.0},
        {"reward/mean": 0.75, "policy/clip_frac": 0.0625, "eval/exact_match": 1.0},
    ]
    for step, row in enumerate(rows):
        sink.log(row, step=step)
    # Flushed per line: readable before close (a killed run keeps its lines).
    assert read_jsonl(path) == [{"step": s, **r} for s, r in enumerate(rows)]
    sink.close()
    lines = path.read_text().splitlines()
    assert len(lines) == 3
    assert list(json.loads(lines[0])) == ["step", "reward/mean", "policy/clip_frac", "length/mean"]


def test_jsonl_converts_tensors_numpy_and_non_finite(tmp_path):
    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(path)
    sink.log(
        {
            "a": torch.tensor(0.5),
            "b": np.float32(0.25),
            "c": np.int64(3),
            "d": 2,
            "nan": float("nan"),
            "inf": torch.tensor(float("inf")),
            "ninf": -math.inf,
        },
        step=torch.tensor(7),
    )
    sink.summary({"final/eval/exact_match": torch.tensor(0.75), "bad": float("nan"), "name": "x"})
    sink.close()
    lines = path.read_text().splitlines()
    # strict JSON: no NaN / Infinity tokens anywhere
    for line in lines:
        json.loads(line, parse_constant=lambda c: (_ for _ in ()).throw(AssertionError(c)))
    row = json.loads(lines[0])
    assert row == {"step": 7, "a": 0.5, "b": 0.25, "c": 3.0, "d": 2.0,
                   "nan": None, "inf": None, "ninf": None}
    assert all(isinstance(row[k], float) for k in "abcd")
    assert json.loads(lines[1]) == {"summary": {"final/eval/exact_match": 0.75, "bad": None, "name": "x"}}
    assert read_jsonl(path) == [row]  # summary line is not a metric row


def test_jsonl_appends_and_skips_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(path)
    sink.log({"x": 1.0}, step=1)
    sink.close()
    with path.open("a") as f:
        f.write('{"step": 2, "x": ')  # a run killed mid-line
    assert read_jsonl(path) == [{"step": 1, "x": 1.0}]
