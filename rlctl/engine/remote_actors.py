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

Every wait is bounded: joining by ``hardware.dist_timeout_s`` (one line on either side:
"cannot reach the master" / "did not all join"); a peer that dies closes its sockets, so
the other side's pending transfer fails at once (a vanished host: after the group's
timeout, ``hardware.dist_timeout_s``). A learner that finishes sends stop to every actor
(the node exits 0); one that fails first tells the actors so (the node exits 1).
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
from rlctl.errors import LaunchError, UserError

CONFIG_KEY = "rlctl/async/learner_config"


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


def connect(init: str, timeout_s: float, who: str) -> dist.TCPStore:
    """A client of the learner's store at ``init`` (tcp://HOST:PORT), within ``timeout_s``."""
    host, _, port = init[len("tcp://"):].rpartition(":")
    try:
        _reachable(host, int(port), time.monotonic() + timeout_s)   # c10d's own retries log pages
        return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))
    except Exception as exc:  # noqa: BLE001 - DistNetworkError, DistStoreError, TimeoutError alike
        raise UserError(f"{who} cannot reach the master at {host}:{port} within hardware."
                        f"dist_timeout_s={timeout_s:g} ({_first(exc)}); check hardware.master_addr/"
                        "master_port and that node 0 (the learner) was started") from None


def _reachable(host: str, port: int, deadline: float) -> None:
    """Wait until ``host:port`` accepts a TCP connection, or raise TimeoutError at ``deadline``."""
    while True:
        try:
            wait = max(0.1, min(1.0, deadline - time.monotonic()))
            socket.create_connection((host, port), timeout=wait).close()
            return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no answer from {host}:{port}: {exc}") from None
            time.sleep(0.2)


def join(store, rank: int, world: int, timeout_s: float, hw=None) -> None:
    """Join the gloo group; the learner (``hw`` given) says in one line who did not come."""
    try:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
    except Exception as exc:  # noqa: BLE001 - the store's timeout, a lost peer
        if hw is None:
            raise
        others = "1 on node 1" if hw.nnodes == 2 else f"1 .. {hw.nnodes - 1} on nodes 1 .. {hw.nnodes - 1}"
        raise UserError(f"the learner (rank 0 of {world}): the rollout actors did not all join at "
                        f"{hw.master_addr}:{hw.master_port} within hardware.dist_timeout_s="
                        f"{timeout_s:g} ({_first(exc)}); start the same command with hardware."
                        f"node_rank={others}") from None


def _first(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:160]


# ---- an actor node (node_rank >= 1) --------------------------------------------------
def serve_node(cfg, stop, actor_main: Callable) -> dict:
    """Node ``hardware.node_rank`` >= 1: read the learner's config from its store, start
    this node's actors (``actor_main(cfg_yaml, init, rank, world, errors)``) and wait
    for them. Raises LaunchError (one line) when one fails or a signal stops the node."""
    hw = cfg.hardware
    check_node_rank(hw)
    init, node = tcp_init(hw), int(hw.node_rank)
    store = connect(init, float(hw.dist_timeout_s), f"node {node} (rollout actors)")
    try:
        cfg_yaml = store.get(CONFIG_KEY).decode()
    except Exception as exc:  # noqa: BLE001 - the store's timeout, a lost master
        raise UserError(f"node {node}: the learner did not share its config ({_first(exc)})") from None
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
