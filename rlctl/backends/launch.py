"""Ranks started through torchrun's own launcher (``torch.distributed.launcher.api``).

``launch``: `hardware.num_processes=N` on one machine, N ranks of
``python -m rlctl.run.worker RUN_DIR`` under a standalone c10d rendezvous (as
``torchrun --standalone``). Rank 0 keeps the terminal, rank k writes ``rank<k>.log`` in the
run directory; a failed rank ends the launch with its own one-line error (or its exit code
and last log line). ``launch_node``: node ``hardware.node_rank`` of ``hardware.nnodes``, the
same `rlctl train` command in each rank, under torchrun's static rendezvous at
``hardware.master_addr:master_port`` (node 0 serves it); a master that never answers or
nodes that never come are one line at ``hardware.dist_timeout_s``.

torchrun's agent runs in a thread (so it installs no signal handlers) and starts the ranks
in their own sessions: a terminal's Ctrl-C reaches only this process, whose StopFlag
passes each SIGINT/SIGTERM on to every rank (``stop.forward``; ranks that start later get
it on start). The ranks then agree on the step to stop after, save one checkpoint and exit
128 + the signal; a rank the signal reached before its handler (still starting) makes the
launch a stop too. A rank whose launcher dies (even by SIGKILL) gets SIGTERM from the
kernel (``leave_with_launcher``).
"""
from __future__ import annotations

import ctypes
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Dict, List, Optional

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from rlctl.errors import LaunchError, UserError

EXIT_SETUP = 3          # a rank failed before its first training step (set-up)
STOPPED = (128 + signal.SIGINT, 128 + signal.SIGTERM)
KILLED = (-signal.SIGINT, -signal.SIGTERM)   # a rank the signal reached before its handler
for _name in ("torch.distributed.elastic", "torch.distributed.launcher"):   # rlctl says what failed
    logging.getLogger(_name).addHandler(logging.NullHandler())
    logging.getLogger(_name).propagate = False


def _error_file(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / f".rank{rank}.error"


def write_error(run_dir: Path, message: str, code: int) -> None:
    """A rank's one-line error and exit code, for the launcher to report."""
    rank = int(os.environ.get("RANK", 0))
    _error_file(run_dir, rank).write_text(json.dumps({"message": message, "code": code}))


def launch(num_processes: int, run_dir: Path, threads: int, resume: bool = False, stop=None,
           poll_s: float = 0.2) -> int:
    """Run the ranks to the end. Returns 0 when they finished, or the signal number after
    a forwarded SIGINT/SIGTERM made every rank save and stop; raises LaunchError if one
    failed (the others are stopped)."""
    for rank in range(num_processes):
        _error_file(run_dir, rank).unlink(missing_ok=True)
    layout = dict(min_nodes=1, max_nodes=1, nproc_per_node=num_processes, rdzv_backend="c10d",
                  rdzv_endpoint="localhost:0", rdzv_configs={})
    args = [sys.executable, "-m", "rlctl.run.worker", str(run_dir)] + (["--resume"] if resume else [])
    codes = _run_agent(layout, threads, args, stop, poll_s)
    rank = _failed(codes, stop)
    if rank is not None:
        raise _failure(run_dir, rank, codes[rank])
    return stop.signum if codes else 0


def check_node_rank(hw) -> None:
    """``hardware.node_rank`` names one of the ``hardware.nnodes`` nodes (exit code 2)."""
    if hw.node_rank >= hw.nnodes:
        raise LaunchError(f"hardware.node_rank={hw.node_rank} must be below hardware.nnodes="
                          f"{hw.nnodes} (nodes are numbered 0 .. nnodes-1)", True, 2)


def node_argv(overrides: List[str], recipe, resume) -> List[str]:
    """The `rlctl train` command line each rank of a node runs."""
    head = [sys.executable, "-m", "rlctl.cli", "train"]
    if resume is not None:
        head += ["--resume", str(resume)]
    elif recipe is not None:
        head += ["--recipe", str(recipe)]
    return head + list(overrides)


def launch_node(argv: List[str], hw, stop=None, poll_s: float = 0.2) -> int:
    """Node ``hw.node_rank`` of ``hw.nnodes``: start its ``hw.num_processes`` ranks, each
    running ``argv`` (the same `rlctl train` command), and wait. Returns the first
    failed rank's exit code (it printed its own line; the others are then stopped), 128 +
    signal after a forwarded SIGINT/SIGTERM, else 0; a rendezvous that does not form within
    ``hw.dist_timeout_s`` raises UserError naming what is missing."""
    check_node_rank(hw)
    n, where = hw.num_processes, f"{hw.master_addr}:{hw.master_port}"
    world = hw.nnodes * n
    ranks = spans(range(hw.node_rank * n, hw.node_rank * n + n))
    timeout = getattr(hw, "dist_timeout_s", 300.0)
    if hw.node_rank:
        wait_reachable(hw.master_addr, hw.master_port, time.monotonic() + timeout, stop, (
            f"rank {ranks} of {world} (rlctl): it cannot reach the master at {where} within "
            f"hardware.dist_timeout_s={timeout:g}; check hardware.master_addr/master_port and that "
            "node 0 was started"))
    layout = dict(min_nodes=hw.nnodes, max_nodes=hw.nnodes, nproc_per_node=n, rdzv_backend="static",
                  rdzv_endpoint=where, rdzv_configs={"rank": hw.node_rank, "timeout": max(1, round(timeout))})
    try:
        codes = _run_agent(layout, hw.num_threads, argv, stop, poll_s, run_id="rlctl")
    except Exception as exc:  # noqa: BLE001 - the agent's store: port taken, or nodes missing
        text = first(exc)
        if "clients joined" in text:
            joined = int(text.split("clients joined")[0].split()[-1].split("/")[0])
            missing = (f"rank(s) {spans(range(n, world))}" if joined == 1
                       else f"{hw.nnodes - joined} node(s)")
            raise UserError(f"rank 0 of {world} (rlctl): the other ranks did not all join at {where} "
                            f"within hardware.dist_timeout_s={timeout:g}: {missing} never connected; "
                            "check hardware.master_addr/master_port and that every node was started"
                            ) from None
        raise UserError(f"rank {ranks} of {world} (rlctl): the rendezvous at {where} failed ({text}); "
                        "choose a free hardware.master_port") from None
    rank = _failed(codes, stop)
    return codes[rank] if rank is not None else (128 + stop.signum if codes else 0)


def _failed(codes: Dict[int, int], stop) -> Optional[int]:
    """The first rank whose exit is a failure; None when all finished or the launch was a
    stop (ranks saved and exited 128 + signal; one the signal reached before its handler
    was killed by it, and no step can run without it)."""
    stopping = stop is not None and stop.requested
    if stopping and any(c in KILLED for c in codes.values()):
        return None
    return next((r for r, c in codes.items() if not (stopping and c in STOPPED)), None)


def _run_agent(layout: dict, threads: int, args: List[str], stop, poll_s: float,
               run_id: Optional[str] = None) -> Dict[int, int]:
    """torchrun's agent (``elastic_launch``) in a thread, running the command ``args`` in each
    rank with OMP_NUM_THREADS=``threads`` and RLCTL_LAUNCHER_PID set; signals forwarded to
    the ranks. Returns {rank: exit code} of the failed ranks, first failure first ({}: all
    finished)."""
    logs = tempfile.mkdtemp(prefix="rlctl-launch-")
    launch_config = LaunchConfig(run_id=run_id or uuid.uuid4().hex, max_restarts=0, monitor_interval=0.1,
                                 logs_specs=DefaultLogsSpecs(log_dir=logs), **layout)
    env = [f"RLCTL_LAUNCHER_PID={os.getpid()}", f"OMP_NUM_THREADS={threads}",
           "TORCH_CPP_LOG_LEVEL=" + os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR")]
    result: list = []

    def agent():
        try:
            result.append(elastic_launch(launch_config, shutil.which("env") or "/usr/bin/env")(
                *env, *args))
        except BaseException as exc:  # noqa: BLE001 - handed to the launching thread
            result.append(exc)
    thread = threading.Thread(target=agent, name="rlctl-launch", daemon=True)
    sent: set = set()
    if stop is not None:
        stop.forward = lambda signum: _signal(_ranks(thread), signum, sent)
    thread.start()
    try:
        while thread.is_alive():
            thread.join(poll_s)
            if stop is not None and stop.requested:     # ranks started after the signal get it too
                _signal([p for p in _ranks(thread) if p not in sent], stop.signum, sent)
    except BaseException:
        _signal(_ranks(thread), signal.SIGKILL, sent)   # a second Ctrl-C: abandon at once
        thread.join(60)
        raise
    finally:
        if stop is not None:
            stop.forward = None
        shutil.rmtree(logs, ignore_errors=True)
    got = result[0]
    if isinstance(got, ChildFailedError):
        order = sorted(got.failures.items(), key=lambda kv: (kv[1].timestamp, kv[0]))
        return {rank: failure.exitcode for rank, failure in order}
    if isinstance(got, BaseException):
        raise got
    return {}


def _ranks(thread: threading.Thread) -> List[int]:
    """The pids of the ranks the agent thread started (its children, Linux /proc)."""
    try:
        tid = thread.native_id
        return [int(p) for p in Path(f"/proc/{os.getpid()}/task/{tid}/children").read_text().split()]
    except (OSError, TypeError, ValueError):
        return []


def _signal(pids: List[int], signum: int, sent: set) -> None:
    for pid in pids:
        sent.add(pid)
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def _failure(run_dir: Path, rank: int, code: int) -> LaunchError:
    """The failed rank's own message (the lowest rank that left one), else its exit code
    and the last line of its log."""
    setup = code == EXIT_SETUP
    for r in sorted({0, rank}):
        try:
            err = json.loads(_error_file(run_dir, r).read_text())
            return LaunchError(str(err["message"]), setup, int(err["code"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    where = "see the output above" if rank == 0 else f"see {run_dir / f'rank{rank}.log'}"
    last = ""
    log = run_dir / f"rank{rank}.log"
    if rank and log.is_file():
        lines = [ln for ln in log.read_text().splitlines() if ln.strip()]
        last = f": {lines[-1][:200]}" if lines else ""
    return LaunchError(f"rank {rank} exited with code {code}{last} ({where})", setup)


def leave_with_launcher() -> None:
    """Ask the kernel for SIGTERM when the launcher dies (PR_SET_PDEATHSIG): the rank
    then saves after its step and leaves instead of lingering in its own session."""
    launcher = os.environ.get("RLCTL_LAUNCHER_PID")
    if launcher:
        die_with_parent(int(launcher))


def die_with_parent(parent: int) -> None:
    """SIGTERM to this process when ``parent`` (the process that started it) dies, even by
    SIGKILL (PR_SET_PDEATHSIG); at once if it is already gone (this process was re-parented)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))   # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):       # not Linux: the parent's own kill still applies
        return
    if os.getppid() != parent:              # it died before the request
        os.kill(os.getpid(), signal.SIGTERM)


def wait_reachable(host: str, port: int, deadline: float, stop, message: str) -> None:
    """Return once ``host:port`` accepts a TCP connection (0.2 s polls: no c10d retry
    warnings); UserError(``message``) at ``deadline``; LaunchError (exit 128 + signal) once
    ``stop`` holds a signal."""
    while True:
        if stop is not None and stop.requested:
            raise LaunchError(f"interrupted by {signal.Signals(stop.signum).name} while waiting for "
                              f"node 0 at {host}:{port}; nothing was trained", True, 128 + stop.signum)
        try:
            socket.create_connection((host, port), timeout=max(0.1, min(1.0, deadline - time.monotonic()))
                                     ).close()
            return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise UserError(f"{message} ({first(exc)})") from None
            time.sleep(0.2)


def first(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:160]


def spans(xs) -> str:
    """[1, 2, 3, 5] -> '1-3, 5'."""
    out: List[List[int]] = []
    for x in sorted(xs):
        if out and x == out[-1][1] + 1:
            out[-1][1] = x
        else:
            out.append([x, x])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in out)
