"""Run directories, ``<output_dir>/<time>-<name>/`` (docs/runs.md lists the files), ``RunLock``."""
from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Dict, FrozenSet, Optional, Tuple

import yaml
from omegaconf import OmegaConf

from rlctl.config.compose import Composed
from rlctl.errors import RunDirError
from rlctl.models.lora import save_lora

LOCK_FILE = ".lock"
_HELD: Dict[str, int] = {}         # run directory -> the descriptor holding its lock here


def _close_held_in_child() -> None:
    """A forked child (the reward worker) closes its copies of the held locks."""
    for fd in _HELD.values():
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


os.register_at_fork(after_in_child=_close_held_in_child)


class RunLock:
    """One writer per run directory: ``<run>/.lock`` holds its pid under ``flock``; stale ones taken over."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_FILE
        self.fd: Optional[int] = None

    def acquire(self) -> "RunLock":
        for _ in range(20):       # a holder may unlink the file between our open and flock
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = _holder_pid(fd)
                os.close(fd)
                raise RunDirError(f"run directory '{self.path.parent}' is in use by another rlctl "
                                  f"process (pid {holder}); wait for it to finish or stop it") from None
            if _same_file(fd, self.path):
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())
                self.fd = fd
                _HELD[str(self.path.parent)] = fd
                return self
            os.close(fd)
        raise RunDirError(f"cannot lock the run directory '{self.path.parent}'")

    def release(self) -> None:
        if self.fd is None:
            return
        _HELD.pop(str(self.path.parent), None)
        if _same_file(self.fd, self.path):
            self.path.unlink(missing_ok=True)      # while still holding it: no one locks a ghost
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> "RunLock":
        return self if self.fd is not None else self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def share_lock(run_dir: Path) -> None:
    """The owner turns its lock shared before launching ranks (one flock call); a launched
    rank takes the shared lock for its life and adds its pid to the file."""
    path = Path(run_dir) / LOCK_FILE
    fd = _HELD.get(str(path.parent))
    if fd is not None:
        fcntl.flock(fd, fcntl.LOCK_SH)
        return
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise RunDirError(f"run directory '{path.parent}' is in use by another rlctl process; "
                          "wait for it to finish or stop it") from None
    _HELD[str(path.parent)] = fd
    with open(path, "a") as f:                 # O_APPEND: ranks do not overwrite each other
        f.write(f"{os.getpid()}\n")


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def _holder_pid(fd: int) -> str:
    """The first live pid in a held lock file, else the first."""
    for _ in range(20):
        pids = os.pread(fd, 4096, 0).decode("ascii", "replace").split()
        if pids:
            for p in pids:
                try:
                    os.kill(int(p), 0)
                except (ValueError, ProcessLookupError):
                    continue
                except PermissionError:
                    pass
                return p
            return pids[0]
        time.sleep(0.05)
    return "unknown"


def _probe(path: Path) -> None:
    """OSError unless ``path`` is a writable directory."""
    probe = path / ".write_test"
    probe.write_text("ok")
    probe.unlink()


def create_run_dir(output_dir: str, name: str) -> Path:
    """A new, writable run directory (fails early with a clear message if it is not)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-") or "run"
    stamp = time.strftime("%Y%m%d-%H%M%S")
    root = Path(output_dir)
    try:
        root.mkdir(parents=True, exist_ok=True)
        for i in range(1000):
            path = root / (f"{stamp}-{safe}" + (f"-{i}" if i else ""))
            try:
                path.mkdir()
                break
            except FileExistsError:
                continue
        _probe(path)
    except OSError as exc:
        raise RunDirError(f"cannot write the run directory under '{output_dir}': "
                          f"{exc.strerror or exc}; set run.output_dir=WRITABLE_DIR") from None
    return path


def new_run_dir(run_cfg) -> Tuple[Path, Optional[FrozenSet[str]]]:
    """``run.dir`` when set (it must not hold a run), else ``run.output_dir/<time>-<name>``;
    and what ``discard_new`` keeps: None (rlctl made it) or the entries it already held."""
    if not run_cfg.get("dir"):
        return create_run_dir(run_cfg.output_dir, run_cfg.name), None
    path = Path(run_cfg.dir)
    if (path / "recipe.yaml").exists():
        raise RunDirError(f"run.dir='{path}' already holds a run; continue it with "
                          f"rlctl train --resume {path}, or name a new directory")
    try:
        kept = frozenset(p.name for p in path.iterdir()) if path.is_dir() else None
        path.mkdir(parents=True, exist_ok=True)
        _probe(path)
    except OSError as exc:
        raise RunDirError(f"cannot write run.dir='{path}': {exc.strerror or exc}; "
                          "set run.dir to a writable directory") from None
    return path, kept


def discard_new(path: Path, kept: Optional[FrozenSet[str]]) -> None:
    """Undo a new run that failed before its first step (``kept``: see ``new_run_dir``)."""
    if kept is None:
        shutil.rmtree(path, ignore_errors=True)
        return
    for entry in path.iterdir():
        if entry.name in kept:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def recipe_text(composed: Composed) -> str:
    """A `# @package _global_` recipe that recomposes exactly this config."""
    body: Dict[str, Any] = OmegaConf.to_container(composed.cfg, resolve=False)
    defaults = [{f"override /{g}": opt} for g, opt in composed.choices.items()]
    head = ("# @package _global_\n# Replay: rlctl train --recipe THIS_FILE [more overrides]\n")
    return head + yaml.safe_dump({"defaults": defaults, **body}, sort_keys=False)


def write_config(run_dir: Path, composed: Composed) -> None:
    """config.yaml, config_unresolved.yaml, overrides.yaml and recipe.yaml of a new run."""
    cfg = composed.cfg
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    (run_dir / "config_unresolved.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=False))
    (run_dir / "overrides.yaml").write_text(yaml.safe_dump(
        {"recipe": composed.recipe, "overrides": list(composed.overrides),
         "choices": dict(composed.choices)}, sort_keys=False))
    (run_dir / "recipe.yaml").write_text(recipe_text(composed))


def record_resume(run_dir: Path, composed: Composed) -> None:
    """A resume's config becomes the run's; overrides.yaml lists each resume's overrides."""
    write_text_atomic(run_dir / "config.yaml", OmegaConf.to_yaml(composed.cfg, resolve=True))
    write_text_atomic(run_dir / "recipe.yaml", recipe_text(composed))
    path = run_dir / "overrides.yaml"
    try:
        record = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        record = {}
    record = record if isinstance(record, dict) else {}
    record["resumes"] = list(record.get("resumes") or []) + [list(composed.overrides)]
    write_text_atomic(path, yaml.safe_dump(record, sort_keys=False))


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json_atomic(path: Path, data: Dict[str, Any]) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True))


def save_model(run_dir: Path, model, tokenizer, lora: bool = False, merged: bool = False,
               state_dict: Optional[dict] = None) -> Path:
    """``<run_dir>/model``: the full model, or the LoRA adapter (``merged``: also model/merged);
    ``state_dict``: the weights to write (a sharded model's, gathered), else the model's own."""
    out = run_dir / "model"
    if lora:
        return save_lora(model, out, tokenizer, merged=merged, state_dict=state_dict)
    model.save_pretrained(out, state_dict=state_dict)
    tokenizer.save_pretrained(out)
    return out

