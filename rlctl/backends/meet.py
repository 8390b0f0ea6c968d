"""Rendezvous of a process group, polled in Python before the group forms.

``open_store`` gives this rank the group's TCP store: rank 0 serves it (unless torchrun's
agent already does: ``TORCHELASTIC_USE_AGENT_STORE``), every other rank first waits
until node 0's port answers (0.2 s polls, so a missing node 0 or a wrong port is one
line at ``hardware.dist_timeout_s``, without c10d's retry warnings, and a signal ends the
wait at once) and then connects. ``meet`` runs before ``init_process_group``: every rank
claims its rank (a counter: a second process with the same rank is refused at once,
"rank R is claimed twice", unless the first died while waiting) and puts its config
(same_config.payload) in the store; rank 0 waits until every rank has, compares the
configs and sets the verdict, which every rank reads and acknowledges: "ok", or the one line that every node then raises
(config differs, ranks missing, stopped by a signal). So a mismatch or a missing node
never reaches c10d, and no rank is left waiting inside it.

The store's owner sets ``MODE_KEY`` ("ranks") once it serves; the other ranks wait for
it before they hand in their configs.
"""
from __future__ import annotations

import os
import signal
import socket
import time
from datetime import timedelta
from typing import Any, Dict, List, Optional

import torch.distributed as dist

from rlctl.backends import same_config
from rlctl.errors import LaunchError, UserError

MODE_KEY = "rlctl/mode"
POLL_S = 0.2
LIVE_S = 1.0           # a claim whose holder's alive counter stood still this long is free
OK = "ok"


def key(what: str, rank: Optional[int] = None) -> str:
    """A join key, fresh for each restart of torchrun's workers (its agent's store outlives them)."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"rlctl/join/{restart}/{what}" + ("" if rank is None else f"/{rank}")


def first(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:160]


def interrupted(stop) -> int:
    return int(stop.signum) if stop is not None and stop.requested else 0


def wait_reachable(host: str, port: int, deadline: float, stop=None, stopped=None) -> None:
    """Return once ``host:port`` accepts a TCP connection; TimeoutError at ``deadline``;
    LaunchError (exit 128 + signal) once ``stop`` holds a signal (``stopped()``: the caller's
    own error for that, else 'interrupted by SIG... while waiting for node 0')."""
    while True:
        if interrupted(stop):
            raise stopped() if stopped else _stopped(stop, f"while waiting for node 0 at {host}:{port}")
        try:
            wait = max(0.1, min(1.0, deadline - time.monotonic()))
            socket.create_connection((host, port), timeout=wait).close()
            return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no answer from {host}:{port}: {exc}") from None
            time.sleep(POLL_S)


def _stopped(stop, where: str) -> LaunchError:
    name = signal.Signals(stop.signum).name
    return LaunchError(f"interrupted by {name} {where}; nothing was trained", True, 128 + stop.signum)


def open_store(group, timeout_s: float, deadline: float, stop=None) -> dist.TCPStore:
    """This rank's client (rank 0: the server) of the group's store at MASTER_ADDR:PORT."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    serve = group.rank == 0 and not agent
    where = f"{group.master_addr}:{group.master_port}"
    try:
        if not serve:
            wait_reachable(group.master_addr, group.master_port, deadline, stop)
        store = dist.TCPStore(group.master_addr, group.master_port, is_master=serve,
                              wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
    except LaunchError:
        raise
    except Exception as exc:  # noqa: BLE001 - DistNetworkError (port in use), TimeoutError alike
        if serve:
            raise UserError(f"rank 0 of {group.world_size} ({group.source}) cannot serve the rendezvous at "
                            f"{where} ({first(exc)}); choose a free MASTER_PORT (or hardware.master_port)"
                            ) from None
        raise UserError(f"rank {group.rank} of {group.world_size} ({group.source}): it cannot reach the "
                        f"master at {where} within hardware.dist_timeout_s={timeout_s:g} ({first(exc)}); "
                        "check MASTER_ADDR/MASTER_PORT (or hardware.master_addr/master_port) and that "
                        "node 0 was started") from None
    if group.rank == 0:
        store.set(MODE_KEY, "ranks")
    return store


def meet(store, group, flat: Dict[str, Any], label: str, claimed_by: str, timeout_s: float,
         deadline: float, stop=None) -> None:
    """Claim this rank, hand in the config and wait for rank 0's verdict (see the module
    docstring). ``label``: where this rank runs ('node 1'); ``claimed_by``: what to start
    once only ('hardware.node_rank=1'). Raises the verdict's line when it is not ok."""
    announce = stop is not None and getattr(stop, "announce", False)
    if stop is not None:
        stop.announce = False                 # no "stopping after this step": there is none yet
    try:
        try:
            claim(store, group.rank, claimed_by)
        except UserError:
            raise
        except Exception as exc:  # noqa: BLE001 - node 0's store closed right after we connected
            raise _gone(group, exc) from None
        try:
            if group.rank == 0:
                _judge(store, group, flat, label, timeout_s, deadline, stop)
            else:                             # rank 0 may start later and wait a whole timeout
                _hand_in(store, group, flat, label, deadline + timeout_s, stop)
        except BaseException:
            _give_back(store, group)
            raise
    finally:
        if stop is not None:
            stop.announce = announce


def claim(store, rank: int, claimed_by: str) -> None:
    """Take ``rank`` (a counter: 1 = this process's alone). Taken already: refused in one
    line, unless its holder died waiting for the verdict (its alive counter, bumped every
    poll while it waits, stood still for LIVE_S and no verdict is out): then it is ours."""
    if store.add(key("claim", rank), 1) == 1:
        return
    store.add(key("claim", rank), -1)
    if rank and not store.check([key("verdict")]):
        beats = store.add(key("alive", rank), 0)
        time.sleep(LIVE_S + POLL_S)
        if store.add(key("alive", rank), 0) == beats and not store.check([key("verdict")]):
            return                            # the holder is gone: this process takes its place
    raise UserError(f"rank {rank} is claimed twice: is {claimed_by} started on two machines? "
                    "(start each node once)")


def _give_back(store, group) -> None:
    """A rank that stops before the group formed frees its claim (it may be started again)."""
    if group.rank == 0:
        return                                # its store ends with it
    try:
        wait_reachable(group.master_addr, group.master_port, time.monotonic() + 0.5)
        store.add(key("claim", group.rank), -1)
    except Exception:  # noqa: BLE001 - node 0 already gone: nothing to give back to
        pass


def _hand_in(store, group, flat: Dict[str, Any], label: str, deadline: float, stop) -> None:
    try:
        _poll(store, MODE_KEY, deadline, stop, "node 0's rendezvous", beat=key("alive", group.rank))
        store.set(key("config", group.rank), same_config.payload(flat, label))
        verdict = _poll(store, key("verdict"), deadline, stop, "rank 0's config check",
                        beat=key("alive", group.rank))
        store.add(key("ack"), 1)
    except (UserError, LaunchError):
        raise
    except Exception as exc:  # noqa: BLE001 - node 0's store closed (it stopped) or silent
        raise _gone(group, exc) from None
    if verdict != OK:
        raise UserError(verdict)


def _gone(group, exc: BaseException) -> UserError:
    return UserError(f"rank {group.rank} of {group.world_size}: node 0 ended before the group formed "
                     f"({first(exc)}; node 0 says why)")


def _poll(store, name: str, deadline: float, stop, what: str, beat: Optional[str] = None) -> str:
    """``name``'s value once set (``beat``: a counter bumped every poll meanwhile)."""
    while not store.check([name]):
        if beat is not None:
            store.add(beat, 1)
        if interrupted(stop):
            raise _stopped(stop, f"while waiting for {what}")
        if time.monotonic() >= deadline:
            raise TimeoutError(f"no {what} in time")
        time.sleep(POLL_S)
    return store.get(name).decode()


def _judge(store, group, flat: Dict[str, Any], label: str, timeout_s: float, deadline: float,
           stop) -> None:
    """Rank 0: wait for every rank's config, compare, set the verdict, raise when not ok."""
    ranks = list(range(1, group.world_size))
    try:
        while True:
            missing = [r for r in ranks if not store.check([key("config", r)])]
            if not missing:
                break
            if interrupted(stop):
                raise _stopped(stop, f"while waiting for rank(s) {spans(missing)} to join")
            if time.monotonic() >= deadline:
                raise UserError(_absent(group, missing, timeout_s))
            time.sleep(POLL_S)
        line = same_config.mismatch(label, flat, [store.get(key("config", r)).decode() for r in ranks])
        if line is not None:
            raise UserError(line)
    except (UserError, LaunchError) as exc:
        _tell(store, str(exc), len(ranks) - len(missing))
        raise
    store.set(key("verdict"), OK)


def _tell(store, line: str, present: int) -> None:
    """Rank 0's failing verdict, kept served until the ranks that came read it (bounded)."""
    store.set(key("verdict"), line)
    until = time.monotonic() + 10.0
    while store.add(key("ack"), 0) < present and time.monotonic() < until:
        time.sleep(POLL_S / 2)


def _absent(group, missing: List[int], timeout_s: float) -> str:
    return (f"rank 0 of {group.world_size} ({group.source}): the other ranks did not all join at "
            f"{group.master_addr}:{group.master_port} within hardware.dist_timeout_s={timeout_s:g}: rank(s) "
            f"{spans(missing)} never connected; check MASTER_ADDR/MASTER_PORT (or hardware.master_addr/"
            "master_port) and that every node was started")


def spans(xs: List[int]) -> str:
    """[1, 2, 3, 5] -> '1-3, 5'."""
    out: List[List[int]] = []
    for x in sorted(xs):
        if out and x == out[-1][1] + 1:
            out[-1][1] = x
        else:
            out.append([x, x])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in out)


