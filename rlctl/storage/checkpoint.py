"""Checkpoints of the training state (under LoRA only what trains), written atomically
(docs/runs.md lists the files)."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Dict, Optional

import torch

from rlctl.errors import CheckpointError

PREFIX = "step-"


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def latest_checkpoint(run_dir: Path) -> Optional[Path]:
    """The last complete checkpoint of the run, or None."""
    root = checkpoint_dir(run_dir)
    done = sorted(p for p in root.glob(f"{PREFIX}*") if p.is_dir() and not p.name.endswith(".tmp")) \
        if root.is_dir() else []
    return done[-1] if done else None


def step_of(path: Path) -> int:
    """The step of a checkpoint directory, from its name (``step-00000040`` -> 40)."""
    return int(path.name[len(PREFIX):])


REQUIRED = {"step": int, "kl": dict}


def read_state(path: Path) -> Dict[str, Any]:
    """``path``/trainer_state.json checked, else one CheckpointError naming the file."""
    file = Path(path) / "trainer_state.json"
    try:
        state = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"cannot read {file}: {' '.join(str(exc).split())[:200]} "
                              "(the checkpoint is damaged; delete it to resume from an earlier one)") from None
    missing = [k for k, t in REQUIRED.items() if not isinstance(state, dict) or not isinstance(state.get(k), t)]
    if missing:
        raise CheckpointError(f"{file} lacks {', '.join(repr(k) for k in missing)} (it should hold the "
                              "step, the KL controller and the counters; the checkpoint is damaged: "
                              "delete it to resume from an earlier one)")
    return state


def save(trainer, run_dir: Path, step: int, extra: Dict[str, Any], keep: int) -> Path:
    """Write the checkpoint of ``step`` (every rank calls this)."""
    b = trainer.backend
    final = checkpoint_dir(run_dir) / f"{PREFIX}{step:08d}"
    tmp = final.with_name(final.name + ".tmp")
    if b.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    b.barrier()
    try:
        b.save_state(tmp, trainer.critic)
        rng = {"torch": torch.get_rng_state(), "python": trainer.prompt_rng.getstate()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        torch.save(rng, tmp / f"rng-rank{b.rank}.pt")
        b.barrier()
        if b.is_main:
            state = {"step": step, "kl": trainer.kl_ctl.state_dict(), **extra}
            (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2))
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            for old in sorted(checkpoint_dir(run_dir).glob(f"{PREFIX}*"))[:-max(keep, 1)]:
                if not old.name.endswith(".tmp"):
                    shutil.rmtree(old, ignore_errors=True)
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoint {final}: {exc.strerror or exc} "
                              "(is the disk full or read-only?)") from None
    b.barrier()
    return final


def load(trainer, path: Path) -> Dict[str, Any]:
    """Restore everything ``save`` wrote; returns trainer_state.json."""
    b = trainer.backend
    state = read_state(path)
    try:
        b.load_state(path, trainer.critic)
        file = path / f"rng-rank{b.rank}.pt"   # absent: a resharded resume's new rank (fresh seeds)
        rng = torch.load(file, weights_only=True) if file.exists() or b.rank == 0 else None
    except Exception as exc:  # noqa: BLE001 - unpickling, safetensors, shape and key errors alike
        raise CheckpointError(f"checkpoint {path} is unreadable or incomplete: "
                              f"{' '.join(str(exc).split())[:200]}") from None
    if rng is not None:
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        trainer.prompt_rng.setstate(_as_tuple(rng["python"]))
    try:
        trainer.kl_ctl.load_state_dict(state["kl"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path / 'trainer_state.json'}: the KL controller's state 'kl' is "
                              f"damaged ({type(exc).__name__}: {exc}); delete the checkpoint to resume "
                              "from an earlier one") from None
    return state


def _as_tuple(x):
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x
