"""Continuing a run from its newest checkpoint: whether a resume may go ahead, and where.

``check_resumable`` runs in the user's process before anything is written: the run has a
complete checkpoint, written by as many ranks as will resume it, it has steps left to
train, and the overrides change none of the keys the checkpoint's tensors and layout depend
on (``ResumeSettings.shape``). ``resume_point`` runs on every rank: the newest checkpoint,
with the metric lines logged after it dropped (they will be redone). ``newest`` says where
a run that lost a rank or an engine can continue from.
"""
from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import OmegaConf

from rlctl.errors import UserError
from rlctl.sinks import SAMPLES_FILE
from rlctl.storage import checkpoint

# The config keys a checkpoint's tensors and layout depend on: a resume cannot change
# them (everything else, e.g. the learning rate or gradient checkpointing, may change).
SHAPE_KEYS = ("model.name", "model.name_or_path", "model.hidden_size", "model.num_layers",
              "model.num_heads", "model.lora.enabled", "model.lora.r", "model.lora.alpha",
              "model.lora.target_modules", "algo.critic", "hardware.backend")
DEEPSPEED_KEYS = ("hardware.zero_stage", "hardware.num_processes")   # ZeRO partitions


@dataclass(frozen=True)
class ResumeSettings:
    """What a resume is checked against: the steps to train to and the shape keys."""
    steps: Optional[int]         # trainer.steps
    shape: Dict[str, Any]        # the SHAPE_KEYS (and DEEPSPEED_KEYS under deepspeed) set

    @classmethod
    def from_config(cls, cfg) -> "ResumeSettings":
        """From a composed config, or an older run's config.yaml (a shape key it does not
        have is left out of ``shape``)."""
        deepspeed = OmegaConf.select(cfg, "hardware.backend") == "deepspeed"
        missing = object()
        found = {k: OmegaConf.select(cfg, k, default=missing)
                 for k in SHAPE_KEYS + (DEEPSPEED_KEYS if deepspeed else ())}
        return cls(steps=OmegaConf.select(cfg, "trainer.steps"),
                   shape={k: (OmegaConf.to_container(v) if OmegaConf.is_config(v) else v)
                          for k, v in found.items() if v is not missing})


def _no_checkpoint(run_dir: Path) -> UserError:
    return UserError(f"cannot resume '{run_dir}': it has no complete checkpoint "
                     "(trainer.checkpoint_every writes them)")


def truncate_after(path: Path, step: int) -> None:
    """Drop the lines of a JSONL run file (metrics, sample tables) logged after ``step``,
    the checkpoint we resume from: those steps will be redone and logged again."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue                     # a line torn by the kill
        if row.get("step", step + 1) <= step:
            keep.append(line)
    path.write_text("".join(x + "\n" for x in keep))


def resume_point(run_dir: Path, backend) -> Path:
    """The newest checkpoint; rank 0 drops the metric and sample lines logged after it."""

    resume_from = checkpoint.latest_checkpoint(run_dir)
    if resume_from is None:
        raise _no_checkpoint(run_dir)
    if backend.is_main:
        for name in ("metrics.jsonl", SAMPLES_FILE):
            truncate_after(run_dir / name, checkpoint.step_of(resume_from))
    backend.barrier()
    return resume_from


def newest(run_dir: Path) -> str:
    """Where a run that lost a rank or an engine can continue from."""
    last = checkpoint.latest_checkpoint(run_dir)
    if last is None:
        return "no checkpoint was saved yet"
    return (f"the newest checkpoint is {last}; once every node is back, run the same launch with "
            f"rlctl train --resume {run_dir}")


def _summary_steps(run_dir: Path) -> Optional[int]:
    """The steps ``summary.json`` reports (written when a run, or a resume, ended); None without one."""
    try:
        return int(json.loads((run_dir / "summary.json").read_text())["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_resumable(run_dir: Path, settings: ResumeSettings, overrides: List[str], world: int) -> None:
    """Refuse (one line) a resume that has nothing to do or cannot load the checkpoint;
    ``settings``: the resume's own, ``world``: the ranks that will resume it."""

    last = checkpoint.latest_checkpoint(run_dir)
    if last is None:
        raise _no_checkpoint(run_dir)
    step = checkpoint.read_state(last)["step"]
    saved = len(list(last.glob("rng-rank*.pt")))       # one per rank that wrote it
    if saved and saved != world:
        raise UserError(f"cannot resume '{run_dir}' with {world} rank(s): its checkpoint {last.name} "
                        f"was written by {saved}; resume with the same number of ranks")
    q = shlex.quote(str(run_dir))
    if settings.steps <= step:
        done = "finished" if _summary_steps(run_dir) == step else "trained"
        raise UserError(f"run '{run_dir}' is already {done} at step {step} (trainer.steps="
                        f"{settings.steps}); nothing to resume. To extend it, raise trainer.steps: "
                        f"rlctl train --resume {q} trainer.steps={max(2 * step, step + 1)}")
    try:
        before = ResumeSettings.from_config(OmegaConf.load(run_dir / "config.yaml")).shape
    except Exception:  # noqa: BLE001 - an unreadable config.yaml: the recipe still rules
        return
    after = settings.shape
    changed = [f"{k}: {before[k]} -> {after.get(k)}" for k in sorted(before)   # keys both know
               if k in after and before[k] != after[k]]
    if changed:
        raise UserError(f"cannot resume '{run_dir}' with {' '.join(overrides)}: the override changes "
                        f"the model's shape or the checkpoint's layout ({'; '.join(changed[:3])}), so it "
                        f"cannot apply to a resume; start a new run from the recipe instead: rlctl train "
                        f"--recipe {shlex.quote(str(run_dir / 'recipe.yaml'))} {' '.join(overrides)}")
