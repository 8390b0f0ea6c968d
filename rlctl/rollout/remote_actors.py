"""Rollout actors on other nodes: ``trainer.async_rollout.enabled=true`` with
``hardware.nnodes`` > 1.

The same `rlctl train ...` command runs on every node. Node 0 runs the learner (rank 0,
``hardware.num_processes=1``) and its ``num_actors`` local actors (ranks 1 .. num_actors;
0 is allowed here); node r >= 1 runs ``actors_per_node`` actors, ranks
``1 + num_actors + (r - 1) * actors_per_node`` onwards, and owns no run directory
(nothing is written on its disk). World = 1 + num_actors + (nnodes - 1) * actors_per_node
(``ActorLayout``, rlctl/rollout/layout.py: read from the config once, by the caller).

Everyone joins one gloo group through a TCP store the learner serves at
``hardware.master_addr:master_port``. Before the group forms the learner puts its resolved
config in that store; an actor node reads it there, so actors sample with the learner's
config (a resume's overrides included) whatever the node's own command says beyond where
the master is; the task's data files must exist on every node. Messages are those of the
local case (rlctl/rollout/actors.py).

Joining: the store also holds a random run id; the join keys live under it (``key``), so
an actor of another run never counts; it also says the learner is async (meet.MODE_KEY),
so a node started without async, or an actor node meeting plain ranks, is one line on
both sides (rlctl/backends/meet.py). An actor node claims its ranks (a counter: a second
node with the same ``hardware.node_rank`` is refused, exit 2) and gives them back when it
stops; a waiting actor bumps its ``alive`` counter every poll. The learner waits (0.2 s
polls in Python: SIGINT/SIGTERM or a dead local actor ends the wait at once) until every
rank's counter advanced within ``LIVE_S`` (an actor that came and died is absent), sets
``go`` and only then forms the gloo group, so it never waits inside c10d for a lost node. Every wait is bounded:
joining by ``hardware.dist_timeout_s`` (one line on either side: "cannot reach the
master" / "did not all join", naming the missing nodes); a peer that dies closes its
sockets, so the other side's pending transfer fails at once (a vanished host: after the
group's timeout, ``hardware.dist_timeout_s``). A learner that finishes sends stop to
every actor (the node exits 0); one that fails first tells the actors so (the node exits
1). An actor gets SIGTERM when the process that started it dies (PR_SET_PDEATHSIG).
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import secrets
import signal
import time
from datetime import timedelta
from typing import Callable, Dict, List

import torch.distributed as dist
from omegaconf import OmegaConf

from rlctl.backends.launch import check_node_rank
from rlctl.backends.meet import MISMATCH_KEY, MODE_KEY, mode_line, spans, wait_reachable
from rlctl.errors import ActorFailed, LaunchError, UserError
from rlctl.rollout.layout import ActorLayout

CONFIG_KEY = "rlctl/async/learner_config"
RUN_KEY = "rlctl/async/run"        # the learner's random run id, set before CONFIG_KEY
POLL_S = 0.2
LIVE_S = 1.0                       # an actor whose alive counter stood still longer is absent


def key(run: str, what: str, rank=None) -> str:
    """A join key of run ``run``: 'go', 'joined' (+ rank: claimed by a node), 'alive' (+ rank:
    bumped by the waiting actor)."""
    return f"rlctl/async/{run}/{what}" + ("" if rank is None else f"/{rank}")


def _signalled(stop) -> int:
    return int(stop.signum) if stop is not None and stop.requested else 0


def tcp_init(layout: ActorLayout, run: str) -> str:
    """tcp://HOST:PORT/RUN: where the actors join, and the run they join."""
    return f"tcp://{layout.master_addr}:{layout.master_port}/{run}"


def serve_config(layout: ActorLayout, cfg_yaml: str):
    """The learner's rendezvous store (every interface, master_port) holding a fresh run id
    and ``cfg_yaml`` (its resolved config, text the actor nodes build from; not read here);
    returns (store, the actors' init)."""
    try:
        store = dist.TCPStore(layout.master_addr, layout.master_port, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=layout.dist_timeout_s))
    except Exception as exc:  # noqa: BLE001 - DistNetworkError (port in use) and the like
        raise UserError(f"the learner cannot serve the rendezvous at {layout.master_addr}:{layout.master_port} "
                        f"({_first(exc)}); choose a free hardware.master_port") from None
    run = secrets.token_hex(8)
    store.set(RUN_KEY, run)
    store.set(MODE_KEY, "async")          # a node started without async says so (meet.py)
    store.set(CONFIG_KEY, cfg_yaml)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")    # the local actors' c10d, as on a node
    return store, tcp_init(layout, run)


def _parse(init: str):
    """tcp://HOST:PORT/RUN -> (HOST, PORT, RUN)."""
    hostport, _, run = init[len("tcp://"):].partition("/")
    host, _, port = hostport.rpartition(":")
    return host, int(port), run


def connect(init: str, timeout_s: float, who: str, stop=None) -> dist.TCPStore:
    """A client of the learner's store at ``init`` (tcp://HOST:PORT), within ``timeout_s``;
    a signal in ``stop`` ends the wait (LaunchError, exit 128 + signal)."""
    host, port, _ = _parse(init)
    try:
        _reachable(host, port, time.monotonic() + timeout_s, stop, who)   # c10d's retries log pages
        return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    except LaunchError:
        raise
    except Exception as exc:  # noqa: BLE001 - DistNetworkError, DistStoreError, TimeoutError alike
        raise UserError(f"{who} cannot reach the master at {host}:{port} within hardware."
                        f"dist_timeout_s={timeout_s:g} ({_first(exc)}); check hardware.master_addr/"
                        "master_port and that node 0 (the learner) was started") from None


def _reachable(host: str, port: int, deadline: float, stop=None, who: str = "it") -> None:
    """`meet.wait_reachable`, with an actor node's own line when a signal stops the wait."""
    def stopped():
        return LaunchError(f"{who}: {_interrupted(stop)} while waiting for the learner at {host}:"
                           f"{port}; no rollout actor was started", False, 128 + stop.signum)
    wait_reachable(host, port, deadline, stop, stopped)


def _interrupted(stop) -> str:
    return f"interrupted by {signal.Signals(stop.signum).name}"


def actor_join(init: str, rank: int, world: int, timeout_s: float) -> None:
    """An actor process: reach the learner's store, arrive, form the group."""
    store = connect(init, timeout_s, "it")
    arrive(store, _parse(init)[2], rank, timeout_s)
    join(store, rank, world, timeout_s)


def arrive(store, run: str, rank: int, timeout_s: float) -> None:
    """An actor of run ``run``: bump its alive counter every poll until the learner's go
    (everyone came) while the learner's store answers; bounded by twice the learner's wait."""
    deadline = time.monotonic() + 2 * timeout_s
    try:
        if store.get(RUN_KEY).decode() != run:
            raise ActorFailed(f"the learner at this address is another run than the one whose config this "
                              f"node read (run id {run}): it was restarted; start this node again")
        while not store.check([key(run, "go")]):
            store.add(key(run, "alive", rank), 1)
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no go from the learner within 2 x {timeout_s:g} s")
            time.sleep(POLL_S)
    except ActorFailed:
        raise
    except Exception as exc:  # noqa: BLE001 - the store gone (the learner gave up) or silent
        raise ActorFailed(f"the learner ended before the rollout actors all joined ({_first(exc)}; "
                          "node 0 says why)") from None


def claim(store, run: str, ranks: List[int], node: int) -> None:
    """An actor node: take its ranks (a counter each: 1 = this node's alone); a rank
    already taken is one line (exit 2), and what this node took is given back."""
    for i, r in enumerate(ranks):
        if store.add(key(run, "joined", r), 1) > 1:
            store.add(key(run, "joined", r), -1)
            release(store, run, ranks[:i])
            raise UserError(f"rank {r} is claimed twice: is hardware.node_rank={node} started on two "
                            "machines? (start each node_rank once)")


def release(store, run: str, ranks: List[int]) -> None:
    """Give back claimed ranks, so this node can be started again while the learner waits."""
    for r in ranks:
        store.delete_key(key(run, "joined", r))


def _live(store, run: str, ranks: List[int], seen: Dict[int, tuple], now: float) -> List[int]:
    """The ranks whose alive counter advanced within the last LIVE_S. ``seen``: rank ->
    (its last count, when it last changed); a count first seen has not advanced yet."""
    for r in ranks:
        n = store.add(key(run, "alive", r), 0)        # a read that never blocks on a missing key
        if r not in seen:
            seen[r] = (n, float("-inf"))
        elif n != seen[r][0]:
            seen[r] = (n, now)
    return [r for r in ranks if now - seen[r][1] <= LIVE_S]


def form_group(store, layout: ActorLayout, stop, local_procs) -> None:
    """The learner: wait until every actor rank is alive and waiting (``_live``), then form
    the group. One line, nothing trained, when the time runs out (naming the missing nodes),
    a signal comes (exit 128 + signal; its line is the only notice) or a local actor dies."""
    world, run = layout.world_size, store.get(RUN_KEY).decode()
    timeout_s, deadline = layout.dist_timeout_s, time.monotonic() + layout.dist_timeout_s
    announce, seen = stop is not None and stop.announce, {}
    if stop is not None:
        stop.announce = False               # no "stopping after this step": there is none yet
    try:
        while True:
            ranks = list(range(1, world))
            live = _live(store, run, ranks, seen, time.monotonic())
            missing = [r for r in ranks if r not in live]
            if not missing:
                store.set(key(run, "go"), "1")
                join(store, 0, world, timeout_s)
                break
            if store.check([MISMATCH_KEY]):         # a node that trains without async came
                raise UserError(store.get(MISMATCH_KEY).decode())
            dead = [(a + 1, p.exitcode) for a, p in enumerate(local_procs) if p.exitcode is not None]
            if dead:
                raise ActorFailed(f"rollout actor rank {dead[0][0]} on node 0 exited with code "
                                  f"{dead[0][1]} before the group formed (its error is above)")
            if _signalled(stop):
                raise LaunchError(f"{_interrupted(stop)} while waiting for {_nodes_of(layout, missing)} "
                                  "to join; nothing was trained", True, 128 + stop.signum)
            if time.monotonic() >= deadline:
                raise _absent(layout, missing)
            time.sleep(POLL_S)
    except (ActorFailed, LaunchError, UserError):
        raise
    except Exception as exc:  # noqa: BLE001 - a rank lost between arriving and the group
        raise ActorFailed(f"the learner (rank 0 of {world}): forming the group with the rollout "
                          f"actors failed after they all arrived ({_first(exc)})") from None
    finally:
        if stop is not None:
            stop.announce = announce        # muted until the group formed (or the join failed)


def _nodes_of(layout: ActorLayout, ranks: List[int]) -> str:
    """'node 1 (rank 1)' / 'nodes 1, 3 (ranks 1-2, 5)': where the given actor ranks live;
    node 0's own actors (still starting) only when no other node is missing."""
    ranks = [r for r in ranks if layout.node_of(r)] or ranks
    nodes = sorted({layout.node_of(r) for r in ranks})
    return f"node{'s' if len(nodes) > 1 else ''} {spans(nodes)} (rank{'s' if len(ranks) > 1 else ''} " \
        f"{spans(ranks)})"


def _absent(layout: ActorLayout, missing: List[int]) -> UserError:
    """The learner's one line when ``missing`` actor ranks never connected in time."""
    nodes = sorted({layout.node_of(r) for r in missing} - {0})
    if not nodes:
        hint = "node 0's own actors were still starting: raise hardware.dist_timeout_s"
    elif len(nodes) == 1:
        hint = f"start the same command with hardware.node_rank={nodes[0]} on node {nodes[0]}"
    else:
        hint = f"start the same command with hardware.node_rank=R on node R for R in {spans(nodes)}"
    return UserError(f"the learner (rank 0 of {layout.world_size}): the rollout actors did not all join "
                     f"at {layout.master_addr}:{layout.master_port} within hardware.dist_timeout_s="
                     f"{layout.dist_timeout_s:g}: {_nodes_of(layout, missing)} never connected; {hint}")


def join(store, rank: int, world: int, timeout_s: float) -> None:
    """Form the gloo group (every rank has already arrived: see ``form_group``)."""
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))


def _first(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:160]


# ---- an actor node (node_rank >= 1) --------------------------------------------------
def serve_node(layout: ActorLayout, stop, actor_main: Callable) -> dict:
    """Node ``layout.node_rank`` >= 1: read the learner's config from its store, start
    this node's actors (``actor_main(cfg_yaml, init, rank, world, errors)``) and wait
    for them. Raises LaunchError (one line) when one fails or a signal stops the node
    (its line is the only notice: the node has no step to finish, no checkpoint to save).
    The learner's config is text for the actors; only its layout is read here."""
    check_node_rank(layout)
    if stop is not None:
        stop.announce = False
    # the actors' c10d: no C++ stack per actor when the learner's store closes under a poll
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    node = layout.node_rank
    store = connect(tcp_init(layout, ""), layout.dist_timeout_s, f"node {node} (rollout actors)", stop)
    cfg_yaml, run = _learner_config(store, node, layout.dist_timeout_s, stop)
    learner = ActorLayout.from_config(OmegaConf.create(cfg_yaml))
    if node >= learner.nnodes:
        raise UserError(f"hardware.node_rank={node} but the learner's run has hardware.nnodes="
                        f"{learner.nnodes} (nodes 0 .. {learner.nnodes - 1})")
    ranks, world = learner.node_ranks(node), learner.world_size
    claim(store, run, ranks, node)
    try:
        _run_actors(actor_main, (cfg_yaml, tcp_init(layout, run)), ranks, world, stop, node)
    except BaseException:
        with contextlib.suppress(Exception):    # probed first: a closed store logs a C++ stack per call
            _reachable(layout.master_addr, layout.master_port, time.monotonic() + 0.5)
            release(store, run, ranks)
        raise
    return {}


def _run_actors(actor_main: Callable, args: tuple, ranks: List[int], world: int, stop, node: int) -> None:
    """Start this node's actors (``actor_main(*args, rank, world, errors)``) and wait for them."""
    ctx = multiprocessing.get_context("spawn")
    errors, send = ctx.Pipe(duplex=False)   # one line per failed actor (a queue's semaphores would
    # leak a warning when the node is stopped); not daemons: an actor forks its own reward worker
    procs = {r: ctx.Process(target=actor_main, args=(*args, r, world, send), daemon=False) for r in ranks}
    for p in procs.values():
        p.start()
    host, port, _ = _parse(args[1])
    print(f"node {node}: rollout actor rank(s) {ranks[0]}-{ranks[-1]} of {world}, learner at "
          f"{host}:{port}", flush=True)
    try:
        _wait(procs, errors, stop, node)
    finally:
        for p in procs.values():
            if p.is_alive():
                p.terminate()
            p.join(timeout=30)


def _learner_config(store, node: int, timeout_s: float, stop):
    """The config and run id the learner puts in its store as soon as it listens (polled:
    a signal ends the wait)."""
    deadline = time.monotonic() + timeout_s
    try:
        while not store.check([CONFIG_KEY]):
            if store.check([MODE_KEY]) and store.get(MODE_KEY).decode() != "async":
                store.set(MISMATCH_KEY, mode_line(False, f"node {node}"))
                raise UserError(mode_line(False, f"node {node}"))
            if _signalled(stop):
                raise LaunchError(f"node {node}: {_interrupted(stop)} while waiting for the learner's "
                                  "config; no rollout actor was started", False, 128 + stop.signum)
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no {CONFIG_KEY} within {timeout_s:g} s")
            time.sleep(POLL_S)
        return store.get(CONFIG_KEY).decode(), store.get(RUN_KEY).decode()
    except (LaunchError, UserError):
        raise
    except Exception as exc:  # noqa: BLE001 - a lost master, a foreign store
        raise UserError(f"node {node}: the learner did not share its config ({_first(exc)})") from None


def _wait(procs: Dict[int, multiprocessing.Process], errors, stop, node: int, poll_s: float = 0.2) -> None:
    while True:
        if stop is not None and stop.requested:
            name = signal.Signals(stop.signum).name
            raise LaunchError(f"node {node}: stopped by {name}; its rollout actors were ended (a learner "
                              "still waiting for them waits for this node again; one training with them "
                              "stops with one line naming them)", False, 128 + stop.signum)
        codes = {r: p.exitcode for r, p in procs.items()}
        failed = [r for r, c in codes.items() if c not in (None, 0)]
        if failed:
            raise LaunchError(f"node {node}: {_reason(errors, failed[0], codes[failed[0]])}")
        if all(c == 0 for c in codes.values()):
            return
        time.sleep(poll_s)


def _reason(errors, rank: int, code: int) -> str:
    """The first message an actor of this node left, else the exit code."""
    try:
        if errors.poll():
            return errors.recv()
    except (OSError, EOFError):
        pass
    return f"rollout actor rank {rank} exited with code {code}"
