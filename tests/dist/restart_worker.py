"""One rank of the torchrun restart check (run by test_torchrun_restart.py).

    torchrun --max-restarts=1 ... restart_worker.py

Every rank joins the group (launch.join: torch's env:// rendezvous) and takes the text rank 0
shares (launch.share: the run directory in `rlctl train`), then sums its rank + 1
over the group. Attempt 0: rank 1 fails (exit 1) once that is done, so torchrun stops the
workers and starts them again on the same agent store. Attempt 1: rank 0 waits 1 s
before it shares, so a rank that read a value left from attempt 0 would have it by then.
Each rank prints ``attempt A rank R shared=TEXT sum=S``.
"""
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from rlctl.dist import launch# noqa: E402

attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
group = launch.from_environment(29500)
launch.join(group, "cpu", 30.0)
if group.rank == 0 and attempt:
    time.sleep(1.0)
shared = launch.share(group, f"dir-{attempt}" if group.rank == 0 else None)
total = torch.ones(1) * (group.rank + 1)
dist.all_reduce(total)
print(f"attempt {attempt} rank {group.rank} shared={shared} sum={total.item():g}", flush=True)
if attempt == 0:
    if group.rank == 1:
        os._exit(1)
    time.sleep(60)                        # torchrun stops it once rank 1 failed
dist.barrier()
