"""`hardware.num_processes=N`: rlctl starts its own N ranks (no external launcher).

Each rank is `python -m rlctl.run.worker RUN_DIR` with RANK / WORLD_SIZE /
LOCAL_RANK set and a `file://` rendezvous inside the run directory (no port to clash).
Rank 0 keeps the terminal; the other ranks write `rank<k>.log` in the run directory. If
any rank fails, the others are killed and the error names the rank and its last line.

Signals: the ranks run in their own sessions, so a terminal's Ctrl-C (sent to the
foreground process group) reaches only this launcher, which passes each SIGINT/SIGTERM
it handles on to every rank exactly once (``stop.forward``). The ranks then agree on the
step to stop after, save one checkpoint and exit 128 + the signal; a rank the signal
reached before it could handle it (Python still starting) ends the launch as a stop too
(the others are killed: no step ran with it). A rank whose launcher
dies (even by SIGKILL) gets SIGTERM from the kernel (worker.py), so none lingers.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional
from rlctl.errors import LaunchError

EXIT_SETUP = 3          # a rank failed before its first training step (set-up)
STOPPED = (128 + signal.SIGINT, 128 + signal.SIGTERM)
KILLED = (-signal.SIGINT, -signal.SIGTERM)   # a rank the signal reached before its handler
LOCK_FD_ENV = "RLCTL_LOCK_FD"   # the run-directory lock's descriptor a rank inherits


def _error_file(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / f".rank{rank}.error"


def write_error(run_dir: Path, message: str, code: int) -> None:
    """A rank's one-line error and exit code, for the launcher to report."""
    rank = int(os.environ.get("RANK", 0))
    _error_file(run_dir, rank).write_text(json.dumps({"message": message, "code": code}))


def launch(num_processes: int, run_dir: Path, threads: int, resume: bool = False, stop=None,
           poll_s: float = 0.2, lock_fd: Optional[int] = None) -> int:
    """Run the ranks to the end. Returns 0 when they finished, or the signal number after
    a forwarded SIGINT/SIGTERM made every rank save and stop; raises LaunchError if one
    failed (every other rank is killed). ``lock_fd``: the locked run-directory lock, which
    every rank inherits (the run stays locked while any rank lives)."""
    rendezvous = run_dir / ".dist_init"
    rendezvous.unlink(missing_ok=True)
    for rank in range(num_processes):
        _error_file(run_dir, rank).unlink(missing_ok=True)
    procs: List[subprocess.Popen] = []
    logs = []
    if stop is not None:
        stop.forward = lambda signum: _signal_all(procs, signum)
    try:
        for rank in range(num_processes):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(num_processes), LOCAL_RANK=str(rank),
                       RLCTL_DIST_INIT=f"file://{rendezvous.resolve()}", OMP_NUM_THREADS=str(threads),
                       RLCTL_LAUNCHER_PID=str(os.getpid()))
            if lock_fd is not None:
                env[LOCK_FD_ENV] = str(lock_fd)
            log = None if rank == 0 else open(run_dir / f"rank{rank}.log", "w")
            logs.append(log)
            args = [sys.executable, "-m", "rlctl.run.worker", str(run_dir)] + (["--resume"] if resume else [])
            procs.append(subprocess.Popen(args, env=env, stdout=log, start_new_session=True,
                                          stderr=subprocess.STDOUT if log else None,
                                          pass_fds=() if lock_fd is None else (lock_fd,)))
            if stop is not None and stop.requested:    # a signal came while ranks were starting
                _signal_all(procs[-1:], stop.signum)
        return _wait(procs, run_dir, stop, poll_s)
    finally:
        if stop is not None:
            stop.forward = None
        for p in procs:                 # failed, aborted, or done: nothing left to wait for
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
        for log in logs:
            if log:
                log.close()
        rendezvous.unlink(missing_ok=True)


def _wait(procs: List[subprocess.Popen], run_dir: Path, stop, poll_s: float) -> int:
    while True:
        codes = [p.poll() for p in procs]
        stopping = stop is not None and stop.requested
        if stopping and any(c in KILLED for c in codes):
            return stop.signum      # the group cannot meet again: launch() kills the rest
        failed = [r for r, c in enumerate(codes) if c not in (None, 0) and not (stopping and c in STOPPED)]
        if failed:
            r = failed[0]
            raise _failure(run_dir, r, codes[r])
        if all(c is not None for c in codes):
            return 0 if all(c == 0 for c in codes) else stop.signum
        time.sleep(poll_s)


def _signal_all(procs: List[subprocess.Popen], signum: int) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.kill(p.pid, signum)
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
    if rank:
        lines = [ln for ln in (run_dir / f"rank{rank}.log").read_text().splitlines() if ln.strip()]
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


def node_argv(overrides: List[str], recipe, resume) -> List[str]:
    """The `rlctl train` command line each rank of a multi-node launch runs."""
    head = [sys.executable, "-m", "rlctl.cli", "train"]
    if resume is not None:
        head += ["--resume", str(resume)]
    elif recipe is not None:
        head += ["--recipe", str(recipe)]
    return head + list(overrides)


def check_node_rank(hw) -> None:
    """``hardware.node_rank`` names one of the ``hardware.nnodes`` nodes (exit code 2)."""
    if hw.node_rank >= hw.nnodes:
        raise LaunchError(f"hardware.node_rank={hw.node_rank} must be below hardware.nnodes="
                          f"{hw.nnodes} (nodes are numbered 0 .. nnodes-1)", True, 2)


def launch_node(argv: List[str], hw, stop=None, poll_s: float = 0.2) -> int:
    """rlctl's own launcher on node ``hw.node_rank`` of ``hw.nnodes``: start this node's
    ``hw.num_processes`` ranks (each runs ``argv``, the same `rlctl train` command, in a
    TCP group at ``hw.master_addr:hw.master_port``, like torchrun's static rendezvous) and
    wait. Returns the first failed rank's exit code (it printed its own line; the others
    are then stopped), 128 + signal after a forwarded SIGINT/SIGTERM, else 0."""
    check_node_rank(hw)
    n, world = hw.num_processes, hw.nnodes * hw.num_processes
    procs: List[subprocess.Popen] = []
    if stop is not None:
        stop.forward = lambda signum: _signal_all(procs, signum)
    try:
        for local in range(n):
            env = dict(os.environ, RANK=str(hw.node_rank * n + local), WORLD_SIZE=str(world),
                       LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(n), MASTER_ADDR=hw.master_addr,
                       MASTER_PORT=str(hw.master_port), OMP_NUM_THREADS=str(hw.num_threads),
                       RLCTL_LAUNCHER_PID=str(os.getpid()), RLCTL_NODE_RANK=str(hw.node_rank))
            env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")   # a closed store: rlctl's line, no C++ stack
            procs.append(subprocess.Popen(argv, env=env, start_new_session=True))
            if stop is not None and stop.requested:    # a signal came while ranks were starting
                _signal_all(procs[-1:], stop.signum)
        while True:
            codes = [p.poll() for p in procs]
            stopping = stop is not None and stop.requested
            if stopping and any(c in KILLED for c in codes):
                return 128 + stop.signum   # a rank the signal reached before its handler: a stop
            failed = [c for c in codes if c not in (None, 0) and not (stopping and c in STOPPED)]
            if failed:
                return failed[0]
            if all(c is not None for c in codes):
                return max(codes)
            time.sleep(poll_s)
    finally:
        if stop is not None:
            stop.forward = None
        for p in procs:
            if p.poll() is None:
                p.terminate()           # SIGTERM: a healthy rank saves after its step
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
