"""A run's rollout, set up from the composed config: ``build_source``, the source the
learner samples from, and ``actor_main``, the entry point of each rollout actor process.

The two functions here that take the whole config need all of it: the asynchronous
source ships the learner's resolved config, as YAML text, to every actor, and each
actor builds its own model and task from it exactly as the learner did (rlctl/run/build.py). Below them,
rlctl/rollout/ takes settings: ``SamplingSettings``, ``ActorSettings``, ``ActorLayout``.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import OmegaConf

from rlctl.backends.base import Backend
from rlctl.backends.launch import die_with_parent
from rlctl.envs.base import is_episodic
from rlctl.errors import ConfigError, UserError
from rlctl.learner.forward import prompt_sharing
from rlctl.models.quiet import quiet_libraries
from rlctl.rollout.actors import ActorSettings, AsyncSource, serve_learner
from rlctl.rollout.engine_source import EngineSettings, EngineSource
from rlctl.rollout.episode_source import EpisodeSource
from rlctl.rollout.episodes import EpisodeSettings
from rlctl.rollout.layout import ActorLayout
from rlctl.rollout.server_engine import ServerEngine
from rlctl.rollout.server_kinds import configured_kind
from rlctl.rollout.source import LocalSource, SamplingSettings
from rlctl.run.build import model_from_config, prepare_task
from rlctl.schema import ServerConfig
from rlctl.run.local_servers import LocalServers, ServeSpec


def build_source(cfg, policy, tokenizer, prepared, backend=None, stop=None):
    """The rollout source ``cfg`` asks for, on ``prepared``'s training prompts and scorer
    (``rlctl.run.build.prepare_task``): ``LocalSource`` sampling with ``policy`` (the
    module the backend will train), or ``AsyncSource`` with
    ``trainer.async_rollout.enabled``; for a task played as episodes
    (``rlctl.envs.base.is_episodic``) ``EpisodeSource`` in place of ``LocalSource``
    (the actors then play episodes too). ``backend`` None: one process on
    ``hardware.device``; ``stop``: the run's StopFlag (a signal ends a wait for servers starting).
    Takes the whole config: the asynchronous source sends it to its actors, which build from it."""
    rank, world = (backend.rank, backend.world_size) if backend is not None else (0, 1)
    if is_episodic(prepared.task):
        check_episodic(backend)        # the config's side: rlctl.run.checks.check_episodes
        local = EpisodeSource(policy, tokenizer, prepared, EpisodeSettings.from_config(cfg),
                              seed=cfg.seed * 1000 + rank)
    elif cfg.rollout.engine == "server":
        device = backend.device if backend is not None else Backend(cfg.hardware.device).device
        return server_source(cfg.rollout.server, ServeSpec.from_config(cfg),
                             EngineSettings.from_config(cfg), SamplingSettings.from_config(cfg, True),
                             policy, tokenizer, prepared, device, cfg.seed * 1000, stop)
    else:
        settings = SamplingSettings.from_config(cfg, prompt_sharing(cfg.trainer.share_prompts, backend))
        local = LocalSource(policy, tokenizer, list(prepared.train), prepared.scorer(), settings,
                            seed=cfg.seed * 1000 + rank,
                            generate_kwargs=backend.generate_kwargs() if backend is not None else None)
    if not cfg.trainer.async_rollout.enabled:
        return local
    if world > 1 or dist.is_initialized():
        raise UserError("trainer.async_rollout.enabled=true needs one learner process in no process "
                        "group of its own: hardware.num_processes=1 and hardware.backend=torch")
    layout = ActorLayout.from_config(cfg)
    device = backend.device if backend is not None else Backend(cfg.hardware.device).device
    return AsyncSource(ActorSettings.from_config(cfg), layout, local, device, actor_main,
                       OmegaConf.to_yaml(cfg, resolve=True), stop)


def server_source(servers: ServerConfig, spec: ServeSpec, settings: EngineSettings,
                  sampling: SamplingSettings, policy, tokenizer, prepared, device, seed: int,
                  stop=None) -> EngineSource:
    """``rollout.engine=server``: an ``EngineSource`` on the servers at ``servers.urls``,
    or on ``servers.num_local`` `rlctl serve` processes of ``spec`` started here (and
    stopped when the source closes)."""
    local = None if servers.urls else LocalServers(spec, servers.num_local, stop)
    try:
        engine = ServerEngine(list(servers.urls) or local.urls, max_staleness=settings.max_staleness,
                              chunk_size=servers.chunk_size, timeout_s=servers.timeout_s,
                              kind=configured_kind(servers.kind, servers.weight_dir, servers.model_dir))
        return EngineSource(engine, policy, tokenizer, list(prepared.train), prepared.scorer(),
                            sampling, settings, seed=seed, device=device,
                            on_close=local.close if local is not None else None)
    except BaseException:
        if local is not None:
            local.close()
        raise


def check_episodic(backend) -> None:
    """Refuse (one line, exit 2) what episodic tasks do not run with: a backend whose
    ranks must generate in step (multi-rank ZeRO-3: ``synced_gpus``), since each rank
    plays its own episodes, as many turns as they take."""
    if backend is not None and backend.generate_kwargs():
        raise ConfigError(f"a task played as episodes cannot run on {backend.world_size} ranks "
                          "with hardware.zero_stage=3 (its ranks must generate in step, and each "
                          "rank's episodes take their own number of turns); use "
                          "hardware.zero_stage=2 or lower, or hardware.num_processes=1")


def actor_main(cfg_yaml: str, init: str, rank: int, world_size: int) -> None:
    """One actor process (a failure is raised: the learner names the lost actor)."""
    os.setpgrp()   # a terminal's Ctrl-C or `timeout` signals the learner, which stops at a step
    die_with_parent(mp.parent_process().pid)   # SIGTERM when the process that started it dies
    _actor(OmegaConf.create(cfg_yaml), init, rank, world_size)


def _actor(cfg, init: str, rank: int, world_size: int) -> str:
    """Build the actor, then join the group and serve (``serve_learner``); returns what went
    wrong ("" after a normal stop). Takes the whole config: it builds this actor's model and
    task from the learner's, as the learner built its own."""
    quiet_libraries(cfg.hardware.device, cfg.hardware.num_threads)
    model, _, tok, _ = model_from_config(cfg)
    prepared = prepare_task(cfg, tok, model, quiet=True)   # the learner's prompts
    model.eval()
    if is_episodic(prepared.task):      # the learner draws the rows and the environments' seed
        actor = EpisodeSource(model, tok, prepared, EpisodeSettings.from_config(cfg), seed=0)
    else:
        actor = LocalSource(model, tok, list(prepared.train), prepared.scorer(),
                            SamplingSettings.from_config(cfg, bool(cfg.trainer.share_prompts)), seed=0)
    torch.manual_seed(cfg.seed * 1000 + 7919 * rank)      # each actor its own sampling stream
    # The learner is the bottleneck: when the cores are oversubscribed (reward workers,
    # gloo threads) it keeps its core. Measured: 31.1-31.7 vs 28-31 async steps/s.
    os.nice(5)
    return serve_learner(actor, init, rank, world_size, ActorLayout.from_config(cfg))
