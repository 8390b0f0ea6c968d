"""Asynchronous rollout actors on another "node": separate process trees on one machine
that share only TCP on 127.0.0.1 (free ports picked here). Node 0 runs the learner with
trainer.async_rollout.num_actors=0, node 1 one actor (trainer.async_rollout.actors_per_node=1):
the same run as one local actor, bit for bit at max_staleness=0; either node's loss is one
line on the other, within hardware.dist_timeout_s; a signal ends either side's wait for
the other at once; bad layouts are one line each. Last, a local-actor run whose Trainer
fails to build exits at once instead of waiting for its actors."""
import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from safetensors.torch import load_file

from rlctl.rollout import remote_actors
from rlctl.storage import checkpoint
from test_multinode import TINY_RUN, error_lines, finish, free_port, kill_tree, rlctl_train, start

ASYNC = ["trainer.async_rollout.enabled=true", "trainer.async_rollout.max_staleness=0"]


def _net(port: int, nnodes: int = 2):
    return [f"hardware.nnodes={nnodes}", "hardware.master_addr=127.0.0.1", f"hardware.master_port={port}"]


def _learner(port: int, *args, nnodes: int = 2):
    """Node 0: the learner, no local actor."""
    return start(rlctl_train(*args, *_net(port, nnodes), "hardware.node_rank=0",
                             "trainer.async_rollout.num_actors=0"))


def _nodes(port: int, run: Path, *args, node1_cwd=None):
    """Node 0 (the learner, owns ``run``) and node 1 (one actor; in ``node1_cwd`` if given)."""
    return (_learner(port, *args, f"run.dir={run}"),
            start(rlctl_train(*args, *_net(port), "hardware.node_rank=1"), cwd=node1_cwd))


def _rows(run: Path):
    """Metric rows without the timing keys (time/, perf/ differ between any two runs)."""
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "perf/"))}
            for line in (run / "metrics.jsonl").read_text().splitlines()]


def _wait_for_step(run: Path, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text().strip():
            return
        time.sleep(0.2)
    raise AssertionError(f"no step logged in {run} within {timeout} s")


def test_an_actor_on_node_1_gives_the_local_actor_run_bit_for_bit(tmp_path):
    """max_staleness=0 carries the learner's RNG state and the newest weights with every
    request, so the actor's process (local or on node 1) cannot change a rollout: every
    metric (timing aside) and the final weights must be equal, not close."""
    args = [*TINY_RUN, "trainer.steps=3", *ASYNC]
    local = start(rlctl_train(*args, f"run.dir={tmp_path / 'local'}"))
    (tmp_path / "node1").mkdir()
    node0, node1 = _nodes(free_port(), tmp_path / "job", *args, node1_cwd=tmp_path / "node1")
    results = finish([local, node0, node1], timeout=150)
    for code, out, err in results:
        assert code == 0, err[-3000:]
    assert "rollout actor rank(s) 1-1 of 2" in results[2][1]
    assert list((tmp_path / "node1").iterdir()) == []      # node 1 wrote nothing (no runs/, outputs/, wandb/)
    remote, alone = _rows(tmp_path / "job"), _rows(tmp_path / "local")
    assert [r["step"] for r in remote if "step" in r] == [1, 2, 3]           # once per step
    assert remote == alone
    assert remote[0] != remote[2]                       # the steps differ: the check can fail
    assert all(r["async/staleness"] == 0 for r in remote if "step" in r)
    weights = [load_file(checkpoint.latest_checkpoint(tmp_path / d) / "model.safetensors")
               for d in ("job", "local")]
    assert weights[0].keys() == weights[1].keys()
    assert all(weights[0][k].equal(weights[1][k]) for k in weights[0])


def _children(pid: int):
    return [int(k) for k in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _gone(pid: int) -> bool:
    """Exited (a zombie nobody reaped yet counts: it serves no one)."""
    try:
        return "\nState:\tZ" in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True


def _wait_until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} not within {timeout} s"
        time.sleep(0.1)


def _kill_after_a_step(run, victim: int, *extra, main_only: bool = False) -> str:
    """Start both nodes (100000 steps: no machine finishes first), kill node ``victim``'s
    whole tree (``main_only``: its main process alone, SIGKILL; its actors must then be
    gone within 10 s) after a logged step; the other node exits 1 with one line, no
    Traceback, within hardware.dist_timeout_s (20) + a margin for its shutdown. Returns
    its stderr."""
    args = [*TINY_RUN, "trainer.steps=100000", "trainer.async_rollout.enabled=true",
            "hardware.dist_timeout_s=20", *extra]
    nodes, kids = _nodes(free_port(), run, *args), []
    try:
        try:
            _wait_for_step(run)
        finally:
            kids = _children(nodes[victim].pid)
            if main_only:
                os.kill(nodes[victim].pid, signal.SIGKILL)
            else:
                kill_tree(nodes[victim].pid)
        if main_only:
            assert kids                                  # the node's actors (and helpers)
            _wait_until(lambda: all(_gone(k) for k in kids), 10, f"node {victim}'s actors {kids} ending")
        t0 = time.monotonic()
        code, out, err = finish([nodes[1 - victim]], timeout=60)[0]
    finally:                                             # nothing left running, pass or fail
        for pid in [n.pid for n in nodes if n.poll() is None] + [k for k in kids if not _gone(k)]:
            with contextlib.suppress(OSError):          # it may end on its own meanwhile
                kill_tree(pid)
    nodes[victim].wait()
    assert code == 1 and time.monotonic() - t0 < 20 + 10, (code, err[-2000:])
    assert len(error_lines(err)) == 1 and "Traceback" not in err, err[-2000:]
    return err


def test_node_1_killed_mid_run_is_one_line_on_the_learner(tmp_path):
    """Node 1's whole process tree is killed (SIGKILL) after a logged step: the learner
    stops with one line naming the actor (rank 1, node 1) and the newest checkpoint, within
    hardware.dist_timeout_s (a closed peer fails its transfer at once; the margin covers the
    learner's shutdown). 100000 steps: no machine finishes before the kill."""
    run = tmp_path / "job"
    err = _kill_after_a_step(run, 1, "trainer.checkpoint_every=1")
    assert "lost contact with rollout actor rank 1 on node 1" in err, err
    last = checkpoint.latest_checkpoint(run)
    assert f"the newest checkpoint is {last}" in err and f"--resume {run}" in err, err
    assert checkpoint.read_state(last)["step"] >= 1                        # whole and readable
    assert (last / "model.safetensors").is_file()


def test_node_1_main_process_killed_takes_its_actors_with_it(tmp_path):
    """Only node 1's main process is SIGKILLed: its actors get SIGTERM from the kernel
    (parent-death signal) and are gone within 10 s, so the learner loses rank 1 and stops
    with one line, instead of training on with actors nobody on node 1 owns."""
    err = _kill_after_a_step(tmp_path / "job", 1, main_only=True)
    assert "lost contact with rollout actor rank 1 on node 1: it exited unexpectedly" in err, err


def test_the_learner_killed_ends_the_actor_node_with_one_line(tmp_path):
    """Node 0's tree killed after a logged step: node 1 exits 1 with one line, no hang."""
    err = _kill_after_a_step(tmp_path / "job", 0)
    assert "node 1: rollout actor rank 1: lost contact with the learner" in err, err


def test_bad_layouts_are_one_line_each(tmp_path):
    """Several learner processes, a node_rank past nnodes, no actor anywhere, an actor
    node whose master never answers (a free port nobody listens on), and a learner whose
    other node never comes: exit 2, stderr exactly one line (the learner waits for the
    actors in Python, so c10d has no timeout of its own to warn about), nothing written
    (run.output_dir stays empty; the learner removes the run directory it made)."""
    base = [*TINY_RUN, "trainer.async_rollout.enabled=true", f"run.output_dir={tmp_path}"]
    two = ["hardware.nnodes=2", "hardware.master_addr=127.0.0.1", f"hardware.master_port={free_port()}"]
    cases = {"hardware.num_processes=1 (got 2)": [*two, "hardware.num_processes=2"],
             "hardware.node_rank=2 must be below hardware.nnodes=2": [*two, "hardware.node_rank=2"],
             "num_actors=0 leaves no rollout actor": ["trainer.async_rollout.num_actors=0"],
             "node 1 (rollout actors) cannot reach the master":
                 [*two, "hardware.node_rank=1", "hardware.dist_timeout_s=3"],
             "the rollout actors did not all join":            # on its own port
                 [*two[:2], f"hardware.master_port={free_port()}", "hardware.dist_timeout_s=3"]}
    t0 = time.monotonic()
    results = finish([start(rlctl_train(*base, *extra)) for extra in cases.values()], timeout=90)
    for want, (code, out, err) in zip(cases, results):
        assert code == 2 and error_lines(err) == [err.strip()] and want in err, (want, err[-2000:])
    assert all("hardware.dist_timeout_s=3" in err for _, _, err in results[-2:])
    assert "node 1 (rank 2) never connected; start the same command with hardware.node_rank=1 on " \
        "node 1" in results[-1][2]                      # rank 1: the learner's own local actor
    assert time.monotonic() - t0 < 60
    assert not list(tmp_path.iterdir())


def _catches_sigterm(pid: int) -> bool:
    """rlctl's stop handler is installed (Python alone leaves SIGTERM at its default)."""
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("SigCgt:"))
    return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def test_ctrl_c_ends_either_side_waiting_for_the_other(tmp_path):
    """SIGINT while a side waits for the other (hardware.dist_timeout_s=120: a wait that
    ignored the signal would outlast the test's 30 s): node 1 with no learner (signalled
    once its stop handler is installed: it is then polling the master's port) and a
    learner whose node 1 never comes (signalled once its store listens) each exit 130
    within 30 s with exactly one stderr line; the learner removes its fresh run directory."""
    args = [*TINY_RUN, "trainer.async_rollout.enabled=true", "hardware.dist_timeout_s=120",
            f"run.output_dir={tmp_path / 'out'}"]
    lport, nport = free_port(), free_port()
    (tmp_path / "out").mkdir()
    learner = _learner(lport, *args)
    node = start(rlctl_train(*args, *_net(nport), "hardware.node_rank=1"), cwd=tmp_path)
    try:
        _wait_until(lambda: _catches_sigterm(node.pid), 60, "node 1's stop handler")
        _wait_until(lambda: _listening(lport), 60, "the learner's store")
        time.sleep(0.5)                              # past the store: in the wait for node 1
        t0 = time.monotonic()
        for p in (node, learner):
            p.send_signal(signal.SIGINT)
        results = finish([node, learner], timeout=30)
    finally:
        for p in (node, learner):
            if p.poll() is None:
                kill_tree(p.pid)
    assert time.monotonic() - t0 < 30
    want = [f"error: node 1 (rollout actors): interrupted by SIGINT while waiting for the learner at "
            f"127.0.0.1:{nport}; no rollout actor was started",
            "error: interrupted by SIGINT while waiting for node 1 (rank 1) to join; nothing was trained"]
    for line, (code, out, err) in zip(want, results):
        assert code == 130 and err.strip() == line, (code, err[-2000:])
    assert not list((tmp_path / "out").iterdir())                        # the run directory is gone
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]         # node 1 wrote nothing


def test_the_learner_names_only_the_nodes_that_did_not_join(tmp_path):
    """3 nodes, one actor each: node 1 arrives (this test connects to the learner's store
    and bumps rank 1's alive counter as a waiting actor does), node 2 never does. The one
    line names node 2 (rank 2) alone and tells how to start it."""
    port = free_port()
    learner = _learner(port, *TINY_RUN, "trainer.async_rollout.enabled=true", "hardware.dist_timeout_s=8",
                       f"run.output_dir={tmp_path}", nnodes=3)
    try:
        store = _wait_for_store(port)
        alive = remote_actors.key(store.get(remote_actors.RUN_KEY).decode(), "alive", 1)
        with contextlib.suppress(Exception):            # until the learner's store closes
            while learner.poll() is None:
                store.add(alive, 1)
                time.sleep(0.2)
        code, out, err = finish([learner], timeout=60)[0]
    finally:
        if learner.poll() is None:
            kill_tree(learner.pid)
    assert code == 2 and len(err.strip().splitlines()) == 1, err[-2000:]
    assert ("did not all join at 127.0.0.1:%d within hardware.dist_timeout_s=8: node 2 (rank 2) never "
            "connected; start the same command with hardware.node_rank=2 on node 2" % port) in err, err
    assert "node 1" not in err and "node_rank=1" not in err
    assert not list(tmp_path.iterdir())


def test_a_trainer_that_fails_to_build_does_not_wait_for_its_actors(tmp_path):
    """Trainer(...) raising after the async source started its (non-daemon) local actor:
    the source is closed at once, so the process exits 1 with the error line in seconds
    (it used to wait at Python's exit for the actor, which waits for requests for up to
    30 minutes). No CLI input makes Trainer's constructor fail after the config checks,
    so this run replaces it with one that raises, then runs the CLI's own main."""
    code = ("import sys\nimport rlctl.run.training as run\n"
            "def broken(*a, **k):\n    raise RuntimeError('Trainer construction failed on purpose')\n"
            "run.Trainer.from_config = broken\nfrom rlctl.cli import main\nsys.argv[0] = 'rlctl'\nmain()\n")
    proc = start([sys.executable, "-c", code, "train", *TINY_RUN, "trainer.async_rollout.enabled=true",
                  f"run.output_dir={tmp_path}"])
    t0 = time.monotonic()
    try:
        rc, out, err = finish([proc], timeout=60)[0]
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
    assert rc == 1 and "Trainer construction failed on purpose" in err and "Traceback" not in err, err
    assert time.monotonic() - t0 < 60
    assert not list(tmp_path.iterdir())                         # set-up failed: nothing kept


def _actor_start_up_s() -> float:
    """Seconds a fresh interpreter takes here, now, to import what a rollout actor imports
    (torch and rlctl's actor entry module): the part of an actor's start that grows with the
    machine's load. A join limit derived from it holds on a busy machine as on an idle one."""
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", "import torch, rlctl.run.rollout_setup"], check=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    return time.monotonic() - t0


@pytest.mark.slow   # 30-130 s on 2 cores: node 1 waits out its join timeout (the thing tested)
def test_node_1_of_a_group_that_never_forms_says_one_line(tmp_path):
    """The learner expects 2 actor nodes (nnodes=3); only node 1 comes: the learner gives up
    with one line (node 2 never connected), and node 1, whose actor was polling the store
    that then closed, exits 1 with its WHOLE stderr one line (no c10d C++ stack).

    hardware.dist_timeout_s must cover node 1's actor start (connect, read the config,
    spawn, import, build the model) or node 1 is missing too: it is 4x the measured import
    time (the actor's import is most of its start; 4x leaves the rest and the spawn a
    2x margin), at least 8 s (was a fixed 8 s, too short with other jobs on the machine)."""
    limit = max(8, math.ceil(4 * _actor_start_up_s()))
    port, args = free_port(), [*TINY_RUN, "trainer.async_rollout.enabled=true", f"hardware.dist_timeout_s={limit}"]
    learner = _learner(port, *args, f"run.output_dir={tmp_path / 'out'}", nnodes=3)
    node = start(rlctl_train(*args, *_net(port, 3), "hardware.node_rank=1"), cwd=tmp_path)
    (code0, _, err0), (code1, _, err1) = finish([learner, node], timeout=90 + 2 * limit)
    assert code0 == 2 and "node 2 (rank 2) never connected" in err0 and len(err0.strip().splitlines()) == 1, err0
    assert code1 == 1 and len(err1.strip().splitlines()) == 1, err1[-3000:]
    assert err1.startswith("error: node 1: rollout actor rank 1: ") and "Traceback" not in err1, err1


def test_a_node_rank_started_twice_is_refused(tmp_path):
    """Two node-1 processes against one learner (2 steps): the first claims rank 1 and
    trains with it, the second is refused with one line naming the rank and the node_rank
    (exit 2); which one wins is a race, so the exit codes are compared as a set."""
    port, args = free_port(), [*TINY_RUN, "trainer.steps=2", *ASYNC, "hardware.dist_timeout_s=60"]
    learner = _learner(port, *args, f"run.dir={tmp_path / 'job'}")
    nodes = [start(rlctl_train(*args, *_net(port), "hardware.node_rank=1"), cwd=tmp_path) for _ in range(2)]
    results = finish([learner, *nodes], timeout=120)
    assert results[0][0] == 0, results[0][2][-2000:]
    assert sorted(r[0] for r in results[1:]) == [0, 2], [r[2][-2000:] for r in results]
    err = next(r[2] for r in results[1:] if r[0] == 2)
    assert err.strip() == "error: rank 1 is claimed twice: is hardware.node_rank=1 started on two machines? " \
        "(start each node_rank once)", err


def test_a_node_stopped_while_the_learner_waits_can_be_started_again(tmp_path):
    """3 nodes: node 1's actor arrives, then node 1 gets SIGINT while the learner waits
    for node 2: node 1 exits 130, its whole stderr one line (no semaphore warning), and
    gives its rank back, so the same command started again joins; with node 2 the run
    then trains (the learner never counted the stopped actor as there)."""
    port, args = free_port(), [*TINY_RUN, "trainer.steps=1", *ASYNC, "hardware.dist_timeout_s=90"]
    learner = _learner(port, *args, f"run.dir={tmp_path / 'job'}", nnodes=3)
    node1 = start(rlctl_train(*args, *_net(port, 3), "hardware.node_rank=1"), cwd=tmp_path)
    procs = [learner, node1]
    try:
        store = _wait_for_store(port)
        alive = remote_actors.key(store.get(remote_actors.RUN_KEY).decode(), "alive", 1)
        _wait_until(lambda: store.add(alive, 0) > 0, 60, "node 1's actor polling")
        node1.send_signal(signal.SIGINT)
        code, _, err = finish([node1], timeout=30)[0]
        assert code == 130 and err.strip() == "error: node 1: stopped by SIGINT; its rollout actors were " \
            "ended (a learner still waiting for them waits for this node again; one training with them " \
            "stops with one line naming them)", err
        procs += [start(rlctl_train(*args, *_net(port, 3), f"hardware.node_rank={n}"), cwd=tmp_path)
                  for n in (1, 2)]
        results = finish([learner, *procs[2:]], timeout=120)
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p.pid)
    assert [r[0] for r in results] == [0, 0, 0], [r[2][-1500:] for r in results]
    assert [r["step"] for r in _rows(tmp_path / "job") if "step" in r] == [1]


def _wait_for_store(port: int):
    """A client of the learner's store once its config is there."""
    _wait_until(lambda: _listening(port), 60, "the learner's store")
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    _wait_until(lambda: store.check([remote_actors.CONFIG_KEY]), 10, "the learner's config")
    return store
