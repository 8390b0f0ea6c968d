"""A run's rollout, set up from the composed config: ``build_source``, the source the
learner samples from, and ``engine_main``, the entry point of each local engine process.

The functions here that take the whole config need all of it: the local engines are
built from the learner's resolved config, sent to each as YAML text, exactly as the
learner was built (rlctl/run/build.py). Below them, rlctl/rollout/ takes settings:
``SamplingSettings``, ``EngineSettings``, ``EpisodeSettings``.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import OmegaConf

from rlctl.backends.base import Backend
from rlctl.backends.launch import die_with_parent
from rlctl.envs.base import is_episodic
from rlctl.errors import ConfigError, UserError, user_message
from rlctl.learner.forward import prompt_sharing
from rlctl.models.loading import quiet_libraries
from rlctl.rollout.engine import TorchEngine
from rlctl.rollout.engine_source import EngineSettings, EngineSource
from rlctl.rollout.episode_source import EpisodeSource
from rlctl.rollout.episodes import EpisodeSettings
from rlctl.rollout.local_engine import LocalEngine, serve_engine
from rlctl.rollout.server_engine import ServerEngine
from rlctl.rollout.server_kinds import configured_kind
from rlctl.rollout.source import LocalSource, SamplingSettings
from rlctl.run.build import model_from_config, prepare_task
from rlctl.run.local_servers import LocalProcesses, LocalServers, ServeSpec
from rlctl.schema import ServerConfig


def build_source(cfg, policy, tokenizer, prepared, backend=None, stop=None):
    """The rollout source ``cfg`` asks for, on ``prepared``'s training prompts and scorer
    (``rlctl.run.build.prepare_task``): ``LocalSource`` sampling with ``policy`` (the
    module the backend will train), or an ``EngineSource`` on ``num_actors`` local engine
    processes with ``trainer.async_rollout.enabled``, or on servers with
    ``rollout.engine=server``; for a task played as episodes (``rlctl.envs.base.is_episodic``)
    ``EpisodeSource`` in place of ``LocalSource`` (the local engines then play episodes
    too). ``backend`` None: one process on ``hardware.device``; ``stop``: the run's
    StopFlag (a signal ends a wait for engines starting). Takes the whole config: the local
    engines are built from it, as the learner was."""
    rank, world = (backend.rank, backend.world_size) if backend is not None else (0, 1)
    device = backend.device if backend is not None else Backend(cfg.hardware.device).device
    if is_episodic(prepared.task):
        check_episodic(backend)        # the config's side: rlctl.run.checks.check_episodes
        local = EpisodeSource(policy, tokenizer, prepared, EpisodeSettings.from_config(cfg),
                              seed=cfg.seed * 1000 + rank)
    elif cfg.rollout.engine == "server":
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
    engines = LocalProcesses(engine_main, OmegaConf.to_yaml(cfg, resolve=True),
                             int(cfg.trainer.async_rollout.num_actors), stop, "rollout engine process", first=1)
    try:
        clients = [LocalEngine(p, c, f"rollout engine process {i + 1}")
                   for i, (p, c) in enumerate(zip(engines.procs, engines.conns))]
        player = getattr(local, "player", None)

        def close():
            for engine in clients:
                engine.stop(sys.exc_info()[0] is not None)
            engines.close(30.0)
        return EngineSource(clients, policy, tokenizer, local.examples, local.scorer,
                            SamplingSettings.from_config(cfg, prompt_sharing(cfg.trainer.share_prompts, backend)),
                            EngineSettings.from_config(cfg), seed=cfg.seed * 1000 + rank, device=device,
                            on_close=close, learner_rng=True, player=player)
    except BaseException:
        engines.close()
        raise


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


def engine_main(cfg_yaml: str, conn, index: int) -> None:
    """One local engine process: the learner's model (its base, without LoRA or a value
    head: the learner pushes its weights before the first request) in a ``TorchEngine``,
    and for an episodic task the task's player; says ("ready", None), then serves
    (``serve_engine``) until the learner says stop."""
    os.setpgrp()   # a terminal's Ctrl-C or `timeout` signals the learner, which stops at a step
    die_with_parent(mp.parent_process().pid)   # SIGTERM when the process that started it dies
    cfg = OmegaConf.create(cfg_yaml)
    try:
        quiet_libraries(cfg.hardware.device, cfg.hardware.num_threads)
        base = OmegaConf.merge(cfg, {"model": {"lora": {"enabled": False}}, "algo": {"critic": "none"}})
        model, _, tok, _ = model_from_config(base)
        prepared = prepare_task(cfg, tok, model, quiet=True)   # the learner's prompts
        model.eval()
        player, examples = None, ()
        if is_episodic(prepared.task):      # the learner draws the rows and the environments' seed
            local = EpisodeSource(model, tok, prepared, EpisodeSettings.from_config(cfg), seed=0)
            player, examples = local.player, local.examples
        engine = TorchEngine(model, tok.pad_token_id, share_prompts=bool(cfg.trainer.share_prompts),
                             sample_dtype=cfg.rollout.sample_dtype)
    except Exception as exc:  # noqa: BLE001 - one line for the learner
        conn.send(("error", user_message(exc)[0]))
        return
    torch.manual_seed(cfg.seed * 1000 + 7919 * (index + 1))      # each engine its own stream
    # The learner is the bottleneck: when the cores are oversubscribed it keeps its core.
    os.nice(5)
    conn.send(("ready", None))
    serve_engine(engine, conn, player, examples)
