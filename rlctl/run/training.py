"""`rlctl train`: compose -> run directory -> train (1 process, or N launched ranks) -> save.

``run_training`` runs in the user's process: it composes and validates the config,
creates the run directory and either trains in-process or launches the ranks.
``train_rank`` is what every rank runs: build task, model (+LoRA, +critic), backend and
sinks, train, and (rank 0) save the model and ``summary.json``. Whether and from where a
run resumes is ``rlctl.run.resume``; what ``summary.json`` holds, ``rlctl.run.report``.
"""
from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path
from typing import List, Optional

import torch
from omegaconf import DictConfig, OmegaConf

from rlctl.backends import tcp_group
from rlctl.backends.base import build_backend
from rlctl.backends.launch import launch, launch_node, leave_with_launcher, node_argv
from rlctl.compose import Composed, compose
from rlctl.errors import ActorFailed, Interrupted, LaunchError, TrainingFault, UserError, user_message
from rlctl.learner.trainer import Trainer
from rlctl.models.loading import check_source, quiet_libraries
from rlctl.models.lora import count_parameters
from rlctl.rollout.sampler import check_training_sampling
from rlctl.run.build import model_from_config, prepare_task, task_from_config
from rlctl.run.checks import check_entries, check_episodes, warn_config
from rlctl.run.report import print_summary, run_summary
from rlctl.run.resume import ResumeSettings, check_resumable, newest, resume_point
from rlctl.run.rollout_setup import build_source
from rlctl.sinks import NullSink, build_sinks
from rlctl.stopping import StopFlag
from rlctl.storage import checkpoint, rundir


def _sink(run_dir: Path, backend, logger, resolved: dict, total_steps: int):
    """Metric sinks on rank 0 (the others log nothing). ``logger``: the logger section
    (jsonl, wandb, wandb_mode, project, console); ``resolved``: the config as a plain dict,
    which wandb records with the run."""

    if not backend.is_main:
        return NullSink()
    return build_sinks(run_dir=run_dir, jsonl=logger.jsonl, wandb=logger.wandb,
                       wandb_mode=logger.wandb_mode, project=logger.project, name=run_dir.name,
                       run_config=resolved, console=logger.console, total_steps=total_steps,
                       tensorboard=logger.tensorboard)


def _save_model(backend, run_dir: Path, policy, critic, tokenizer, lora: bool,
                merged: bool) -> Optional[Path]:
    """The final policy (the adapter for ``lora``, with ``merged`` also the merged model) and
    a separate critic, written by rank 0; the policy's directory (other ranks: None)."""

    model_dir = None
    with backend.gathered(policy):
        if backend.is_main:
            model_dir = rundir.save_model(run_dir, policy, tokenizer, lora=lora, merged=merged)
    if critic is not None:
        with backend.gathered(critic):
            if backend.is_main:
                critic.save_pretrained(run_dir / "critic")
    return model_dir


def _local_device(device: str) -> str:
    """With several ranks on GPUs, each uses cuda:LOCAL_RANK (its launcher's local index)."""
    if device != "cuda" or int(os.environ.get("WORLD_SIZE", 1)) == 1:
        return device
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    return f"cuda:{local}"


def train_rank(cfg: DictConfig, run_dir: Path, resume: bool = False, stop=None,
               on_step=None, built=None) -> Optional[dict]:
    """Train on this rank; rank 0 saves and returns the summary (other ranks: None).
    ``stop``: the StopFlag the loop checks; ``on_step(step, metrics)`` after each step;
    ``built``: the task this process already built from ``cfg`` (``task_from_config``).
    Takes the whole config: every rank's entry point, it builds the task, model, backend,
    rollout source, sinks and trainer from it (and wandb records it)."""
    quiet_libraries(cfg.hardware.device, cfg.hardware.num_threads)
    t0 = time.perf_counter()
    device = _local_device(cfg.hardware.device)
    if device != cfg.hardware.device:             # the builders below read it from the config
        cfg = copy.deepcopy(cfg)
        cfg.hardware.device = device
    hw = cfg.hardware
    backend = build_backend(hw.backend, hw.device, hw.zero_stage, hw.precision, hw.deepspeed_config)
    try:
        built = built or task_from_config(cfg)
        model, critic, tokenizer, ref_model = model_from_config(cfg)
        prepared = prepare_task(cfg, tokenizer, model, built)   # chat template; prompts within the context
        trainable, total = count_parameters(model, critic)
        torch.manual_seed(cfg.seed * 1000 + backend.rank)   # each rank samples differently
        resume_from = resume_point(run_dir, backend) if resume else None
        sink = _sink(run_dir, backend, cfg.logger, OmegaConf.to_container(cfg), cfg.trainer.steps)
        try:
            source = build_source(cfg, model, tokenizer, prepared, backend, stop)
            try:
                trainer = Trainer.from_config(cfg, model, tokenizer, prepared, sink, source=source,
                                              critic=critic, ref_model=ref_model, backend=backend)
            except BaseException:
                source.close()                   # async: the engines end now, not at Python's exit
                raise
            try:
                result = trainer.train(run_dir=run_dir, resume_from=resume_from, on_step=on_step,
                                       stop=stop)
            finally:
                trainer.close()                  # async mode: stop the engine processes
            sink.summary({f"final/{k}": v for k, v in result.eval_end.items()})
        finally:
            sink.close()
        lora, seconds = bool(cfg.model.lora.enabled), time.perf_counter() - t0
        model_dir = (_save_model(backend, run_dir, trainer.policy, critic, tokenizer, lora,
                                 lora and cfg.model.lora.save_merged) if cfg.run.save_model else None)
        summary = run_summary(run_dir, result, backend, seconds, lora, (trainable, total), model_dir,
                              (trainer.scorer, trainer.eval_scorer))
        if backend.is_main:
            rundir.write_json_atomic(run_dir / "summary.json", summary)
            return summary
        return None
    finally:
        backend.close()


def run_training(overrides: List[str], recipe: Optional[str] = None,
                 resume: Optional[str] = None, composed: Optional[Composed] = None) -> dict:
    """Train a new run, or (``resume`` = a run directory) continue one from its newest
    checkpoint with the run's own recipe (``overrides`` may raise trainer.steps to extend).
    ``composed``: ``compose(overrides, recipe)`` when the caller already composed it (the
    CLI does, to refuse a bad override before torch is imported).

    Everything that can be checked is checked before anything is written: a refused
    resume leaves the run untouched, and a new run that fails during set-up (before its
    first step) leaves no directory behind. The run directory is locked for the whole
    run; SIGINT/SIGTERM stop every rank after the same step with a checkpoint saved."""

    if resume is not None:
        run_dir = Path(resume)
        if not (run_dir / "recipe.yaml").is_file():
            raise UserError(f"cannot resume '{resume}': not a run directory (no recipe.yaml)")
        recipe = str(run_dir / "recipe.yaml")
    if composed is None:
        composed = compose(overrides, recipe)
    cfg = composed.cfg
    OmegaConf.resolve(cfg)
    check_entries(cfg.algo, cfg.task.name, cfg.hardware.backend)  # registry names, user entries
    built = task_from_config(cfg)               # bad task options fail before anything is written
    try:
        check_source(cfg.model.name, cfg.model.name_or_path)
    except ValueError as exc:
        raise UserError(f"cannot load model: {exc}") from None
    check_training_sampling(cfg.rollout.top_k)   # refused before a run directory exists
    warn_config(cfg.algo)                  # one line, e.g. a KL estimator biased where it is placed
    check_episodes(cfg.rollout, built.task)
    group = tcp_group.from_environment(cfg.hardware.master_port)
    stop = StopFlag()
    with stop.installed():
        if group is not None and group.world_size > 1:
            summary = _train_in_group(group, cfg, composed, resume, overrides, stop, built)
        elif cfg.hardware.nnodes > 1:
            code = launch_node(node_argv(overrides, recipe, resume), cfg.hardware, stop)
            if code:
                raise SystemExit(code)        # the failed rank printed its own line
            return {}
        else:
            summary = _train_alone(cfg, composed, resume, overrides, stop, built)
    if summary is None:                       # not rank 0: it prints the summary
        return {}
    print_summary(summary)
    return summary


def _train_alone(cfg: DictConfig, composed, resume: Optional[str], overrides: List[str], stop,
                 built) -> dict:
    """This process owns the run: train here or launch hardware.num_processes local ranks.
    Takes the whole config: it makes the run directory from run.* and hands the config on
    to the rank(s) it trains."""

    if resume is None:
        run_dir, kept = rundir.new_run_dir(cfg.run)
    else:
        run_dir, kept = Path(resume), None
    with rundir.RunLock(run_dir):
        try:
            if resume is None:
                return _train_new(cfg, composed, run_dir, kept, stop, built)
            check_resumable(run_dir, ResumeSettings.from_config(cfg), overrides, cfg.hardware.num_processes)
            rundir.record_resume(run_dir, composed)
            return _train_here_or_launched(cfg, run_dir, True, stop, [0], built)
        except ActorFailed as exc:            # a rollout actor was lost
            raise ActorFailed(f"{exc}; {newest(run_dir)}") from None


def _train_in_group(group, cfg: DictConfig, composed, resume: Optional[str], overrides: List[str],
                    stop, built) -> Optional[dict]:
    """One rank of a job an external launcher (or rlctl's on several nodes) started: join
    the TCP group; rank 0 makes (or checks) the run directory, holds its lock, writes the
    config and shares the path; every rank trains. Rank 0 returns the summary. Takes the
    whole config: the ranks check they agree on it when they join, and each trains from it."""

    _check_group(group, cfg.hardware.num_processes, cfg.hardware.nnodes, cfg.trainer.prompts_per_step)
    leave_with_launcher()
    tcp_group.join(group, cfg.hardware.device, cfg.hardware.dist_timeout_s, OmegaConf.to_container(cfg), stop)
    if group.rank != 0:
        run_dir = Path(tcp_group.share(group, None))
        return _lost_rank_is_one_line(group, run_dir, lambda: train_rank(cfg, run_dir, resume=resume is not None,
                                                                         stop=stop, built=built))
    try:
        run_dir, kept = (Path(resume), None) if resume is not None else rundir.new_run_dir(cfg.run)
        lock = rundir.RunLock(run_dir).acquire()
    except Exception as exc:
        tcp_group.share(group, None, error=user_message(exc)[0])
        raise
    with lock:
        try:
            if resume is not None:
                check_resumable(run_dir, ResumeSettings.from_config(cfg), overrides, group.world_size)
                rundir.record_resume(run_dir, composed)
        except Exception as exc:
            tcp_group.share(group, None, error=user_message(exc)[0])
            raise
        tcp_group.share(group, str(run_dir))
        if resume is not None:
            return _lost_rank_is_one_line(group, run_dir, lambda: _train_here_or_launched(
                cfg, run_dir, True, stop, [0], built, here=True))
        return _lost_rank_is_one_line(group, run_dir, lambda: _train_new(cfg, composed, run_dir, kept,
                                                                         stop, built, here=True))


def _check_group(group, num_processes: int, nnodes: int, prompts_per_step: int) -> None:
    """The launcher decides the ranks: rlctl's own rank counts (hardware.num_processes,
    hardware.nnodes) must not contradict it, and its world size must divide the prompts."""
    if group.source != "rlctl" and (num_processes != 1 or nnodes != 1):
        raise UserError(f"hardware.num_processes={num_processes} / hardware.nnodes={nnodes} "
                        f"with {group.source} already starting {group.world_size} ranks: leave both "
                        "at 1 (the launcher's WORLD_SIZE is the number of ranks)")
    if prompts_per_step % group.world_size:
        raise UserError(f"the launcher's world size {group.world_size} ({group.source}) must divide "
                        f"trainer.prompts_per_step={prompts_per_step} (each rank samples "
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
                          f"({' '.join(str(exc).split())[:160]}); {newest(run_dir)}") from None


def _train_new(cfg: DictConfig, composed, run_dir: Path, kept, stop, built, here: bool = False) -> dict:
    """Write the config and train; a failure before step 1 removes what rlctl wrote
    (``kept``: see rundir.new_run_dir). Takes the whole config only to hand it on to the
    rank(s) it trains."""

    done = [0]                                   # steps finished (this process or rank 0)
    try:
        rundir.write_config(run_dir, composed)
        return _train_here_or_launched(cfg, run_dir, False, stop, done, built, here)
    except BaseException as exc:
        if not done[0] and getattr(exc, "before_training", True):   # launched: set by LaunchError
            rundir.discard_new(run_dir, kept)
        raise


def _train_here_or_launched(cfg: DictConfig, run_dir: Path, resume: bool, stop, done: list, built,
                            here: bool = False) -> dict:
    """Train in this process, or launch hardware.num_processes ranks and wait for them.
    ``done[0]`` counts the steps this process saw finish (launched: 1 once any did). Takes
    the whole config: it hands it to ``train_rank`` here (launched ranks read config.yaml)."""

    def on_step(step, values):
        done[0] += 1
    try:
        if here or cfg.hardware.num_processes == 1:
            return train_rank(cfg, run_dir, resume=resume, stop=stop, on_step=on_step, built=built)
        rundir.share_lock(run_dir)               # every rank holds it too
        signum = launch(cfg.hardware.num_processes, run_dir, cfg.hardware.num_threads,
                        resume=resume, stop=stop)
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
