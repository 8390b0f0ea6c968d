"""Asynchronous rollout actors on another "node": separate process trees on one machine
that share only TCP on 127.0.0.1 (free ports picked here). Node 0 runs the learner with
trainer.async_rollout.num_actors=0, node 1 one actor (trainer.async_rollout.actors_per_node=1):
the same run as one local actor, bit for bit at max_staleness=0; either node's loss is one
line on the other, within hardware.dist_timeout_s; bad layouts are one line each."""
import json
import time
from pathlib import Path

from safetensors.torch import load_file

from rlctl.engine import checkpoint
from test_multinode import TINY_RUN, error_lines, finish, free_port, kill_tree, rlctl_train, start

ASYNC = ["trainer.async_rollout.enabled=true", "trainer.async_rollout.max_staleness=0"]


def _nodes(port: int, run: Path, *args):
    """Node 0 (the learner, no local actor, owns ``run``) and node 1 (one actor)."""
    net = ["hardware.nnodes=2", "hardware.master_addr=127.0.0.1", f"hardware.master_port={port}"]
    return (start(rlctl_train(*args, *net, "hardware.node_rank=0", "trainer.async_rollout.num_actors=0",
                              f"run.dir={run}")),
            start(rlctl_train(*args, *net, "hardware.node_rank=1")))


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
    node0, node1 = _nodes(free_port(), tmp_path / "job", *args)
    results = finish([local, node0, node1], timeout=150)
    for code, out, err in results:
        assert code == 0, err[-3000:]
    assert "rollout actor rank(s) 1-1 of 2" in results[2][1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job", "local"]    # node 1 wrote nothing
    remote, alone = _rows(tmp_path / "job"), _rows(tmp_path / "local")
    assert [r["step"] for r in remote if "step" in r] == [1, 2, 3]           # once per step
    assert remote == alone
    assert remote[0] != remote[2]                       # the steps differ: the check can fail
    assert all(r["async/staleness"] == 0 for r in remote if "step" in r)
    weights = [load_file(checkpoint.latest_checkpoint(tmp_path / d) / "model.safetensors")
               for d in ("job", "local")]
    assert weights[0].keys() == weights[1].keys()
    assert all(weights[0][k].equal(weights[1][k]) for k in weights[0])


def _kill_after_a_step(run, victim: int, *extra) -> str:
    """Start both nodes (100000 steps: no machine finishes first), kill node ``victim``'s
    whole tree after a logged step; the other node exits 1 with one line, no Traceback,
    within hardware.dist_timeout_s (20) + a margin for its shutdown. Returns its stderr."""
    args = [*TINY_RUN, "trainer.steps=100000", "trainer.async_rollout.enabled=true",
            "hardware.dist_timeout_s=20", *extra]
    nodes = _nodes(free_port(), run, *args)
    try:
        _wait_for_step(run)
    finally:
        kill_tree(nodes[victim].pid)
    t0 = time.monotonic()
    code, out, err = finish([nodes[1 - victim]], timeout=60)[0]
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


def test_the_learner_killed_ends_the_actor_node_with_one_line(tmp_path):
    """Node 0's tree killed after a logged step: node 1 exits 1 with one line, no hang."""
    err = _kill_after_a_step(tmp_path / "job", 0)
    assert "node 1: rollout actor rank 1: lost contact with the learner" in err, err


def test_bad_layouts_are_one_line_each(tmp_path):
    """Several learner processes, a node_rank past nnodes, no actor anywhere, an actor
    node whose master never answers (a free port nobody listens on), and a learner whose
    other node never comes: exit 2, one line, nothing written (run.output_dir stays
    empty; the learner removes the run directory it made). The learner's c10d prints its
    own store-timeout warnings on stderr: for it, one "error:" line and no traceback."""
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
        assert code == 2 and len(error_lines(err)) == 1 and want in err and "Traceback" not in err, \
            (want, err[-2000:])
        assert want.startswith("the rollout") or error_lines(err) == [err.strip()], err[-2000:]
    assert all("hardware.dist_timeout_s=3" in err for _, _, err in results[-2:])
    assert "start the same command with hardware.node_rank=1 on node 1" in results[-1][2]
    assert time.monotonic() - t0 < 60
    assert not list(tmp_path.iterdir())
