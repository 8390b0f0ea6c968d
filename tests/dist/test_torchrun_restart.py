"""torchrun --max-restarts starts the workers again on the same agent store (its static
rendezvous keeps one TCPStore server at MASTER_PORT for the whole job): what the failed
attempt left there must not reach the next one."""
import re
import sys
from pathlib import Path

from test_multinode import BIN, finish, free_port, start

WORKER = Path(__file__).with_name("restart_worker.py")


def test_a_torchrun_restart_forms_its_group_and_shares_afresh():
    """Attempt 0 forms the group, shares 'dir-0' and fails on rank 1; attempt 1 must form a
    new gloo group (not dial attempt 0's dead ranks from their stale addresses) and every
    rank must read attempt 1's 'dir-1', not attempt 0's. The sums are 1 + 2 = 3."""
    port = free_port()
    (code, out, err), = finish([start([str(BIN / "torchrun"), "--nnodes=1", "--nproc_per_node=2",
                                       "--max-restarts=1", "--master_addr=127.0.0.1",
                                       f"--master_port={port}", str(WORKER)])], timeout=90)
    # the two ranks share one stdout pipe, and under load one rank's line can land before
    # the other's newline: read the reports wherever they are, not line by line
    lines = sorted(re.findall(r"attempt \d+ rank \d+ shared=\S+? sum=\d+", out))
    assert lines == ["attempt 0 rank 0 shared=dir-0 sum=3", "attempt 0 rank 1 shared=dir-0 sum=3",
                     "attempt 1 rank 0 shared=dir-1 sum=3", "attempt 1 rank 1 shared=dir-1 sum=3"], \
        err[-3000:]
    assert code == 0, err[-3000:]
