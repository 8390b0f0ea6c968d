"""One data-parallel rank: `python -m rlctl.train.worker RUN_DIR` (started through torchrun's
agent); rank k > 0 writes to ``RUN_DIR/rank<k>.log``. Exit codes: 0 done; 128 + signal
after a stop (checkpoint saved); 3 (``EXIT_SETUP``) failed before the first step; 1 failed."""
from __future__ import annotations

import signal

# A signal the launcher forwards while this rank is still importing torch (seconds) is
# recorded here and handed to the StopFlag below, instead of killing the rank outright.
_EARLY = []
for _s in (signal.SIGINT, signal.SIGTERM):
    signal.signal(_s, lambda signum, frame: _EARLY.append(signum))

import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

if int(os.environ.get("RANK", 0)) and len(sys.argv) > 1:    # rank 0 keeps the terminal
    _log = os.open(Path(sys.argv[1]) / f"rank{os.environ['RANK']}.log",
                   os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(_log, 1)
    os.dup2(_log, 2)

os.environ.setdefault("OMP_NUM_THREADS", "1")      # before torch is imported (below)

from omegaconf import OmegaConf  # noqa: E402

from rlctl.dist.launch import EXIT_SETUP, leave_with_launcher, write_error# noqa: E402
from rlctl.errors import Interrupted, user_message  # noqa: E402
from rlctl.train.build_run import built_rank  # noqa: E402
from rlctl.train.run import finish  # noqa: E402
from rlctl.stopping import StopFlag  # noqa: E402
from rlctl.storage import rundir  # noqa: E402


def main(run_dir: str, resume: bool = False) -> int:
    stop = StopFlag(announce=False)          # the launcher owns the terminal and says it
    with stop.installed():
        leave_with_launcher()
        code = _train(Path(run_dir), resume, stop)
    # Leave without running C++ destructors at interpreter exit: gloo/DeepSpeed threads
    # torn down there can abort ("terminate called without an active exception") after a
    # run that finished and saved everything.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _train(run_dir: Path, resume: bool, stop) -> int:
    steps = [0]
    try:
        rundir.share_lock(run_dir)            # the run stays locked while this rank lives
        for signum in _EARLY:                 # came before the StopFlag was installed
            stop.handle(signum)
        cfg = OmegaConf.load(run_dir / "config.yaml")
        with built_rank(cfg, run_dir, resume, stop) as rank:
            finish(rank, run_dir, rank.trainer.train(run_dir=run_dir, resume_from=rank.resume_from, stop=stop,
                                                     on_step=lambda step, values: steps.__setitem__(0, step)))
    except Interrupted as exc:
        return 128 + exc.signum
    except KeyboardInterrupt:                # a second Ctrl-C: abandon at once
        return 128 + signal.SIGINT
    except Exception as exc:  # noqa: BLE001 - one line for the launcher to report
        if os.environ.get("RLCTL_DEBUG"):
            raise
        message, code = user_message(exc)
        write_error(run_dir, message, code)      # the launcher says it, once
        if os.environ.get("RANK", "0") != "0":
            print(f"error: {message}", file=sys.stderr)   # into rank<k>.log
        return 1 if steps[0] else EXIT_SETUP
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], "--resume" in sys.argv[2:]))
