"""Nodes that must agree before they train together, as separate process trees on
127.0.0.1 (free ports picked here): rlctl's own multi-node launcher and torchrun compare
every node's resolved config once the group forms (less the per-node keys), a node_rank
started twice is refused at once, a node without node 0 (or on the wrong port) gives up
in one line on time, and a stopped run tells each node its own resume command.

Timing: a clock for a wait starts only once the node's own stop handler is installed
(``_catches_sigterm``: its launcher is then in torchrun's rendezvous, or has started its
rank), never at process start on a loaded machine.
The mismatch tests use a long hardware.dist_timeout_s: they end when the nodes meet, not
when a wait runs out."""
import contextlib
import signal
import time

from omegaconf import OmegaConf

from rlctl.dist import launch
from rlctl.config.compose import compose
from test_multinode import TINY_RUN, error_lines, finish, free_port, kill_tree, rlctl_train, start, torchrun
from proc_tools import _catches_sigterm, _wait_until

MISMATCH_TAIL = "; start every node with the same config"


def _net(port: int, node: int, nnodes: int = 2):
    return [f"hardware.nnodes={nnodes}", f"hardware.node_rank={node}", "hardware.master_addr=127.0.0.1",
            f"hardware.master_port={port}"]


def _node(port: int, node: int, *args, cwd=None):
    return start(rlctl_train(*TINY_RUN, *args, *_net(port, node)), cwd=cwd)


def _cleanup(procs) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(OSError):
                kill_tree(p.pid)


def _flat(*overrides):
    cfg = compose(list(overrides), None).cfg
    OmegaConf.resolve(cfg)
    return launch.compared(OmegaConf.to_container(cfg))


def test_per_node_keys_are_not_compared_and_the_rest_are():
    """What a node may set for itself (which node it is, how it reaches node 0, its threads
    and wait limit, its model cache, where rank 0 puts the run, the loggers only rank 0
    runs) makes no mismatch; any other key does, named with both values (hand-written
    expected lines)."""
    base = _flat("hardware.nnodes=2", "trainer.lr=1e-4", "run.save_model=true")
    own = _flat("hardware.nnodes=2", "trainer.lr=1e-4", "run.save_model=true", "hardware.node_rank=1",
                "hardware.master_addr=10.0.0.1", "hardware.master_port=29999", "hardware.num_threads=7",
                "hardware.dist_timeout_s=9", "model.cache_dir=/scratch/node1", "run.dir=/elsewhere",
                "run.output_dir=/other", "run.name=x", "logger.console=false", "logger.wandb=false")
    assert launch.mismatch([launch.payload(base, "node 0"), launch.payload(own, "node 1")]) is None
    other = _flat("hardware.nnodes=2", "trainer.lr=0.05", "run.save_model=false", "hardware.node_rank=1")
    # one node with 2 ranks: named once
    got = launch.mismatch([launch.payload(base, "node 0")] + [launch.payload(other, "node 1")] * 2)
    assert got == ("config differs between nodes: run.save_model is true on node 0 and false on node 1, "
                   "trainer.lr is 0.0001 on node 0 and 0.05 on node 1" + MISMATCH_TAIL)


def test_own_launcher_nodes_with_different_configs_stop_in_one_line(tmp_path):
    """Node 0 trainer.lr=1e-4 seed=0, node 1 trainer.lr=0.05 seed=1: both exit 2 with the
    same one stderr line naming both keys and both values, and nothing is written."""
    port, out = free_port(), tmp_path / "out"
    args = ["hardware.dist_timeout_s=120", f"run.output_dir={out}"]
    procs = [_node(port, 0, *args, "trainer.lr=1e-4", "seed=0"),
             _node(port, 1, *args, "trainer.lr=0.05", "seed=1")]
    try:
        results = finish(procs, timeout=150)
    finally:
        _cleanup(procs)
    want = ("error: config differs between nodes: seed is 0 on node 0 and 1 on node 1, trainer.lr is "
            "0.0001 on node 0 and 0.05 on node 1" + MISMATCH_TAIL)
    for code, _, err in results:
        assert code == 2 and err.strip() == want, (code, err[-2000:])
    assert not out.exists() or not list(out.iterdir())


def test_torchrun_nodes_with_different_configs_stop_in_one_line(tmp_path):
    """The same under torchrun (its node_rank is GROUP_RANK): each worker's error line names
    the differing key (torchrun then adds its own failure report), nothing is written."""
    port, out = free_port(), tmp_path / "out"
    args = ["-m", "rlctl.cli", "train", *TINY_RUN, f"run.output_dir={out}", "hardware.dist_timeout_s=120"]
    procs = [start(torchrun(r, port, *args, f"trainer.steps={2 + 2 * r}")) for r in (0, 1)]
    try:
        results = finish(procs, timeout=150)
    finally:
        _cleanup(procs)
    want = "error: config differs between nodes: trainer.steps is 2 on node 0 and 4 on node 1" + MISMATCH_TAIL
    for code, _, err in results:
        assert code != 0 and want in error_lines(err), (code, err[-2000:])
    assert not out.exists() or not list(out.iterdir())


def _timed(procs, limit: float):
    """Per process: (seconds from its start to its stop handler, i.e. the node's start-up;
    seconds from then to its exit; its (code, stdout, stderr)), polled together."""
    born, entered, ended = time.monotonic(), {}, {}
    deadline = born + limit
    while len(ended) < len(procs):
        assert time.monotonic() < deadline, f"nodes still running after {limit} s"
        now = time.monotonic()
        for i, p in enumerate(procs):
            if i not in entered and p.poll() is None:
                with contextlib.suppress(OSError, ValueError, StopIteration):   # just ended
                    if _catches_sigterm(p.pid):
                        entered[i] = now
            if i not in ended and p.poll() is not None:
                ended[i] = now
        time.sleep(0.05)
    results = finish(procs, timeout=30)
    assert len(entered) == len(procs), [r[2][-2000:] for r in results]
    return [(entered[i] - born, ended[i] - entered[i], results[i]) for i in range(len(procs))]


def test_a_node_without_its_peer_gives_up_in_one_line_on_time(tmp_path):
    """Node 0 on one port, node 1 on another nobody serves (the wrong master port, or no
    node 0): node 1 "cannot reach the master", node 0 "rank(s) 1 never connected", each
    exit 2 with exactly one stderr line (c10d's wait printed about 35 lines of C++ frames
    first), hardware.dist_timeout_s after its launcher entered the rendezvous."""
    timeout, out = 10, tmp_path / "out"
    args = [f"hardware.dist_timeout_s={timeout}", f"run.output_dir={out}"]
    port0, port1 = free_port(), free_port()
    procs = [_node(port0, 0, *args), _node(port1, 1, *args, cwd=tmp_path)]
    try:
        timed = _timed(procs, 300)
    finally:
        _cleanup(procs)
    wants = [f"rank 0 of 2 (rlctl): the other ranks did not all join at 127.0.0.1:{port0} within "
             f"hardware.dist_timeout_s={timeout}: rank(s) 1 never connected",
             f"rank 1 of 2 (rlctl): it cannot reach the master at 127.0.0.1:{port1} within "
             f"hardware.dist_timeout_s={timeout}"]
    for want, (startup, waited, (code, _, err)) in zip(wants, timed):
        assert code == 2 and len(err.strip().splitlines()) == 1 and want in err, (code, err[-3000:])
        # not early (0.5 s: the 0.05 s poll that saw the handler, late); and leaving
        # takes less than starting did (imports, compose)
        assert timeout - 0.5 <= waited < timeout + startup, (waited, startup)
    assert not out.exists() or not list(out.iterdir())


def test_a_node_rank_started_twice_is_refused_and_a_stop_prints_each_nodes_resume(tmp_path):
    """Node 0 and two node-1 processes (plain training): one node 1 is refused at once
    with one line (exit 2; which one is a race), the other trains with node 0. Then SIGINT
    to both nodes after a checkpoint: each exits 130 and prints the resume command that
    node needs (its own hardware.node_rank: node_rank=0 is in the run's recipe, so node 1
    as told before would start a second node 0)."""
    run, port = tmp_path / "job", free_port()
    args = ["trainer.steps=100000", "trainer.checkpoint_every=1", "hardware.dist_timeout_s=120", f"run.dir={run}"]
    node0, twins = _node(port, 0, *args), [_node(port, 1, *args, cwd=tmp_path) for _ in range(2)]
    procs = [node0, *twins]
    try:
        _wait_until(lambda: any(p.poll() is not None for p in procs), 150, "one node 1 refused")
        assert node0.poll() is None, node0.communicate()[1][-2000:]
        loser = next(p for p in twins if p.poll() is not None)
        node1 = next(p for p in twins if p is not loser)
        code, _, err = finish([loser], timeout=30)[0]
        assert code == 2 and err.strip() == ("error: rank 1 is claimed twice: is hardware.node_rank=1 started "
                                             "on two machines? (start each node once)"), (code, err[-2000:])
        _wait_until(lambda: node0.poll() is not None or list((run / "checkpoints").glob("step-*[0-9]")), 150,
                    "a checkpoint")
        for p in (node0, node1):
            p.send_signal(signal.SIGINT)
        results = finish([node0, node1], timeout=120)
    finally:
        _cleanup(procs)
    for r, (code, _, err) in enumerate(results):
        assert code == 130, (r, code, err[-2000:])
        (line,) = [ln for ln in err.splitlines() if "Resume with:" in ln]
        assert line.endswith(f"Resume with: rlctl train --resume {run} hardware.node_rank={r}"), line
