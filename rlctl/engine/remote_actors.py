"""Rollout actors on other nodes: ``trainer.async_rollout.enabled=true`` with
``hardware.nnodes`` > 1.

The same `rlctl train ...` command runs on every node. Node 0 runs the learner (rank 0,
``hardware.num_processes=1``) and its ``num_actors`` local actors (ranks 1 .. num_actors;
0 is allowed here); node r >= 1 runs ``actors_per_node`` actors, ranks
``1 + num_actors + (r - 1) * actors_per_node`` onwards, and owns no run directory
(nothing is written on its disk). World = 1 + num_actors + (nnodes - 1) * actors_per_node.

Everyone joins one gloo group through a TCP store the learner serves at
``hardware.master_addr:master_port``. Before the group forms the learner puts its resolved
config in that store; an actor node reads it there, so actors sample with the learner's
config (a resume's overrides included) whatever the node's own command says beyond where
the master is; the task's data files must exist on every node. Messages are those of the
local case (rlctl/engine/async_rollout.py).

Joining: each actor connects to the store and sets ``JOINED`` + its rank; the learner
waits (in Python, 0.2 s polls, so SIGINT/SIGTERM or a dead local actor ends the wait at
once) until every rank is there, sets ``GO_KEY`` and only then forms the gloo group with
them, so a missing node never leaves it blocked inside c10d. Every wait is bounded:
joining by ``hardware.dist_timeout_s`` (one line on either side: "cannot reach the
master" / "did not all join", naming the missing nodes); a peer that dies closes its
sockets, so the other side's pending transfer fails at once (a vanished host: after the
group's timeout, ``hardware.dist_timeout_s``). A learner that finishes sends stop to
every actor (the node exits 0); one that fails first tells the actors so (the node exits
1). An actor gets SIGTERM when the process that started it dies (PR_SET_PDEATHSIG).
"""
from __future__ import annotations

import multiprocessing
import queue
import signal
import socket
import time
from datetime import timedelta
from typing import Callable, Dict, List

import torch.distributed as dist
from omegaconf import OmegaConf

from rlctl.backends.launch import check_node_rank
from rlctl.errors import ActorFailed, LaunchError, UserError

CONFIG_KEY = "rlctl/async/learner_config"
JOINED = "rlctl/async/joined/"     # + rank: that actor has connected to the store
GO_KEY = "rlctl/async/go"          # the learner: every rank is here, form the group
POLL_S = 0.2


def world_size(cfg) -> int:
    """1 learner + the local actors + every other node's actors."""
    a, hw = cfg.trainer.async_rollout, cfg.hardware
    return 1 + int(a.num_actors) + (int(hw.nnodes) - 1) * int(a.actors_per_node)


def node_of(cfg, rank: int) -> int:
    """The node hosting ``rank`` (0: the learner and its local actors)."""
    local = int(cfg.trainer.async_rollout.num_actors)
    return 0 if rank <= local else 1 + (rank - 1 - local) // int(cfg.trainer.async_rollout.actors_per_node)


def node_ranks(cfg, node: int) -> List[int]:
    """The actor ranks node ``node`` >= 1 starts."""
    a = cfg.trainer.async_rollout
    first = 1 + int(a.num_actors) + (node - 1) * int(a.actors_per_node)
    return list(range(first, first + int(a.actors_per_node)))


def check_layout(cfg) -> None:
    """Refuse (one line, exit 2) an async layout that cannot run."""
    a, hw = cfg.trainer.async_rollout, cfg.hardware
    if not a.enabled:
        return
    if hw.nnodes == 1 and a.num_actors == 0:
        raise UserError("trainer.async_rollout.num_actors=0 leaves no rollout actor: it may be 0 only "
                        "when other nodes run them (hardware.nnodes > 1); use num_actors >= 1")
    if hw.nnodes > 1:
        check_node_rank(hw)


def timeout_text(cfg) -> str:
    """The process group's timeout, in the words an error message uses."""
    if int(cfg.hardware.nnodes) > 1:
        return f"hardware.dist_timeout_s={float(cfg.hardware.dist_timeout_s):g} s"
    return "the process group's timeout"


def _signalled(stop) -> int:
    return int(stop.signum) if stop is not None and stop.requested else 0


def tcp_init(hw) -> str:
    return f"tcp://{hw.master_addr}:{int(hw.master_port)}"


def serve_config(hw, cfg_yaml: str) -> dist.TCPStore:
    """The learner's rendezvous store (listening on every interface at master_port),
    holding its resolved config for the actor nodes."""
    try:
        store = dist.TCPStore(hw.master_addr, int(hw.master_port), is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=float(hw.dist_timeout_s)))
    except Exception as exc:  # noqa: BLE001 - DistNetworkError (port in use) and the like
        raise UserError(f"the learner cannot serve the rendezvous at {hw.master_addr}:{hw.master_port} "
                        f"({_first(exc)}); choose a free hardware.master_port") from None
    store.set(CONFIG_KEY, cfg_yaml)
    return store


def connect(init: str, timeout_s: float, who: str, stop=None) -> dist.TCPStore:
    """A client of the learner's store at ``init`` (tcp://HOST:PORT), within ``timeout_s``;
    a signal in ``stop`` ends the wait (LaunchError, exit 128 + signal)."""
    host, _, port = init[len("tcp://"):].rpartition(":")
    try:
        _reachable(host, int(port), time.monotonic() + timeout_s, stop, who)   # c10d's retries log pages
        return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))
    except LaunchError:
        raise
    except Exception as exc:  # noqa: BLE001 - DistNetworkError, DistStoreError, TimeoutError alike
        raise UserError(f"{who} cannot reach the master at {host}:{port} within hardware."
                        f"dist_timeout_s={timeout_s:g} ({_first(exc)}); check hardware.master_addr/"
                        "master_port and that node 0 (the learner) was started") from None


def _reachable(host: str, port: int, deadline: float, stop=None, who: str = "it") -> None:
    """Wait until ``host:port`` accepts a TCP connection, or raise TimeoutError at ``deadline``
    (LaunchError, exit 128 + signal, once ``stop`` has a signal)."""
    while True:
        if _signalled(stop):
            raise LaunchError(f"{who}: {_interrupted(stop)} while waiting for the learner at {host}:"
                              f"{port}; no rollout actor was started", False, 128 + stop.signum)
        try:
            wait = max(0.1, min(1.0, deadline - time.monotonic()))
            socket.create_connection((host, port), timeout=wait).close()
            return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no answer from {host}:{port}: {exc}") from None
            time.sleep(POLL_S)


def _interrupted(stop) -> str:
    return f"interrupted by {signal.Signals(stop.signum).name}"


def arrive(store, rank: int, timeout_s: float) -> None:
    """An actor: say it is here, then wait for the learner's go (everyone came) while the
    learner's store answers; bounded by twice the learner's own wait."""
    store.set(JOINED + str(rank), "1")
    deadline = time.monotonic() + 2 * timeout_s
    try:
        while not store.check([GO_KEY]):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no go from the learner within 2 x {timeout_s:g} s")
            time.sleep(POLL_S)
    except Exception as exc:  # noqa: BLE001 - the store gone (the learner gave up) or silent
        raise ActorFailed(f"the learner ended before the rollout actors all joined ({_first(exc)}; "
                          "node 0 says why)") from None


def form_group(store, cfg, stop, local_procs) -> None:
    """The learner: wait until every actor rank has set its ``JOINED`` key, then form the
    group. One line, nothing trained, when the time runs out (naming the missing nodes),
    a signal comes (exit 128 + signal; its line is the only notice) or a local actor dies."""
    hw, world = cfg.hardware, world_size(cfg)
    timeout_s, deadline = float(hw.dist_timeout_s), time.monotonic() + float(hw.dist_timeout_s)
    announce = stop is not None and stop.announce
    if stop is not None:
        stop.announce = False               # no "stopping after this step": there is none yet
    try:
        while True:
            missing = [r for r in range(1, world) if not store.check([JOINED + str(r)])]
            if not missing:
                break
            dead = [(a + 1, p.exitcode) for a, p in enumerate(local_procs) if p.exitcode is not None]
            if dead:
                raise ActorFailed(f"rollout actor rank {dead[0][0]} on node 0 exited with code "
                                  f"{dead[0][1]} before the group formed (its error is above)")
            if _signalled(stop):
                raise LaunchError(f"{_interrupted(stop)} while waiting for {_nodes_of(cfg, missing)} "
                                  "to join; nothing was trained", True, 128 + stop.signum)
            if time.monotonic() >= deadline:
                raise _absent(cfg, missing)
            time.sleep(POLL_S)
    finally:
        if stop is not None:
            stop.announce = announce
    store.set(GO_KEY, "1")
    try:
        join(store, 0, world, timeout_s)
    except Exception as exc:  # noqa: BLE001 - a rank lost between arriving and the group
        raise ActorFailed(f"the learner (rank 0 of {world}): forming the group with the rollout "
                          f"actors failed after they all arrived ({_first(exc)})") from None


def _nodes_of(cfg, ranks: List[int]) -> str:
    """'node 1 (rank 1)' / 'nodes 1, 3 (ranks 1-2, 5)': where the given actor ranks live;
    node 0's own actors (still starting) only when no other node is missing."""
    ranks = [r for r in ranks if node_of(cfg, r)] or ranks
    nodes = sorted({node_of(cfg, r) for r in ranks})
    return f"node{'s' if len(nodes) > 1 else ''} {_spans(nodes)} (rank{'s' if len(ranks) > 1 else ''} " \
        f"{_spans(ranks)})"


def _spans(xs: List[int]) -> str:
    """[1, 2, 3, 5] -> '1-3, 5'."""
    out: List[List[int]] = []
    for x in sorted(xs):
        if out and x == out[-1][1] + 1:
            out[-1][1] = x
        else:
            out.append([x, x])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in out)


def _absent(cfg, missing: List[int]) -> UserError:
    """The learner's one line when ``missing`` actor ranks never connected in time."""
    hw, nodes = cfg.hardware, sorted({node_of(cfg, r) for r in missing} - {0})
    if not nodes:
        hint = "node 0's own actors were still starting: raise hardware.dist_timeout_s"
    elif len(nodes) == 1:
        hint = f"start the same command with hardware.node_rank={nodes[0]} on node {nodes[0]}"
    else:
        hint = f"start the same command with hardware.node_rank=R on node R for R in {_spans(nodes)}"
    return UserError(f"the learner (rank 0 of {world_size(cfg)}): the rollout actors did not all join "
                     f"at {hw.master_addr}:{hw.master_port} within hardware.dist_timeout_s="
                     f"{float(hw.dist_timeout_s):g}: {_nodes_of(cfg, missing)} never connected; {hint}")


def join(store, rank: int, world: int, timeout_s: float) -> None:
    """Form the gloo group (every rank has already arrived: see ``form_group``)."""
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))


def _first(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:160]


# ---- an actor node (node_rank >= 1) --------------------------------------------------
def serve_node(cfg, stop, actor_main: Callable) -> dict:
    """Node ``hardware.node_rank`` >= 1: read the learner's config from its store, start
    this node's actors (``actor_main(cfg_yaml, init, rank, world, errors)``) and wait
    for them. Raises LaunchError (one line) when one fails or a signal stops the node
    (its line is the only notice: the node has no step to finish, no checkpoint to save)."""
    hw = cfg.hardware
    check_node_rank(hw)
    if stop is not None:
        stop.announce = False
    init, node = tcp_init(hw), int(hw.node_rank)
    store = connect(init, float(hw.dist_timeout_s), f"node {node} (rollout actors)", stop)
    cfg_yaml = _learner_config(store, node, float(hw.dist_timeout_s), stop)
    del store
    learner = OmegaConf.create(cfg_yaml)
    if node >= learner.hardware.nnodes:
        raise UserError(f"hardware.node_rank={node} but the learner's run has hardware.nnodes="
                        f"{learner.hardware.nnodes} (nodes 0 .. {learner.hardware.nnodes - 1})")
    ranks, world = node_ranks(learner, node), world_size(learner)
    ctx = multiprocessing.get_context("spawn")
    errors = ctx.SimpleQueue()
    # not daemons: an actor forks its own reward worker (task.reward_timeout_s)
    procs = {r: ctx.Process(target=actor_main, args=(cfg_yaml, init, r, world, errors), daemon=False)
             for r in ranks}
    for p in procs.values():
        p.start()
    print(f"node {node}: rollout actor rank(s) {ranks[0]}-{ranks[-1]} of {world}, learner at "
          f"{hw.master_addr}:{hw.master_port}", flush=True)
    try:
        _wait(procs, errors, stop, node)
    finally:
        for p in procs.values():
            if p.is_alive():
                p.terminate()
            p.join(timeout=30)
    return {}


def _learner_config(store, node: int, timeout_s: float, stop) -> str:
    """The config the learner puts in its store as soon as it listens (polled: a signal
    ends the wait)."""
    deadline = time.monotonic() + timeout_s
    try:
        while not store.check([CONFIG_KEY]):
            if _signalled(stop):
                raise LaunchError(f"node {node}: {_interrupted(stop)} while waiting for the learner's "
                                  "config; no rollout actor was started", False, 128 + stop.signum)
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no {CONFIG_KEY} within {timeout_s:g} s")
            time.sleep(POLL_S)
        return store.get(CONFIG_KEY).decode()
    except LaunchError:
        raise
    except Exception as exc:  # noqa: BLE001 - a lost master, a foreign store
        raise UserError(f"node {node}: the learner did not share its config ({_first(exc)})") from None


def _wait(procs: Dict[int, multiprocessing.Process], errors, stop, node: int, poll_s: float = 0.2) -> None:
    while True:
        if stop is not None and stop.requested:
            name = signal.Signals(stop.signum).name
            raise LaunchError(f"node {node}: stopped by {name}; its rollout actors were ended (the "
                              "learner stops with one line naming them)", False, 128 + stop.signum)
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
        if not errors.empty():
            return errors.get()
    except (OSError, EOFError, queue.Empty):
        pass
    return f"rollout actor rank {rank} exited with code {code}"
