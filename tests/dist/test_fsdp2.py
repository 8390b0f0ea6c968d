"""hardware=fsdp2 (PyTorch FSDP2, weights sharded as DTensors) on CPU with gloo: 2 ranks
give one process's gradient; ranks that run different numbers of forwards while
generating do not hang; its torch.distributed.checkpoint reshards from 2 ranks to 1;
`rlctl train` runs it on 2 ranks (LoRA, separate and shared critics) and a SIGKILLed
2-rank run resumes to the uninterrupted run's metrics exactly."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from test_data_parallel import GRAD, TINY, _case, _grad, _load, _run, reference

RLCTL = [sys.executable, "-c", "from rlctl.cli import main; main()"]
ENV = dict(os.environ, OMP_NUM_THREADS="1")
AGG = "token-mean"


@pytest.fixture(scope="module")
def results(tmp_path_factory, build_once):
    """2 ranks: one float64 SGD step (after uneven forwards in ``sampling``), saved with
    DCP; then 1 process loading that checkpoint and taking no step."""
    out = tmp_path_factory.mktemp("fsdp2")
    for f in reference(build_once).glob("ref64-*.pt"):
        (out / f.name).symlink_to(f)
    two = _case(f"fsdp2g64-{AGG}", "fsdp2", AGG, dtype="float64", uneven=True, save=True, **GRAD)
    _run(out, 2, [two], timeout=150)     # a rank left waiting in a collective would hang here
    one = _case("fsdp2-load", "fsdp2", AGG, dtype="float64", load=str(out / f"{two['name']}-ckpt"),
                **dict(GRAD, steps=0))
    _run(out, 1, [one], timeout=150)
    return out


def test_two_ranks_give_one_process_gradient_in_float64(results):
    """FSDP2 on 2 ranks vs plain torch in 1 process, one SGD step's gradient in float64.
    As for plain torch (test_data_parallel: each entry a sum of <= 10^4 products of terms
    <= 10, so float64 summation order moves it by < 10^4 * 1.1e-16 * 10 = 1.1e-11), only
    the order of sums differs: FSDP2's reduce-scatter adds the two ranks' gradients where
    one process sums all rows at once. 1e-10 is that bound with a margin of 10; a lost
    rank's share or a wrong normaliser moves entries by their own size (> 1e-2)."""
    ref, got = _grad(results, f"ref64-{AGG}"), _grad(results, f"fsdp2g64-{AGG}")
    assert set(got) >= set(ref)
    assert {v.dtype for v in _load(results, f"fsdp2g64-{AGG}").values()} == {torch.float64}
    assert max(v.abs().max().item() for v in ref.values()) > 1e-2
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], atol=1e-10, rtol=0, msg=k)


def test_two_ranks_gather_the_weights_for_the_engines_in_bounded_buckets(results):
    """``weight_buckets`` on 2 FSDP2 ranks (each parameter's shards all-gathered, bucket by
    bucket): every parameter once, bitwise the full state rank 0 gathers in one piece; a
    bucket holds at most PART_MB MiB unless it is one tensor bigger than that."""
    import dp_worker

    state, parts = _load(results, f"fsdp2g64-{AGG}"), _load(results, f"fsdp2g64-{AGG}-parts")
    names = [k for part in parts for k in part]
    assert len(names) == len(set(names)) and set(state) - set(names) <= {"lm_head.weight"}
    assert all(torch.equal(part[k], state[k]) for part in parts for k in part)
    sizes = [sum(t.numel() * t.element_size() for t in part.values()) for part in parts]
    limit = dp_worker.PART_MB * 2**20
    assert all(s <= limit or len(p) == 1 for s, p in zip(sizes, parts)) and len(parts) > 3


def test_a_two_rank_checkpoint_loads_on_one_rank_exactly(results):
    """DCP reshards: the 2-rank run's weights after its step, loaded by 1 process, are the
    same numbers (a copy, no arithmetic: exact)."""
    two, one = _load(results, f"fsdp2g64-{AGG}"), _load(results, "fsdp2-load")
    init = _load(results, f"fsdp2g64-{AGG}-init")
    assert any(not torch.equal(two[k], init[k]) for k in two)       # the step moved weights
    for k in two:
        assert torch.equal(one[k], two[k]), k


TRAIN = [*RLCTL, "train", "hardware=fsdp2", "hardware.num_processes=2", "logger=jsonl",
         "logger.console=false", "task.num_eval=16", "trainer.prompts_per_step=4"]


def _train(*args, timeout=300):
    out = subprocess.run([*TRAIN, *args], env=ENV, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out


def _rows(run: Path):
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))}
            for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "step" in r}


def _exported(run: Path, weights: str):
    summary = json.loads((run / "summary.json").read_text())
    assert summary["num_processes"] == 2 and summary["backend"] == "fsdp2"
    state = load_file(run / "model" / weights)           # plain tensors, whole
    assert state and all(type(v) is torch.Tensor and v.numel() for v in state.values())


def test_two_rank_lora_run(tmp_path):
    """`rlctl train hardware=fsdp2 hardware.num_processes=2 model.lora.enabled=true`, in bf16
    (MixedPrecisionPolicy) with CPU offload: the adapters train, the reference is the
    sharded policy with its adapter off; one writer, the adapter exported."""
    run = tmp_path / "r"
    _train("model.lora.enabled=true", "algo.kl.coef=0.05", "hardware.precision=bf16",
           "hardware.cpu_offload=true", "trainer.steps=2", "trainer.eval_every=2", f"run.dir={run}")
    rows = _rows(run)
    assert sorted(rows) == [0, 1, 2] and rows[2]["optim/grad_norm"] > 0 and rows[2]["kl/k3"] > 0
    _exported(run, "adapter_model.safetensors")


STEPS = 4
PPO = ["algo=ppo", "algo.critic=separate", "model.gradient_checkpointing=true",
       "trainer.checkpoint_every=2", "trainer.eval_every=2", "logger.samples.every=2",
       f"trainer.steps={STEPS}"]


@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("ppo") / "full"
    _train(*PPO, f"run.dir={run}")
    return run


def test_two_rank_ppo_run_with_a_separate_critic(ppo_run):
    """PPO with a separate critic (its own FSDP2 root) under gradient checkpointing on 2
    ranks: every step logged once, the policy and the critic exported whole."""
    rows = _rows(ppo_run)
    assert sorted(rows) == list(range(STEPS + 1)) and rows[STEPS]["optim/grad_norm"] > 0
    _exported(ppo_run, "model.safetensors")
    assert (ppo_run / "critic" / "value_head.safetensors").exists()


def _tree(pid: int):
    """``pid`` and its descendants (the launcher's ranks run in sessions of their own)."""
    kids = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            kids.setdefault(int(stat.read_text().rsplit(")", 1)[1].split()[1]), []).append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    out, todo = [], [pid]
    while todo:
        out.append(todo.pop())
        todo += kids.get(out[-1], [])
    return out


@pytest.mark.slow   # two 2-rank runs beside ppo_run's: killed, resumed (~25 s each here)
def test_sigkill_then_resume_matches_uninterrupted(ppo_run, tmp_path):
    """The 2-rank PPO run SIGKILLed after step 3 resumes from its step-2 DCP checkpoint
    (policy, critic, AdamW shards) and logs exactly the uninterrupted run's metrics."""
    run = tmp_path / "killed"
    proc = subprocess.Popen([*TRAIN, *PPO, f"run.dir={run}"], env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        metrics = run / "metrics.jsonl"
        if metrics.exists() and '"step": 3,' in metrics.read_text():
            for pid in _tree(proc.pid):                   # the launcher and both ranks
                os.kill(pid, signal.SIGKILL)
            break
        time.sleep(0.05)
    proc.wait(timeout=60)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000002"]
    out = subprocess.run([*RLCTL, "train", "--resume", str(run)], env=ENV, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    full, resumed = _rows(ppo_run), _rows(run)
    assert sorted(resumed) == list(range(STEPS + 1))
    for step in range(STEPS + 1):
        assert resumed[step] == full[step], step
