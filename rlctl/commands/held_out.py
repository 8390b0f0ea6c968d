"""The reward scorer of `rlctl eval` and `rlctl rollout`: it never updates the running
reward statistics of ``task.reward_norm=running`` (a held-out batch whitened by its own
scores would score mean 0, std 1 whatever the policy does) but reads the run's saved
ones, from the run's newest checkpoint (``trainer_state.json``, the statistics the
trainer normalised with at its last step). Every score is also reported raw."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from rlctl.errors import CheckpointError
from rlctl.storage.checkpoint import latest_checkpoint, read_state, step_of
from rlctl.tasks.scoring import RewardScorer


@dataclass
class SavedNorm:
    """Where the statistics came from (None: there were none to read)."""
    checkpoint: Optional[str]
    step: Optional[int]
    note: str                # one line for stderr and the report


def held_out_scorer(prepared, target) -> Tuple[RewardScorer, Optional[SavedNorm]]:
    """(a scorer that reads but never updates the statistics, where they came from; None
    without task.reward_norm=running)."""
    scorer = prepared.scorer(norm_owner=False)
    learned = scorer.learned
    if learned is None or learned.norm != "running":
        return scorer, None
    ckpt = latest_checkpoint(target.run_dir) if target.run_dir is not None else None
    state, why = None, "no checkpoint"
    if ckpt is not None:
        try:
            state = read_state(ckpt).get("scorer", {}).get("reward_norm")
            why = f"none in {ckpt}"
        except CheckpointError as exc:
            why = str(exc)
    if not state:
        where = f"run '{target.run_dir}'" if target.run_dir is not None else "this target"
        return scorer, SavedNorm(None, None, (
            f"task.reward_norm=running: {where} has no saved reward statistics ({why}), so "
            "'reward' is the reward models' score without normalisation"))
    learned.load_state(state)
    step = step_of(ckpt)
    return scorer, SavedNorm(str(ckpt), step, (
        f"task.reward_norm=running: 'reward' is normalised with the run's saved statistics "
        f"(checkpoint step {step}); 'reward_raw' is the raw score"))


def reward_label(scorer: RewardScorer, reward_name: str, saved: Optional[SavedNorm]) -> str:
    """What the 'reward' row holds: the configured reward design, or the reward models'
    score (normalised with the saved statistics, clipped) as training used it."""
    learned = scorer.learned
    if learned is None:
        return reward_name
    what = "reward model" if learned.replace_task else f"{reward_name} + reward models"
    shaping = []
    if saved is not None:
        shaping.append(f"normalised with the run's saved statistics, step {saved.step}"
                       if saved.step is not None else "raw: no saved statistics")
    if learned.clip is not None:
        shaping.append(f"clipped to +-{learned.clip:g}")
    return f"{what}, {'; '.join(shaping)}" if shaping else what
