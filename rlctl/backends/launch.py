"""`hardware.num_processes=N`: rlctl starts its own N ranks (no external launcher).

Each rank is `python -m rlctl.engine.worker RUN_DIR` with RANK / WORLD_SIZE /
LOCAL_RANK set and a `file://` rendezvous inside the run directory (no port to clash).
Rank 0 keeps the terminal; the other ranks write `rank<k>.log` in the run directory. If
any rank fails, the others are stopped and the error names the rank and its last line.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import List


class LaunchError(RuntimeError):
    pass


def launch(num_processes: int, run_dir: Path, threads: int, resume: bool = False,
           poll_s: float = 0.2) -> None:
    rendezvous = run_dir / ".dist_init"
    rendezvous.unlink(missing_ok=True)
    procs: List[subprocess.Popen] = []
    logs = []
    for rank in range(num_processes):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(num_processes), LOCAL_RANK=str(rank),
                   RLCTL_DIST_INIT=f"file://{rendezvous.resolve()}", OMP_NUM_THREADS=str(threads))
        log = None if rank == 0 else open(run_dir / f"rank{rank}.log", "w")
        logs.append(log)
        args = [sys.executable, "-m", "rlctl.engine.worker", str(run_dir)] + (["--resume"] if resume else [])
        procs.append(subprocess.Popen(args,
                                      env=env, stdout=log, stderr=subprocess.STDOUT if log else None))
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                raise LaunchError(_failure(run_dir, failed[0], codes[failed[0]]))
            if all(c == 0 for c in codes):
                return
            time.sleep(poll_s)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        for log in logs:
            if log:
                log.close()
        rendezvous.unlink(missing_ok=True)


def _failure(run_dir: Path, rank: int, code: int) -> str:
    where = "see the output above" if rank == 0 else f"see {run_dir / f'rank{rank}.log'}"
    last = ""
    if rank:
        lines = [ln for ln in (run_dir / f"rank{rank}.log").read_text().splitlines() if ln.strip()]
        last = f": {lines[-1][:200]}" if lines else ""
    return f"rank {rank} exited with code {code}{last} ({where})"
