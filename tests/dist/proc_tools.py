"""Looking at processes from a test (Linux /proc): whether rlctl's stop handler is
installed in one, and a bounded wait for a condition."""
import signal
import time
from pathlib import Path


def _catches_sigterm(pid: int) -> bool:
    """rlctl's stop handler is installed (Python alone leaves SIGTERM at its default)."""
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("SigCgt:"))
    return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)


def _wait_until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} not within {timeout} s"
        time.sleep(0.1)
