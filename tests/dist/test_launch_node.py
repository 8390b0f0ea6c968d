"""rlctl's per-node launcher (``launch_node``, torchrun's agent with a static rendezvous)
and a stop signal, in-process: the ranks here are plain Python processes that install no
handler, so a forwarded SIGTERM kills them (exit -15), as it kills a real rank still
importing torch. One node (node 0 of 1), so no other node's rendezvous is waited for."""
import signal
import sys
import time
from types import SimpleNamespace

from rlctl.dist.launch import launch_node
from rlctl.stopping import StopFlag

from test_multinode import free_port

HW = SimpleNamespace(nnodes=1, node_rank=0, num_processes=2, master_addr="127.0.0.1",
                     master_port=free_port(), num_threads=1, dist_timeout_s=30)
SLEEPER = [sys.executable, "-c", "import time; time.sleep(20)"]


def test_a_signal_before_the_ranks_start_reaches_each_and_is_a_stop():
    """The signal came while the launcher was starting its ranks: each rank gets it on
    start, and ranks it killed before their handler make the launch a stop (128 + 15),
    not a failure with a negative code; well before the ranks' 20 s sleep ends."""
    stop = StopFlag(announce=False)
    stop.signum = int(signal.SIGTERM)
    t0 = time.monotonic()
    assert launch_node(SLEEPER, HW, stop, poll_s=0.05) == 128 + signal.SIGTERM
    assert time.monotonic() - t0 < 15


def test_a_rank_failing_without_a_signal_is_its_exit_code():
    failing = [sys.executable, "-c", "raise SystemExit(7)"]
    assert launch_node(failing, HW, StopFlag(announce=False), poll_s=0.05) == 7
