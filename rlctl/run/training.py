"""`rlctl train`: compose -> run directory -> train (1 process, or N launched ranks) -> save.

``run_training`` runs in the user's process: it composes and validates the config,
creates the run directory and either trains in-process or launches the ranks.
``train_rank`` is what every rank runs: build task, model (+LoRA, +critic), backend and
sinks, train, and (rank 0) save the model and ``summary.json``.
"""
from __future__ import annotations

import copy
import json
import os
import resource
import shlex
import time
from pathlib import Path
from typing import List, Optional

import torch
from omegaconf import DictConfig, OmegaConf

from rlctl.backends import tcp_group
from rlctl.backends.base import build_backend
from rlctl.backends.launch import launch, launch_node, leave_with_launcher, node_argv
from rlctl.compose import compose
from rlctl.errors import ActorFailed, Interrupted, LaunchError, TrainingFault, UserError, user_message
from rlctl.learner.trainer import Trainer
from rlctl.models.loading import check_source
from rlctl.models.lora import count_parameters
from rlctl.models.quiet import quiet_libraries
from rlctl.rollout import remote_actors
from rlctl.rollout.actors import actor_main, build_source
from rlctl.rollout.sampler import check_training_sampling
from rlctl.run.build import model_from_config, task_from_config
from rlctl.run.checks import warn_config
from rlctl.run.entries import EntryNames, check_entries
from rlctl.run.report import print_summary, reward_summary
from rlctl.sinks import NullSink, build_sinks
from rlctl.stopping import StopFlag
from rlctl.storage import checkpoint, rundir
from rlctl.tasks.prompt_budget import PromptBudget, bind_task


def _truncate_metrics(run_dir: Path, step: int) -> None:
    """Drop metric lines logged after the checkpoint we resume from (they will be redone)."""
    path = run_dir / "metrics.jsonl"
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


def _resume_point(run_dir: Path, backend) -> Path:
    """The newest checkpoint; rank 0 drops the metric lines logged after it."""

    resume_from = checkpoint.latest_checkpoint(run_dir)
    if resume_from is None:
        raise UserError(f"cannot resume '{run_dir}': it has no complete checkpoint "
                        "(trainer.checkpoint_every writes them)")
    if backend.is_main:
        _truncate_metrics(run_dir, checkpoint.step_of(resume_from))
    backend.barrier()
    return resume_from


def _sink(cfg: DictConfig, run_dir: Path, backend):
    """Metric sinks on rank 0 (the others log nothing)."""

    if not backend.is_main:
        return NullSink()
    lg = cfg.logger
    return build_sinks(run_dir=run_dir, jsonl=lg.jsonl, wandb=lg.wandb, wandb_mode=lg.wandb_mode,
                       project=lg.project, name=run_dir.name, config=OmegaConf.to_container(cfg),
                       console=lg.console, total_steps=cfg.trainer.steps)


def _save_model(cfg: DictConfig, backend, run_dir: Path, policy, critic, tokenizer, summary: dict) -> None:
    """The final policy (the adapter for LoRA) and a separate critic, written by rank 0."""

    lora = bool(cfg.model.lora.enabled)
    with backend.gathered(policy):
        if backend.is_main:
            summary["model_dir"] = str(rundir.save_model(
                run_dir, policy, tokenizer, lora=lora, merged=lora and cfg.model.lora.save_merged))
    if critic is not None:
        with backend.gathered(critic):
            if backend.is_main:
                critic.save_pretrained(run_dir / "critic")


def _on_local_gpu(cfg: DictConfig) -> DictConfig:
    """With several ranks on GPUs, each uses cuda:LOCAL_RANK (its launcher's local index)."""
    if cfg.hardware.device != "cuda" or int(os.environ.get("WORLD_SIZE", 1)) == 1:
        return cfg
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    cfg = copy.deepcopy(cfg)
    cfg.hardware.device = f"cuda:{local}"
    return cfg


def train_rank(cfg: DictConfig, run_dir: Path, resume: bool = False, stop=None,
               on_step=None) -> Optional[dict]:
    """Train on this rank; rank 0 saves and returns the summary (other ranks: None).
    ``stop``: the StopFlag the loop checks; ``on_step(step, metrics)`` after each step."""
    quiet_libraries(cfg.hardware.device, cfg.hardware.num_threads)
    t0 = time.perf_counter()
    cfg = _on_local_gpu(cfg)
    hw = cfg.hardware
    backend = build_backend(hw.backend, hw.device, hw.zero_stage, hw.precision, hw.deepspeed_config)
    try:
        task = task_from_config(cfg)
        model, critic, tokenizer, ref_model = model_from_config(cfg)
        bind_task(PromptBudget.from_config(cfg), task, tokenizer, model)   # chat template; prompts within the context
        trainable, total = count_parameters(model, critic)
        torch.manual_seed(cfg.seed * 1000 + backend.rank)   # each rank samples differently
        resume_from = _resume_point(run_dir, backend) if resume else None
        sink = _sink(cfg, run_dir, backend)
        try:
            source = build_source(cfg, model, tokenizer, task, backend, stop)
            try:
                trainer = Trainer.from_config(cfg, model, tokenizer, task, sink, source=source,
                                              critic=critic, ref_model=ref_model, backend=backend)
            except BaseException:
                source.close()                   # async: the actors end now, not at Python's exit
                raise
            try:
                result = trainer.train(run_dir=run_dir, resume_from=resume_from, on_step=on_step,
                                       stop=stop)
            finally:
                trainer.close()                  # async mode: stop the rollout actor
            sink.summary({f"final/{k}": v for k, v in result.eval_end.items()})
        finally:
            sink.close()
        policy, lora = trainer.policy, bool(cfg.model.lora.enabled)
        summary = {"run_dir": str(run_dir), "steps": result.steps, "train_seconds": result.seconds,
                   "setup_seconds": time.perf_counter() - t0 - result.seconds,
                   "tokens_per_s": result.tokens_per_s,
                   "eval_start": result.eval_start, "eval_end": result.eval_end,
                   "final_metrics": result.last_metrics, "lora": lora,
                   "params_trainable": trainable, "params_total": total,
                   "num_processes": backend.world_size, "backend": backend.name}
        if cfg.run.save_model:
            _save_model(cfg, backend, run_dir, policy, critic, tokenizer, summary)
        peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024])  # KiB -> MiB
        summary["peak_rss_mb"] = float(backend.all_reduce(peak, "max"))
        summary.update(reward_summary((trainer.scorer, trainer.eval_scorer), backend))  # every rank
        if backend.is_main:
            rundir.write_json_atomic(run_dir / "summary.json", summary)
            return summary
        return None
    finally:
        backend.close()


def run_training(overrides: List[str], recipe: Optional[str] = None,
                 resume: Optional[str] = None) -> dict:
    """Train a new run, or (``resume`` = a run directory) continue one from its newest
    checkpoint with the run's own recipe (``overrides`` may raise trainer.steps to extend).

    Everything that can be checked is checked before anything is written: a refused
    resume leaves the run untouched, and a new run that fails during set-up (before its
    first step) leaves no directory behind. The run directory is locked for the whole
    run; SIGINT/SIGTERM stop every rank after the same step with a checkpoint saved."""

    if resume is not None:
        run_dir = Path(resume)
        if not (run_dir / "recipe.yaml").is_file():
            raise UserError(f"cannot resume '{resume}': not a run directory (no recipe.yaml)")
        recipe = str(run_dir / "recipe.yaml")
    composed = compose(overrides, recipe)
    cfg = composed.cfg
    OmegaConf.resolve(cfg)
    check_entries(EntryNames.from_config(cfg))  # registry names and user entries, likewise
    task_from_config(cfg)                       # bad task options fail before anything is written
    try:
        check_source(cfg.model.name, cfg.model.name_or_path)
    except ValueError as exc:
        raise UserError(f"cannot load model: {exc}") from None
    check_training_sampling(cfg.rollout.top_k)   # refused before a run directory exists
    warn_config(cfg.algo)                  # one line, e.g. a KL estimator biased where it is placed
    remote_actors.check_layout(cfg)
    group = tcp_group.from_environment(cfg.hardware.master_port)
    stop = StopFlag()
    with stop.installed():
        if group is not None and group.world_size > 1:
            summary = _train_in_group(group, cfg, composed, resume, overrides, stop)
        elif cfg.hardware.nnodes > 1 and cfg.trainer.async_rollout.enabled and cfg.hardware.node_rank:
            return remote_actors.serve_node(cfg, stop, actor_main)   # actors only; no run directory
        elif cfg.hardware.nnodes > 1 and not cfg.trainer.async_rollout.enabled:
            code = launch_node(node_argv(overrides, recipe, resume), cfg.hardware, stop)
            if code:
                raise SystemExit(code)        # the failed rank printed its own line
            return {}
        else:
            summary = _train_alone(cfg, composed, resume, overrides, stop)
    if summary is None:                       # not rank 0: it prints the summary
        return {}
    print_summary(summary)
    return summary


def _train_alone(cfg: DictConfig, composed, resume: Optional[str], overrides: List[str], stop) -> dict:
    """This process owns the run: train here or launch hardware.num_processes local ranks."""

    if resume is None:
        run_dir, kept = rundir.new_run_dir(cfg.run)
    else:
        run_dir, kept = Path(resume), None
    with rundir.RunLock(run_dir):
        try:
            if resume is None:
                return _train_new(cfg, composed, run_dir, kept, stop)
            _check_resumable(run_dir, cfg, overrides, cfg.hardware.num_processes)
            rundir.record_resume(run_dir, composed)
            return _train_here_or_launched(cfg, run_dir, True, stop, [0])
        except ActorFailed as exc:            # a rollout actor (or its node) was lost
            raise ActorFailed(f"{exc}; {_newest(run_dir)}") from None


def _train_in_group(group, cfg: DictConfig, composed, resume: Optional[str], overrides: List[str],
                    stop) -> Optional[dict]:
    """One rank of a job an external launcher (or rlctl's on several nodes) started: join
    the TCP group; rank 0 makes (or checks) the run directory, holds its lock, writes the
    config and shares the path; every rank trains. Rank 0 returns the summary."""

    _check_group(group, cfg)
    leave_with_launcher()
    tcp_group.join(group, cfg.hardware.device, cfg.hardware.dist_timeout_s, OmegaConf.to_container(cfg), stop)
    if group.rank != 0:
        run_dir = Path(tcp_group.share(group, None))
        return _lost_rank_is_one_line(group, run_dir, lambda: train_rank(cfg, run_dir, resume=resume is not None,
                                                                         stop=stop))
    try:
        run_dir, kept = (Path(resume), None) if resume is not None else rundir.new_run_dir(cfg.run)
        lock = rundir.RunLock(run_dir).acquire()
    except Exception as exc:
        tcp_group.share(group, None, error=user_message(exc)[0])
        raise
    with lock:
        try:
            if resume is not None:
                _check_resumable(run_dir, cfg, overrides, group.world_size)
                rundir.record_resume(run_dir, composed)
        except Exception as exc:
            tcp_group.share(group, None, error=user_message(exc)[0])
            raise
        tcp_group.share(group, str(run_dir))
        if resume is not None:
            return _lost_rank_is_one_line(group, run_dir, lambda: _train_here_or_launched(
                cfg, run_dir, True, stop, [0], here=True))
        return _lost_rank_is_one_line(group, run_dir, lambda: _train_new(cfg, composed, run_dir, kept,
                                                                         stop, here=True))


def _check_group(group, cfg: DictConfig) -> None:
    """The launcher decides the ranks: rlctl's own rank counts must not contradict it."""
    hw = cfg.hardware
    if group.source != "rlctl" and (hw.num_processes != 1 or hw.nnodes != 1):
        raise UserError(f"hardware.num_processes={hw.num_processes} / hardware.nnodes={hw.nnodes} "
                        f"with {group.source} already starting {group.world_size} ranks: leave both "
                        "at 1 (the launcher's WORLD_SIZE is the number of ranks)")
    if cfg.trainer.prompts_per_step % group.world_size:
        raise UserError(f"the launcher's world size {group.world_size} ({group.source}) must divide "
                        f"trainer.prompts_per_step={cfg.trainer.prompts_per_step} (each rank samples "
                        "whole prompt groups)")


def _lost_rank_is_one_line(group, run_dir: Path, train):
    """A collective that fails mid-run (another rank or node died) is one line naming the
    newest checkpoint, not a gloo/NCCL traceback."""

    try:
        return train()
    except Interrupted as exc:                 # rlctl's launcher: each node resumes as itself
        exc.resume_args = () if group.source != "rlctl" else (f"hardware.node_rank={group.node}",)
        raise
    except (UserError, TrainingFault, ActorFailed, LaunchError):
        raise
    except RuntimeError as exc:
        raise LaunchError(f"rank {group.rank} of {group.world_size}: lost contact with another rank "
                          f"({' '.join(str(exc).split())[:160]}); {_newest(run_dir)}") from None


def _newest(run_dir: Path) -> str:
    """Where a run that lost a rank or an actor can continue from."""
    last = checkpoint.latest_checkpoint(run_dir)
    if last is None:
        return "no checkpoint was saved yet"
    return (f"the newest checkpoint is {last}; once every node is back, run the same launch with "
            f"rlctl train --resume {run_dir}")


def _train_new(cfg: DictConfig, composed, run_dir: Path, kept, stop, here: bool = False) -> dict:
    """Write the config and train; a failure before step 1 removes what rlctl wrote
    (``kept``: see rundir.new_run_dir)."""

    done = [0]                                   # steps finished (this process or rank 0)
    try:
        rundir.write_config(run_dir, composed)
        return _train_here_or_launched(cfg, run_dir, False, stop, done, here)
    except BaseException as exc:
        if not done[0] and getattr(exc, "before_training", True):   # launched: set by LaunchError
            rundir.discard_new(run_dir, kept)
        raise


def _train_here_or_launched(cfg: DictConfig, run_dir: Path, resume: bool, stop, done: list,
                            here: bool = False) -> dict:
    """Train in this process, or launch hardware.num_processes ranks and wait for them.
    ``done[0]`` counts the steps this process saw finish (launched: 1 once any did)."""

    def on_step(step, values):
        done[0] += 1
    try:
        if here or cfg.hardware.num_processes == 1:
            return train_rank(cfg, run_dir, resume=resume, stop=stop, on_step=on_step)
        signum = launch(cfg.hardware.num_processes, run_dir, cfg.hardware.num_threads,
                        resume=resume, stop=stop, lock_fd=rundir.held_fd(run_dir))
        last = checkpoint.latest_checkpoint(run_dir)
        done[0] = int(last is not None or (run_dir / "summary.json").is_file())
        if signum:
            raise Interrupted(run_dir, checkpoint.step_of(last) if last else 0, signum)
        return json.loads((run_dir / "summary.json").read_text())
    except Interrupted:
        raise
    except KeyboardInterrupt:                    # a second Ctrl-C: abandoned mid-step
        last = checkpoint.latest_checkpoint(run_dir)
        done[0] = done[0] or int(last is not None)
        raise Interrupted(run_dir, checkpoint.step_of(last) if last else 0, aborted=True) from None


# The config keys a checkpoint's tensors and layout depend on: a resume cannot change
# them (everything else, e.g. the learning rate or gradient checkpointing, may change).
_SHAPE_KEYS = ("model.name", "model.name_or_path", "model.hidden_size", "model.num_layers",
               "model.num_heads", "model.lora.enabled", "model.lora.r", "model.lora.alpha",
               "model.lora.target_modules", "algo.critic", "hardware.backend")
_DEEPSPEED_KEYS = ("hardware.zero_stage", "hardware.num_processes")   # ZeRO partitions


def _shape_keys(cfg) -> dict:
    """The shape keys ``cfg`` sets (a key missing from an older run's config is left out)."""
    keys = _SHAPE_KEYS + (_DEEPSPEED_KEYS if OmegaConf.select(cfg, "hardware.backend") == "deepspeed" else ())
    missing = object()
    found = {k: OmegaConf.select(cfg, k, default=missing) for k in keys}
    return {k: (OmegaConf.to_container(v) if OmegaConf.is_config(v) else v)
            for k, v in found.items() if v is not missing}


def _summary_steps(run_dir: Path) -> Optional[int]:
    """The steps ``summary.json`` reports (written when a run, or a resume, ended); None without one."""
    try:
        return int(json.loads((run_dir / "summary.json").read_text())["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _check_resumable(run_dir: Path, cfg: DictConfig, overrides: List[str], world: int) -> None:
    """Refuse (one line) a resume that has nothing to do or cannot load the checkpoint."""

    last = checkpoint.latest_checkpoint(run_dir)
    if last is None:
        raise UserError(f"cannot resume '{run_dir}': it has no complete checkpoint "
                        "(trainer.checkpoint_every writes them)")
    step = checkpoint.read_state(last)["step"]
    saved = len(list(last.glob("rng-rank*.pt")))       # one per rank that wrote it
    if saved and saved != world:
        raise UserError(f"cannot resume '{run_dir}' with {world} rank(s): its checkpoint {last.name} "
                        f"was written by {saved}; resume with the same number of ranks")
    q = shlex.quote(str(run_dir))
    if cfg.trainer.steps <= step:
        done = "finished" if _summary_steps(run_dir) == step else "trained"
        raise UserError(f"run '{run_dir}' is already {done} at step {step} (trainer.steps="
                        f"{cfg.trainer.steps}); nothing to resume. To extend it, raise trainer.steps: "
                        f"rlctl train --resume {q} trainer.steps={max(2 * step, step + 1)}")
    try:
        before = _shape_keys(OmegaConf.load(run_dir / "config.yaml"))
    except Exception:  # noqa: BLE001 - an unreadable config.yaml: the recipe still rules
        return
    after = _shape_keys(cfg)
    changed = [f"{k}: {before[k]} -> {after.get(k)}" for k in sorted(before)   # keys both know
               if k in after and before[k] != after[k]]
    if changed:
        raise UserError(f"cannot resume '{run_dir}' with {' '.join(overrides)}: the override changes "
                        f"the model's shape or the checkpoint's layout ({'; '.join(changed[:3])}), so it "
                        f"cannot apply to a resume; start a new run from the recipe instead: rlctl train "
                        f"--recipe {shlex.quote(str(run_dir / 'recipe.yaml'))} {' '.join(overrides)}")
