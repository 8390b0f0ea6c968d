"""2-process data parallel equals 1 process on the same global batch (real DeepSpeed
engines and torch.distributed on CPU with gloo), for ZeRO 0-3 and two aggregation modes."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

WORKER = Path(__file__).with_name("dp_worker.py")
TINY = {k: v for k, v in OmegaConf.to_container(OmegaConf.load(
    Path(__file__).parents[2] / "rlctl/conf/model/tiny.yaml"), resolve=False).items()
    if k in ("hidden_size", "num_layers", "num_heads", "warmup_steps", "warmup_lr")}
AGGS = ["token-mean", "seq-mean-token-mean"]
STAGES = [0, 1, 2, 3]


def _run(out_dir: Path, world: int, cases: list, timeout=600) -> None:
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   RLCTL_DIST_INIT=f"file://{out_dir / f'.init{world}'}", OMP_NUM_THREADS="1",
                   DS_ACCELERATOR="cpu")
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(out_dir), json.dumps(cases)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("dp")
    reference = [{"name": f"ref-{a}", "backend": "torch", "agg": a, "tiny": TINY} for a in AGGS]
    _run(out, 1, reference)
    cases = [{"name": f"torch2-{a}", "backend": "torch", "agg": a, "tiny": TINY} for a in AGGS]
    cases += [{"name": f"z{z}-{a}", "backend": "deepspeed", "zero_stage": z, "agg": a, "tiny": TINY}
              for z in STAGES for a in AGGS]
    _run(out, 2, cases)
    return out


def _load(out: Path, name: str):
    return torch.load(out / f"{name}.pt", weights_only=True)


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("name", ["torch2"] + [f"z{z}" for z in STAGES])
def test_two_ranks_match_one_process(results, name, agg):
    ref, got = _load(results, f"ref-{agg}"), _load(results, f"{name}-{agg}")
    assert ref.keys() == got.keys()
    moved = max((ref[k] - _initial()[k]).abs().max().item() for k in ref)
    assert moved > 1e-4                                     # training really changed weights
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], atol=1e-5, rtol=0, msg=f"{name}/{agg}: {k}")


_INIT = {}


def _initial():
    if not _INIT:
        from rlctl.models.loading import load_model_and_tokenizer
        model, _ = load_model_and_tokenizer("tiny", cache_dir=os.environ.get("RLCTL_CACHE"), **TINY)
        _INIT.update({k: v.detach().clone() for k, v in model.state_dict().items()})
    return _INIT


def test_deepspeed_two_processes_through_the_console_script(tmp_path):
    """`rlctl train hardware=deepspeed hardware.zero_stage=2 hardware.num_processes=2`:
    rlctl launches the ranks itself; only rank 0 writes metrics and the model."""
    import shutil

    from rlctl.sinks.jsonl import read_jsonl
    rlctl = shutil.which("rlctl") or str(Path(sys.executable).parent / "rlctl")
    out = subprocess.run([rlctl, "train", "hardware=deepspeed", "hardware.zero_stage=2",
                          "hardware.num_processes=2", "trainer.steps=3", "trainer.eval_every=3",
                          "task.num_eval=32", "logger=jsonl", f"run.output_dir={tmp_path}"],
                         capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    run = next(p for p in tmp_path.iterdir() if p.is_dir())
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]         # one writer, not two
    summary = json.loads((run / "summary.json").read_text())
    assert summary["num_processes"] == 2 and summary["backend"] == "deepspeed"
    assert (run / "model" / "model.safetensors").exists() and (run / "rank1.log").exists()
    # 4 prompts per rank x G=8, summed over ranks: global counts, not per-rank ones
    assert rows[1]["length/mean"] > 0 and 0 <= rows[3]["eval/exact_match"] <= 1


def test_bad_process_count_is_one_line():
    from rlctl.compose import ConfigError, compose
    with pytest.raises(ConfigError, match="hardware.num_processes=3 must be >= 1 and divide"):
        compose(["hardware.num_processes=3"])
