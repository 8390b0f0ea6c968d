"""Stopping on SIGINT/SIGTERM at a step boundary, after the same step on every rank."""
from __future__ import annotations

import contextlib
import signal
import sys
import threading
from typing import Callable, Optional

import torch

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopFlag:
    """``announce``: a notice on the first signal; ``forward``: called first with each signal."""

    def __init__(self, announce: bool = True):
        self.signum, self.aborted, self.announce = 0, False, announce   # signum 0: none yet
        self.forward: Optional[Callable[[int], None]] = None

    @property
    def requested(self) -> bool:
        return self.signum != 0

    def handle(self, signum, frame=None) -> None:
        if self.requested and signum != signal.SIGINT:
            return                        # a repeated SIGTERM: already stopping
        if self.forward is not None:
            self.forward(signum)
        if self.requested:                # a second Ctrl-C
            self.aborted = True
            raise KeyboardInterrupt
        self.signum = int(signum)
        if self.announce:
            again = " (Ctrl-C again to abort)" if signum == signal.SIGINT else ""
            print(f"\n{signal.Signals(signum).name}: stopping after this step and saving a "
                  f"checkpoint{again}", file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def installed(self):
        """Handle SIGINT and SIGTERM in this block (main thread only; elsewhere a no-op)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {s: signal.signal(s, self.handle) for s in SIGNALS}
        try:
            yield self
        finally:
            for s, h in previous.items():
                signal.signal(s, h)

    def agreed(self, backend) -> int:
        """The largest signal requested on any rank (0: go on); a collective at a step boundary."""
        if backend.world_size == 1:
            return self.signum
        return int(backend.all_reduce(torch.tensor([float(self.signum)]), "max").item())
