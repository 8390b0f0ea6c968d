"""One data-parallel rank: `python -m rlctl.engine.worker RUN_DIR` (started by launch.py)."""
from __future__ import annotations

import os
import sys
from pathlib import Path


def main(run_dir: str, resume: bool = False) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from omegaconf import OmegaConf

    from rlctl.engine.run import train_rank
    from rlctl.errors import user_message

    cfg = OmegaConf.load(Path(run_dir) / "config.yaml")
    try:
        train_rank(cfg, Path(run_dir), resume=resume)
    except Exception as exc:  # noqa: BLE001 - one line for the launcher to report
        if os.environ.get("RLCTL_DEBUG"):
            raise
        print(f"error: {user_message(exc)[0]}", file=sys.stderr)
        return 1
    # Leave without running C++ destructors at interpreter exit: gloo/DeepSpeed threads
    # torn down there can abort ("terminate called without an active exception") after a
    # run that finished and saved everything.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], "--resume" in sys.argv[2:]))
