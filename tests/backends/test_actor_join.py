"""The rollout-actor join protocol (rlctl/rollout/remote_actors.py) on a real TCPStore in
this process: an actor that arrived and died is absent, not joined; rank claims are
counted and given back; an actor of another run is refused. The process-level cases
(nodes as separate process trees) are in test_remote_actors.py."""
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from rlctl.errors import ActorFailed, UserError
from rlctl.rollout import remote_actors
from rlctl.rollout.layout import ActorLayout
from test_multinode import free_port


def _layout(port: int, timeout_s: float = 2, actors_per_node: int = 2) -> ActorLayout:
    """A learner's layout: 2 nodes, no local actor."""
    return ActorLayout(enabled=True, num_actors=0, actors_per_node=actors_per_node, nnodes=2, node_rank=0,
                       master_addr="127.0.0.1", master_port=port, dist_timeout_s=timeout_s)


def _beat(store, run: str, rank: int, until: threading.Event, times: int = 1 << 30,
          after: float = 0) -> threading.Thread:
    """A waiting actor's heartbeat (every 0.2 s, from ``after`` s on), ``times`` beats at
    most (then it "dies")."""
    def loop():
        until.wait(after)
        for _ in range(times):
            if until.is_set():
                return
            store.add(remote_actors.key(run, "alive", rank), 1)
            time.sleep(0.2)
    t = threading.Thread(target=loop, daemon=True)
    t.start()
    return t


def test_an_actor_that_arrived_and_died_is_absent_not_joined():
    """Rank 1 claims, beats 3 times (0-0.4 s) and dies (its node killed: its claim
    stays); rank 2 beats from 2 s on. The learner must not set go once rank 2 is there
    (that would block it in c10d for the whole group timeout waiting for rank 1): rank 1's
    counter stood still for > LIVE_S (1 s) by then, so it keeps waiting and, at
    hardware.dist_timeout_s=4, names rank 1 alone."""
    port = free_port()
    layout, done = _layout(port, timeout_s=4), threading.Event()
    store, init = remote_actors.serve_config(layout, "x: 1")
    run = init.rsplit("/", 1)[1]
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))
    remote_actors.claim(client, run, [1, 2], 1)
    beats = [_beat(client, run, 1, done, times=3), _beat(client, run, 2, done, after=2)]
    t0 = time.monotonic()
    try:
        with pytest.raises(UserError, match=r"node 1 \(rank 1\) never connected"):
            remote_actors.form_group(store, layout, None, [])
    finally:
        done.set()
        for t in beats:
            t.join()
    assert time.monotonic() - t0 < 6                     # 4 s of waiting, not stuck inside c10d
    assert not store.check([remote_actors.key(run, "go")])


def test_a_rank_is_claimed_once_and_given_back():
    """Claims are counters: node 1's second claim of rank 2 is one line naming the rank
    and node_rank, and leaves the first claim (count 1) alone; a refused claim gives back
    the ranks it took first (rank 2 of [2, 3] when 3 is taken); a released rank can be
    claimed again (a node restarted while the learner waits)."""
    port = free_port()
    store, init = remote_actors.serve_config(_layout(port), "x: 1")
    run = init.rsplit("/", 1)[1]
    count = lambda r: store.add(remote_actors.key(run, "joined", r), 0)   # noqa: E731
    remote_actors.claim(store, run, [2, 3], 1)
    with pytest.raises(UserError) as e:
        remote_actors.claim(store, run, [2, 3], 1)
    assert str(e.value) == "rank 2 is claimed twice: is hardware.node_rank=1 started on two machines? " \
        "(start each node_rank once)"
    assert (count(2), count(3)) == (1, 1)
    remote_actors.release(store, run, [2])
    with pytest.raises(UserError, match="rank 3 is claimed twice"):
        remote_actors.claim(store, run, [2, 3], 1)
    assert (count(2), count(3)) == (0, 1)                # rank 2 given back, rank 3 still node 1's
    remote_actors.release(store, run, [3])
    remote_actors.claim(store, run, [2, 3], 1)
    assert (count(2), count(3)) == (1, 1)


def test_an_actor_of_another_run_is_refused():
    """An actor whose node read run id X, facing a learner (same address) now serving
    run Y: one line, it never beats under Y's keys, so Y never counts it."""
    port = free_port()
    store, init = remote_actors.serve_config(_layout(port), "x: 1")
    run = init.rsplit("/", 1)[1]
    assert len(run) == 16 and remote_actors.serve_config(_layout(free_port()), "")[1][-16:] != run
    with pytest.raises(ActorFailed, match="another run"):
        remote_actors.arrive(store, "0123456789abcdef", 1, 2)
    assert not store.check([remote_actors.key(run, "alive", 1)])
