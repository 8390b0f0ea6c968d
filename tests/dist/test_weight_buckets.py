"""The weights gathered for the rollout engines (``TorchBackend.weight_buckets``): a rank that
does not come to a bucket within the time limit stops the gather with one line naming it.
Two real gloo ranks, forked: rank 1 never gathers; rank 0 must give up after the limit
(1.5 s), not wait for the process group's (60 s here), and name rank 1."""
import datetime
import multiprocessing
import os
import time

import torch.distributed as dist

from rlctl.demo.tiny import build_model, build_tokenizer
from rlctl.dist.backends import TorchBackend
from rlctl.errors import user_message
from test_multinode import free_port

LIMIT_S = 1.5


def _rank(rank: int, port: int, conn) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    if rank == 1:                 # alive, in the group, but never at the gather
        time.sleep(3 * LIMIT_S + 5)
        return
    model = build_model(build_tokenizer(), hidden_size=32, num_layers=1, num_heads=4, seed=0)
    t0 = time.monotonic()
    try:
        list(TorchBackend("cpu").weight_buckets(model, bucket_mb=1.0, timeout_s=LIMIT_S))
        conn.send(("no error", time.monotonic() - t0))
    except Exception as exc:  # noqa: BLE001 - the test reads what the user would see
        conn.send((user_message(exc), time.monotonic() - t0))


def test_a_rank_that_does_not_come_to_the_gather_is_named_within_the_limit():
    ctx = multiprocessing.get_context("fork")
    mine, theirs = ctx.Pipe()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, theirs), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        assert mine.poll(30), "rank 0 did not finish within 30 s"
        (line, code), waited = mine.recv()
    finally:
        for p in procs:
            p.kill()
            p.join(5)
    assert code == 1 and "\n" not in line and LIMIT_S <= waited < LIMIT_S + 10
    assert line.startswith("rank 1 did not answer within 1.5 s (hardware.dist_timeout_s)"), line
