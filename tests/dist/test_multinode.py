"""Several "nodes" on one machine: separate process trees that share only TCP on the
loopback interface (master 127.0.0.1, the SLURM node list names 127.0.0.1 and 127.0.0.2),
on free ports picked here. torchrun, SLURM-style environments (no SLURM) and rlctl's own
multi-node launcher (torchrun's agent, driven by `rlctl train hardware.nnodes=2`); a node
killed mid-run; --resume on both nodes."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rlctl.dist.launch import expand_nodelist, from_environment
from rlctl.errors import UserError
from test_data_parallel import GRAD, TINY, WORKER, _grad, reference

BIN = Path(sys.executable).parent
TINY_RUN = ["trainer.steps=2", "trainer.prompts_per_step=2", "algo.group_size=2", "logger=jsonl",
            "trainer.eval_every=0", "rollout.max_new_tokens=4", "run.save_model=false"]
BASE_ENV = {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
            and not k.startswith(("SLURM_", "RLCTL_LAUNCHER", "TORCHELASTIC_", "GROUP_"))}
BASE_ENV.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", WANDB_MODE="offline",
                DS_ACCELERATOR="cpu")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args, env=None, **kw) -> subprocess.Popen:
    return subprocess.Popen(args, env=dict(BASE_ENV, **(env or {})), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, **kw)


def finish(procs, timeout=120):
    outs = [p.communicate(timeout=timeout) for p in procs]
    return [(p.returncode, o, e) for p, (o, e) in zip(procs, outs)]


def rlctl_train(*args):
    return [sys.executable, "-m", "rlctl.cli", "train", *args]


def torchrun(node_rank: int, port: int, *args):
    return [str(BIN / "torchrun"), "--nnodes=2", "--nproc_per_node=1", f"--node_rank={node_rank}",
            "--master_addr=127.0.0.1", f"--master_port={port}", *args]


def error_lines(stderr: str):
    return [ln for ln in stderr.splitlines() if ln.startswith("error:")]


def assert_one_run(out: Path, steps: int) -> Path:
    """One run directory; metrics written once per step; a checkpoint part per rank."""
    (run,) = [p for p in out.iterdir() if p.is_dir()]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    logged = [r["step"] for r in rows if "reward/mean" in r]
    assert logged == list(range(1, steps + 1))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["num_processes"] == 2 and summary["steps"] == steps
    (ckpt,) = sorted((run / "checkpoints").iterdir())[-1:]
    assert sorted(p.name for p in ckpt.glob("rng-rank*.pt")) == ["rng-rank0.pt", "rng-rank1.pt"]
    return run


# ---- parsing the environment (no processes) -------------------------------------------
def test_slurm_nodelist_forms():
    assert expand_nodelist("node[01-03,07],login") == ["node01", "node02", "node03", "node07", "login"]
    assert expand_nodelist("a,b") == ["a", "b"]
    assert expand_nodelist("127.0.0.[1-2]") == ["127.0.0.1", "127.0.0.2"]
    with pytest.raises(UserError, match="cannot read the range"):
        expand_nodelist("n[a-b]")


def test_environment_describes_the_group():
    g = from_environment(29500, {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                                 "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"})
    assert (g.rank, g.world_size, g.local_rank, g.master_addr, g.master_port) == (3, 4, 1, "10.0.0.1", 1234)
    g = from_environment(29555, {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                                 "SLURM_JOB_NODELIST": "gpu[07-10]"})
    assert (g.rank, g.world_size, g.local_rank, g.master_addr, g.master_port) == (5, 8, 1, "gpu07", 29555)
    assert from_environment(1, {}) is None
    with pytest.raises(UserError, match="MASTER_ADDR"):
        from_environment(1, {"RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(UserError, match=r"rank 2 is not in \[0, 2\)"):
        from_environment(1, {"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"})


# ---- gradients through a torchrun group ------------------------------------------------
def test_torchrun_two_nodes_same_gradient_as_one_process(tmp_path, build_once):
    """The data-parallel harness (dp_worker.py) with its group made by two torchrun trees
    over TCP (env://, no file rendezvous): plain torch in float64 and ZeRO-2 in float32,
    one SGD step's gradient vs one process on the same global batch. Tolerances as in
    test_data_parallel: float64 only reorders sums (< 1.1e-11 per entry, bound 1e-10);
    float32 vs the float64 value, 1e-4 of the largest entry."""
    agg = "token-mean"
    ref_dir = reference(build_once)         # one process, float64 (shared with test_data_parallel)
    cases = [{"name": "tr64", "backend": "torch", "agg": agg, "tiny": TINY, "dtype": "float64", **GRAD},
             {"name": "z2g32", "backend": "deepspeed", "zero_stage": 2, "agg": agg, "tiny": TINY, **GRAD}]
    port = free_port()
    results = finish([start(torchrun(r, port, str(WORKER), str(tmp_path), json.dumps(cases)))
                      for r in (0, 1)], timeout=180)
    for code, out, err in results:
        assert code == 0, err[-3000:]
    ref = _grad(ref_dir, f"ref64-{agg}")
    scale = max(v.abs().max().item() for v in ref.values())
    assert scale > 1e-2                                               # a real gradient
    for name, tol in (("tr64", 1e-10), ("z2g32", 1e-4 * scale)):
        got = _grad(tmp_path, name)
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], atol=tol, rtol=0, msg=f"{name}: {k}")


# ---- rlctl train under launchers -------------------------------------------------------
def test_torchrun_two_nodes_one_run_directory(tmp_path):
    port = free_port()
    args = ["-m", "rlctl.cli", "train", *TINY_RUN, f"run.output_dir={tmp_path / 'out'}"]
    results = finish([start(torchrun(r, port, *args)) for r in (0, 1)])
    for code, out, err in results:
        assert code == 0, err[-3000:]
    assert "run dir:" in results[0][1] and "run dir:" not in results[1][1]   # rank 0 reports
    assert_one_run(tmp_path / "out", 2)


def test_slurm_environment_zero2_and_run_dir(tmp_path):
    """srun's variables (set here, no SLURM): the master is the node list's first host."""
    port, run = free_port(), tmp_path / "job"
    procs = [start(rlctl_train(*TINY_RUN, "hardware=deepspeed", "hardware.zero_stage=2",
                               f"run.dir={run}", f"hardware.master_port={port}"),
                   env={"SLURM_PROCID": str(r), "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
                        "SLURM_JOB_NODELIST": "127.0.0.[1-2]"}) for r in (0, 1)]
    for code, out, err in finish(procs):
        assert code == 0, err[-3000:]
    assert_one_run(tmp_path, 2)
    assert json.loads((run / "summary.json").read_text())["backend"] == "deepspeed"


def test_bad_launches_are_one_line(tmp_path):
    """A world size that does not divide trainer.prompts_per_step; a rank whose master
    never answers (a free port nobody listens on), within hardware.dist_timeout_s."""
    env = {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    lost = dict(env, RANK="1", WORLD_SIZE="2")
    t0 = time.monotonic()
    results = finish([start(rlctl_train(*TINY_RUN, f"run.output_dir={tmp_path}"), env=env),
                      start(rlctl_train(*TINY_RUN, f"run.output_dir={tmp_path}",
                                        "hardware.dist_timeout_s=3"), env=lost)])
    (c1, _, e1), (c2, _, e2) = results
    assert c1 == 2 and error_lines(e1) == [e1.strip()] and "world size 3" in e1, e1
    assert "divide trainer.prompts_per_step=2" in e1
    assert c2 == 2 and len(error_lines(e2)) == 1 and "cannot reach the master" in e2, e2
    assert "hardware.dist_timeout_s=3" in e2 and "Traceback" not in e2
    assert time.monotonic() - t0 < 60
    assert not list(tmp_path.iterdir())              # nothing written


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants (rlctl's ranks run in their own sessions,
    so a process-group kill would miss them): a node that dies at once."""
    os.kill(pid, signal.SIGSTOP)                  # no more children, no PDEATHSIG yet
    kids = [k for task in Path(f"/proc/{pid}/task").iterdir()   # every thread's (torchrun's
            for k in (task / "children").read_text().split()]    # agent starts the ranks in one)
    for kid in kids:
        kill_tree(int(kid))
    os.kill(pid, signal.SIGKILL)


def _own_node(rank: int, port: int, *args):
    return start(rlctl_train(*args, "hardware.nnodes=2", f"hardware.node_rank={rank}",
                             "hardware.master_addr=127.0.0.1", f"hardware.master_port={port}"))


@pytest.mark.slow   # ~25-60 s on a 2-core machine: three 2-node runs (killed, resumed, the
# uninterrupted reference: its node launchers in this process), each rank importing torch,
# and node 0 waiting up to hardware.dist_timeout_s=20 for the node it lost; each phase is the claim
def test_own_launcher_two_nodes_kill_one_then_resume(tmp_path, rlctl_app):
    """rlctl's own launcher, one rank per node. Node 1 dies (its whole process tree,
    SIGKILL) after the first checkpoint: node 0 stops with one line naming the newest
    checkpoint within hardware.dist_timeout_s, that checkpoint is whole, and --resume on
    both nodes continues to the end with every step logged once. The first launch asks for
    far more steps than any machine runs before the kill (8 steps could finish first on a
    fast one); the resume sets the end two steps past the newest checkpoint."""
    run, port = tmp_path / "job", free_port()
    args = [*TINY_RUN, "trainer.steps=100000", "trainer.checkpoint_every=1", "trainer.keep_checkpoints=2",
            f"run.dir={run}", "hardware.dist_timeout_s=20"]
    node0, node1 = _own_node(0, port, *args), _own_node(1, port, *args)
    deadline = time.monotonic() + 90
    # any checkpoint: with keep_checkpoints=2, step 1's is gone once step 3 saves, and a
    # poll that missed it would wait out the deadline while the nodes run thousands of steps
    while not list((run / "checkpoints").glob("step-*[0-9]")) and time.monotonic() < deadline:   # not .tmp
        time.sleep(0.2)
    kill_tree(node1.pid)
    t0 = time.monotonic()
    code, out, err = finish([node0], timeout=60)[0]
    node1.wait()
    assert code != 0 and time.monotonic() - t0 < 20, (code, err[-2000:])
    assert len(error_lines(err)) == 1 and "Traceback" not in err, err[-2000:]
    assert "lost contact with another rank" in err and "newest checkpoint" in err, err
    from rlctl.storage import checkpoint
    last = checkpoint.latest_checkpoint(run)
    done = checkpoint.read_state(last)["step"]
    assert done >= 1                                                 # whole and readable
    steps = done + 2
    assert len(list(last.glob("rng-rank*.pt"))) == 2
    # a resume with another world size is refused in one line (in-process: one node, no
    # launch; the refusal comes before anything would start)
    refused = rlctl_app("train", "--resume", str(run), "hardware.nnodes=1")
    code1, e1 = refused.returncode, refused.stderr
    assert code1 == 2 and "written by 2" in e1 and error_lines(e1) == [e1.strip()], e1
    port = free_port()
    more = ["hardware.master_addr=127.0.0.1", f"hardware.master_port={port}"]
    more.append(f"trainer.steps={steps}")
    procs = [start(rlctl_train("--resume", str(run), f"hardware.node_rank={r}", *more)) for r in (0, 1)]
    for c, o, e in finish(procs):
        assert c == 0, e[-3000:]
    assert_one_run(tmp_path, steps)
    # the killed and resumed run logs what an uninterrupted 2-node run of as many steps logs
    # (per-rank RNG states and the data order are in the checkpoint: the same numbers, not close)
    ref = tmp_path.parent / f"{tmp_path.name}-ref"
    same = [a for a in args if not a.startswith(("run.dir=", "trainer.steps=", "hardware.dist_timeout_s="))]
    assert _two_nodes_here([*same, f"trainer.steps={steps}", f"run.dir={ref}"]) == [0, 0]
    assert _rows(run) == _rows(ref)


def _two_nodes_here(overrides) -> list:
    """Both nodes' launchers (``launch_node``, what `rlctl train hardware.nnodes=2` runs
    after its checks) in this process, one thread each: the same two rank processes, each
    running the same `rlctl train` command in the same TCP group, without two launcher
    interpreters. Returns the nodes' exit codes."""
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from rlctl.dist.launch import launch_node, node_argv

    port = free_port()
    argv = node_argv([*overrides, "hardware.nnodes=2", "hardware.master_addr=127.0.0.1",
                      f"hardware.master_port={port}"], None, None)
    hws = [SimpleNamespace(nnodes=2, node_rank=r, num_processes=1, master_addr="127.0.0.1",
                           master_port=port, num_threads=1, dist_timeout_s=300.0)
           for r in (0, 1)]
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda hw: launch_node(argv + [f"hardware.node_rank={hw.node_rank}"], hw), hws))


def _rows(run: Path) -> dict:
    """step -> the step's metrics, timings left out (they differ from run to run)."""
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))}
            for r in rows if "step" in r}
