"""`rlctl train`: check the config -> own the run directory (``owned_run``, or ``group_run`` in a
launcher's group) -> build the rank -> train, save and summarize (``finish``); resuming."""
from __future__ import annotations

import json
import resource
import shlex
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch
from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table

from rlctl.dist import launch
from rlctl.config.checks import check_overlong
from rlctl.config.compose import Composed, compose
from rlctl.config.schema import HardwareConfig
from rlctl.envs.environment import is_episodic
from rlctl.errors import (ActorFailed, Interrupted, LaunchError, TrainingFault, UserError, one_line,
                          user_message)
from rlctl.models.loading import check_source
from rlctl.rollout.generate import check_training_sampling
from rlctl.train.build import task_from_config
from rlctl.train.build_run import Rank, built_rank, no_checkpoint
from rlctl.train.preflight import check_entries, check_episodes, check_held_out, warn_config
from rlctl.stopping import StopFlag
from rlctl.storage import checkpoint, rundir

# The config keys a checkpoint's tensors and layout depend on: a resume cannot change them.
SHAPE_KEYS = ("model.name", "model.name_or_path", "model.hidden_size", "model.num_layers",
              "model.num_heads", "model.lora.enabled", "model.lora.r", "model.lora.alpha",
              "model.lora.target_modules", "algo.critic", "hardware.backend")
DEEPSPEED_KEYS = ("hardware.zero_stage", "hardware.num_processes")   # ZeRO partitions
# (what the scorer scored, what a run whose every call failed means)
_KINDS = (("reward", "training", "the policy was trained on all-zero rewards"),
          ("eval_reward", "held-out eval", "the eval/* metrics say nothing about the policy"))


def run_training(overrides: List[str], recipe: Optional[str] = None,
                 resume: Optional[str] = None, composed: Optional[Composed] = None) -> dict:
    """Train a new run, or continue ``resume`` (a run directory) with its own recipe, checked
    before anything is written; the summary (rank 0; others {})."""
    cfg, composed, built = _checked(overrides, recipe, resume, composed)
    hw = cfg.hardware
    group = launch.from_environment(hw.master_port)
    stop = StopFlag()
    with stop.installed():
        if group is not None and group.world_size > 1:
            with group_run(group, hw, cfg.trainer.prompts_per_step, OmegaConf.to_container(cfg), composed,
                           resume, overrides, stop) as (run_dir, on_step), \
                    built_rank(cfg, run_dir, resume is not None, stop, built) as rank:
                summary = finish(rank, run_dir, rank.trainer.train(
                    run_dir=run_dir, resume_from=rank.resume_from, on_step=on_step, stop=stop))
        elif hw.nnodes > 1:
            code = launch.launch_node(launch.node_argv(overrides, recipe, resume), hw, stop)
            if code:
                raise SystemExit(code)        # the failed rank printed its own line
            return {}
        elif hw.num_processes > 1:
            with owned_run(composed, resume, overrides, hw.num_processes) as run:
                summary = _launched(run, hw.num_processes, hw.num_threads, resume is not None, stop)
        else:
            with owned_run(composed, resume, overrides, 1) as run, \
                    built_rank(cfg, run.dir, resume is not None, stop, built) as rank:
                summary = finish(rank, run.dir, rank.trainer.train(
                    run_dir=run.dir, resume_from=rank.resume_from, on_step=run.step_done, stop=stop))
    if summary is None:                       # not rank 0: it prints the summary
        return {}
    print_summary(summary)
    return summary


def _checked(overrides: List[str], recipe: Optional[str], resume: Optional[str],
             composed: Optional[Composed]):
    """(resolved config, composed, built task), every check before a run directory passed."""
    if resume is not None:
        if not (Path(resume) / "recipe.yaml").is_file():
            raise UserError(f"cannot resume '{resume}': not a run directory (no recipe.yaml)")
        recipe = str(Path(resume) / "recipe.yaml")
    composed = composed or compose(overrides, recipe)
    cfg = composed.cfg
    OmegaConf.resolve(cfg)
    check_entries(cfg.algo, cfg.task.name, cfg.hardware.backend)  # registry names, user entries
    built = task_from_config(cfg)               # bad task options fail before anything is written
    try:
        check_source(cfg.model.name, cfg.model.name_or_path)
    except ValueError as exc:
        raise UserError(f"cannot load model: {exc}") from None
    check_training_sampling(cfg.rollout.top_k)
    warn_config(cfg.algo)                  # one line, e.g. a KL estimator biased where it is placed
    check_episodes(cfg.rollout, built.task)
    check_held_out(cfg.trainer.eval_every, built.task, cfg.hardware.num_processes)
    check_overlong(cfg.algo, cfg.rollout, is_episodic(built.task))
    return cfg, composed, built


class _Run:
    """The run directory this process owns and the steps it saw finish."""

    def __init__(self, run_dir: Path):
        self.dir, self.done = run_dir, 0

    def step_done(self, step: int, values) -> None:
        self.done += 1


@contextmanager
def owned_run(composed: Composed, resume: Optional[str], overrides: List[str], world: int,
              on_error=None, resume_args: Sequence[str] = ()):
    """The run directory (new, or ``resume``'s checked for ``world`` ranks), locked, its config
    written; yields a ``_Run``. A new run failing before its first step is removed.
    ``on_error(exc)``: called if set-up fails; ``resume_args``: this node's resume args."""
    ready = False
    try:
        run_dir, kept = (Path(resume), None) if resume is not None else rundir.new_run_dir(composed.cfg.run)
        with rundir.RunLock(run_dir).acquire():
            run = _Run(run_dir)
            try:
                if resume is None:
                    rundir.write_config(run_dir, composed)
                else:
                    check_resumable(run_dir, ResumeSettings.from_config(composed.cfg), overrides, world)
                    rundir.record_resume(run_dir, composed)
                ready = True
                try:
                    yield run
                except KeyboardInterrupt as exc:          # a second Ctrl-C: abandoned mid-step
                    if isinstance(exc, Interrupted):
                        raise
                    last = checkpoint.latest_checkpoint(run_dir)
                    run.done = run.done or int(last is not None)
                    raise Interrupted(run_dir, checkpoint.step_of(last) if last else 0, aborted=True) from None
            except BaseException as exc:
                if isinstance(exc, Interrupted):
                    exc.resume_args = tuple(resume_args)
                if resume is None and not run.done and getattr(exc, "before_training", True):
                    rundir.discard_new(run_dir, kept)   # launched: before_training set by LaunchError
                if isinstance(exc, ActorFailed):       # a local rollout engine was lost
                    raise ActorFailed(f"{exc}; {newest(run_dir)}") from None
                raise
    except Exception as exc:
        if not ready and on_error is not None:         # set-up failed
            on_error(exc)
        raise


def _launched(run: _Run, n: int, threads: int, resume: bool, stop) -> dict:
    """Launch ``n`` local ranks on ``run`` and wait; rank 0's summary."""
    rundir.share_lock(run.dir)               # every rank holds it too
    signum = launch.launch(n, run.dir, threads, resume=resume, stop=stop)
    last = checkpoint.latest_checkpoint(run.dir)
    run.done = int(last is not None or (run.dir / "summary.json").is_file())
    if signum:
        raise Interrupted(run.dir, checkpoint.step_of(last) if last else 0, signum)
    return json.loads((run.dir / "summary.json").read_text())


def finish(rank: Rank, run_dir: Path, result) -> Optional[dict]:
    """After ``rank`` trained (``result``): close its sinks and source, save the model and
    ``summary.json`` (every rank: collectives); the summary (rank 0; others None)."""
    tr = rank.trainer
    tr.sink.summary({f"final/{k}": v for k, v in result.eval_end.items()})
    rank.closing.close()
    seconds = time.perf_counter() - rank.started
    model_dir = (_save_model(tr.backend, run_dir, tr.policy, tr.critic, tr.tokenizer, rank.lora, rank.merged)
                 if rank.save else None)
    summary = run_summary(run_dir, result, tr.backend, seconds, rank.lora, rank.params, model_dir,
                          (tr.scorer, tr.eval_scorer))
    if not tr.backend.is_main:
        return None
    rundir.write_json_atomic(run_dir / "summary.json", summary)
    return summary


def _save_model(backend, run_dir: Path, policy, critic, tokenizer, lora: bool,
                merged: bool) -> Optional[Path]:
    """Rank 0 writes the policy and a separate critic; the policy's directory (else None)."""
    model_dir = None
    with backend.gathered(policy) as state:
        if backend.is_main:
            model_dir = rundir.save_model(run_dir, policy, tokenizer, lora=lora, merged=merged,
                                          state_dict=state)
    if critic is not None:
        with backend.gathered(critic) as state:
            if backend.is_main:
                critic.save_pretrained(run_dir / "critic", state_dict=state)
    return model_dir


# ---- a rank of a group a launcher started (torchrun, srun, rlctl's own on several nodes) ----
@contextmanager
def group_run(group, hw: HardwareConfig, prompts_per_step: int, resolved: dict, composed: Composed,
              resume: Optional[str], overrides: List[str], stop):
    """Join the group (``resolved``, the config, compared with rank 0's); rank 0 owns the run
    directory and shares its path (or its error); yields (run directory, on_step) on every rank."""
    _check_group(group, hw.num_processes, hw.nnodes, prompts_per_step)
    launch.leave_with_launcher()
    launch.join(group, hw.device, hw.dist_timeout_s, resolved, stop)
    node_args = (f"hardware.node_rank={group.node}",) if group.source == "rlctl" else ()
    if group.rank != 0:
        run_dir = Path(launch.share(group, None))
        with _lost_rank_is_one_line(group, run_dir, node_args):
            yield run_dir, None
        return

    def share_error(exc):
        launch.share(group, None, error=user_message(exc)[0])
    with owned_run(composed, resume, overrides, group.world_size, share_error, node_args) as run:
        launch.share(group, str(run.dir))
        with _lost_rank_is_one_line(group, run.dir, node_args):
            yield run.dir, run.step_done


def _check_group(group, num_processes: int, nnodes: int, prompts_per_step: int) -> None:
    """rlctl's rank counts agree with the launcher's, whose world size divides the prompts."""
    if group.source != "rlctl" and (num_processes != 1 or nnodes != 1):
        raise UserError(f"hardware.num_processes={num_processes} / hardware.nnodes={nnodes} "
                        f"with {group.source} already starting {group.world_size} ranks: leave both "
                        "at 1 (the launcher's WORLD_SIZE is the number of ranks)")
    if prompts_per_step % group.world_size:
        raise UserError(f"the launcher's world size {group.world_size} ({group.source}) must divide "
                        f"trainer.prompts_per_step={prompts_per_step} (each rank samples "
                        "whole prompt groups)")


@contextmanager
def _lost_rank_is_one_line(group, run_dir: Path, node_args: Sequence[str]):
    """A collective failing mid-run (a rank died) is one line naming the newest checkpoint."""
    try:
        yield
    except Interrupted as exc:
        exc.resume_args = tuple(node_args)
        raise
    except (UserError, TrainingFault, ActorFailed, LaunchError):
        raise
    except RuntimeError as exc:   # before_training: a new run that never stepped is removed
        raise LaunchError(f"rank {group.rank} of {group.world_size}: lost contact with another rank "
                          f"({one_line(exc)[:160]}); {newest(run_dir)}", True) from None


# ---- resuming ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ResumeSettings:
    """What a resume is checked against: the steps to train to and the shape keys set."""
    steps: Optional[int]         # trainer.steps
    shape: Dict[str, Any]        # the SHAPE_KEYS (and DEEPSPEED_KEYS under deepspeed) set

    @classmethod
    def from_config(cls, cfg) -> "ResumeSettings":
        """From a composed config, or an older run's config.yaml (keys it lacks left out)."""
        deepspeed = OmegaConf.select(cfg, "hardware.backend") == "deepspeed"
        missing = object()
        found = {k: OmegaConf.select(cfg, k, default=missing)
                 for k in SHAPE_KEYS + (DEEPSPEED_KEYS if deepspeed else ())}
        return cls(steps=OmegaConf.select(cfg, "trainer.steps"),
                   shape={k: (OmegaConf.to_container(v) if OmegaConf.is_config(v) else v)
                          for k, v in found.items() if v is not missing})


def check_resumable(run_dir: Path, settings: ResumeSettings, overrides: List[str], world: int) -> None:
    """Refuse (one line) a resume with nothing to do, of another world size or changing a shape."""
    last = checkpoint.latest_checkpoint(run_dir)
    if last is None:
        raise no_checkpoint(run_dir)
    step = checkpoint.read_state(last)["step"]
    saved = len(list(last.glob("rng-rank*.pt")))       # one per rank that wrote it
    reshards = settings.shape.get("hardware.backend") == "fsdp2"   # DCP reshards its checkpoint
    if saved and saved != world and not reshards:
        raise UserError(f"cannot resume '{run_dir}' with {world} rank(s): its checkpoint {last.name} "
                        f"was written by {saved}; resume with the same number of ranks")
    q, steps = shlex.quote(str(run_dir)), settings.steps
    if steps <= step:
        try:
            finished = int(json.loads((run_dir / "summary.json").read_text())["steps"]) == step
        except (OSError, ValueError, KeyError, TypeError):
            finished = False
        done = "finished" if finished else "trained"
        raise UserError(f"run '{run_dir}' is already {done} at step {step} (trainer.steps="
                        f"{steps}); nothing to resume. To extend it, raise trainer.steps: "
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


def newest(run_dir: Path) -> str:
    """Where a run that lost a rank or an engine can continue from."""
    last = checkpoint.latest_checkpoint(run_dir)
    if last is None:
        return "no checkpoint was saved yet"
    return (f"the newest checkpoint is {last}; once every node is back, run the same launch with "
            f"rlctl train --resume {run_dir}")


# ---- summary.json --------------------------------------------------------------------------
def reward_report(train: Sequence[float], evaluation: Sequence[float] = (0, 0, 0)) -> Dict[str, Any]:
    """summary.json's reward fields from training's and eval's (calls, errors, timeouts)."""
    out: Dict[str, Any] = {}
    warnings: List[str] = []
    for (prefix, what, meaning), (calls, errors, timeouts) in zip(_KINDS, (train, evaluation)):
        calls, errors, timeouts = int(calls), int(errors), int(timeouts)
        out.update({f"{prefix}_calls": calls, f"{prefix}_errors": errors,
                    f"{prefix}_timeouts": timeouts})
        failed = errors + timeouts
        detail = f"{errors} raised or were not finite, {timeouts} timed out"
        if calls and failed >= calls:
            warnings.append(f"every {what} reward call failed ({failed} of {calls}: {detail}) and "
                            f"scored 0: {meaning}; the log's 'reward failed' lines show why")
        elif failed:
            warnings.append(f"{failed} of {calls} {what} reward calls failed ({detail}) and scored 0")
    out["warnings"] = warnings
    return out


def run_summary(run_dir: Path, result, backend, seconds: float, lora: bool, params: Sequence[int],
                model_dir: Optional[Path], scorers: Sequence[Any]) -> Dict[str, Any]:
    """``summary.json`` of ``result``. A collective."""
    trainable, total = params
    summary = {"run_dir": str(run_dir), "steps": result.steps, "train_seconds": result.seconds,
               "setup_seconds": seconds - result.seconds, "tokens_per_s": result.tokens_per_s,
               "eval_start": result.eval_start, "eval_end": result.eval_end,
               "final_metrics": result.last_metrics, "lora": lora,
               "params_trainable": trainable, "params_total": total,
               "num_processes": backend.world_size, "backend": backend.name}
    if model_dir is not None:
        summary["model_dir"] = str(model_dir)
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024])  # KiB -> MiB
    summary["peak_rss_mb"] = float(backend.all_reduce(peak, "max"))
    counts = torch.tensor([[float(s.calls), float(s.errors), float(s.timeouts)] for s in scorers])  # [2, 3]
    summary.update(reward_report(*backend.all_reduce(counts, "sum").tolist()))
    return summary


def print_summary(summary: Dict[str, Any]) -> None:
    table = Table(title="rlctl run summary", show_header=True)
    for name, justify in (("metric", "left"), ("start", "right"), ("end", "right")):
        table.add_column(name, justify=justify)
    start, end = summary.get("eval_start", {}), summary.get("eval_end", {})
    for key in sorted(set(start) | set(end)):
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        table.add_row(key, fmt(start.get(key)), fmt(end.get(key)))
    table.add_row("train time (s)", "", f"{summary['train_seconds']:.1f}")
    table.add_row("tokens/s", "", f"{summary['tokens_per_s']:.0f}")
    if "reward_calls" in summary:
        failed = summary["reward_errors"] + summary["reward_timeouts"]
        table.add_row("reward calls failed", "", f"{failed} of {summary['reward_calls']}")
    console = Console()
    console.print(table)
    for line in summary.get("warnings", []):
        console.print(f"warning: {line}", highlight=False)
    console.print(f"run dir: {summary['run_dir']}", highlight=False, soft_wrap=True)  # no newline in the path
