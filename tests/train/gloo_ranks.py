"""Run a test module's rank worker as 2 gloo processes (torch's env:// rendezvous on a free
loopback port), each with OMP_NUM_THREADS=1; fail with the rank's output."""
import os
import socket
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_two_ranks(module: str, call: str, tmp_path, timeout: float, paths=()) -> None:
    """``import <module> as t; t.<call>`` in ranks 0 and 1 (``paths`` put first on sys.path
    beside this folder); asserts both exit 0 within ``timeout`` s."""
    path = [str(HERE), str(HERE.parent), *map(str, paths)]   # tests/: learner_kit
    code = f"import sys; sys.path[:0] = {path!r}; import {module} as t; t.{call}"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env=dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                                       OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
             for r in range(2)]
    for p in procs:
        out = p.communicate(timeout=timeout)[0]
        assert p.returncode == 0, out[-3000:]
