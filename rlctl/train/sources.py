"""A run's rollout source from the composed config (``build_source``) and the processes it
starts: local engine processes (``engine_main``) and `rlctl serve` servers (``LocalServers``)."""
from __future__ import annotations

import functools
import importlib
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import OmegaConf

from rlctl.dist import TorchBackend
from rlctl.dist.launch import die_with_parent
from rlctl.envs.environment import is_episodic
from rlctl.errors import ConfigError, UserError, user_message
from rlctl.models.forward import prompt_sharing
from rlctl.models.loading import load_model_and_tokenizer, quiet_libraries
from rlctl.models.stop_ids import resolve_stop_ids
from rlctl.rollout.source import LocalSource
from rlctl.train.build import model_from_config, prepare_task
from rlctl.config.schema import AsyncConfig, HardwareConfig, RolloutConfig

START_S = 600.0          # a child that has not reported its port by then failed


def _episodes():
    return importlib.import_module("rlctl.rollout.episodes.loop")


def _engine_source():
    return importlib.import_module("rlctl.rollout.engines.engine_source")


def build_source(cfg, policy, tokenizer, prepared, backend=None, stop=None):
    """The rollout source on ``prepared``'s prompts and scorer: ``LocalSource`` (or
    ``EpisodeSource``) sampling with ``policy``, or an ``EngineSource`` on local engine
    processes or on servers. ``backend`` None: one process on ``hardware.device``;
    ``stop``: a signal ends a wait for engines starting."""
    rank, world = (backend.rank, backend.world_size) if backend is not None else (0, 1)
    device = backend.device if backend is not None else torch.device(cfg.hardware.device)
    if is_episodic(prepared.task):
        if backend is not None and backend.generate_kwargs():    # ranks generating in step
            raise ConfigError(f"a task played as episodes cannot run on {backend.world_size} ranks "
                              "with hardware.zero_stage=3 (its ranks must generate in step, and each "
                              "rank's episodes take their own number of turns); use "
                              "hardware.zero_stage=2 or lower, or hardware.num_processes=1")
        episodes = _episodes()
        local = episodes.EpisodeSource(policy, tokenizer, prepared, cfg.rollout,
                                       int(cfg.algo.group_size), seed=cfg.seed * 1000 + rank)
    elif cfg.rollout.engine == "server":
        return server_source(cfg.rollout, int(cfg.algo.group_size), cfg.trainer.async_rollout,
                             OmegaConf.to_yaml(cfg, resolve=True), policy, tokenizer, prepared, device,
                             cfg.seed * 1000, weight_buckets(cfg.hardware, backend), stop)
    else:
        local = LocalSource(policy, tokenizer, list(prepared.train), prepared.scorer(),
                            cfg.rollout, cfg.algo,
                            prompt_sharing(cfg.trainer.share_prompts, backend),
                            seed=cfg.seed * 1000 + rank,
                            generate_kwargs=backend.generate_kwargs() if backend is not None else None)
    if not cfg.trainer.async_rollout.enabled:
        return local
    if world > 1 or dist.is_initialized():
        raise UserError("trainer.async_rollout.enabled=true needs one learner process in no process "
                        "group of its own: hardware.num_processes=1 and hardware.backend=torch")
    engine_source = _engine_source()
    engines = LocalProcesses(engine_main, OmegaConf.to_yaml(cfg, resolve=True),
                             int(cfg.trainer.async_rollout.num_actors), stop, "rollout engine process", first=1)
    try:
        clients = [engine_source.LocalEngine(p, c, f"rollout engine process {i + 1}")
                   for i, (p, c) in enumerate(zip(engines.procs, engines.conns))]
        player = local.player

        def close():
            for engine in clients:
                engine.stop(sys.exc_info()[0] is not None)
            engines.close(30.0)
        return engine_source.EngineSource(
            clients, policy, tokenizer, local.examples, local.scorer, cfg.rollout,
            int(cfg.algo.group_size), cfg.trainer.async_rollout, seed=cfg.seed * 1000 + rank,
            gather=weight_buckets(cfg.hardware, backend), device=device, on_close=close,
            learner_rng=True, player=player)
    except BaseException:
        engines.close()
        raise


def weight_buckets(hw: HardwareConfig, backend=None):
    """(module, names=) -> the weights the engines are pushed, in buckets of ``hw.gather_bucket_mb``
    (``TorchBackend.weight_buckets``; ``backend`` None: one plain torch process)."""
    backend = backend if backend is not None else TorchBackend(str(hw.device))
    return functools.partial(backend.weight_buckets, bucket_mb=hw.gather_bucket_mb,
                             timeout_s=hw.dist_timeout_s)


def server_source(rollout: RolloutConfig, group_size: int, ahead: AsyncConfig, cfg_yaml: str,
                  policy, tokenizer, prepared, device, seed: int, gather, stop=None):
    """``rollout.engine=server``: an ``EngineSource`` on ``rollout.server.urls``, or on
    ``rollout.server.num_local`` `rlctl serve` processes started here (``cfg_yaml``: their config);
    ``gather``: ``weight_buckets``'s."""
    servers = rollout.server
    local = None if servers.urls else LocalServers(cfg_yaml, servers.num_local, stop)
    server_engine = importlib.import_module("rlctl.rollout.engines.server")
    engine_source = _engine_source()
    try:
        engine = server_engine.ServerEngine(
            list(servers.urls) or local.urls,
            max_staleness=engine_source.staleness_bounds(ahead)[0],
            chunk_size=servers.chunk_size, timeout_s=servers.timeout_s,
            kind=server_engine.configured_kind(servers.kind, servers.weight_dir, servers.model_dir))
        return engine_source.EngineSource(engine, policy, tokenizer, list(prepared.train),
                                          prepared.scorer(), rollout, group_size, ahead,
                                          seed=seed, gather=gather, device=device,
                                          on_close=local.close if local is not None else None)
    except BaseException:
        if local is not None:
            local.close()
        raise


def engine_main(cfg_yaml: str, conn, index: int) -> None:
    """One local engine process: the learner's base model (no LoRA, no value head) in a
    ``TorchEngine`` (and an episodic task's player); says ("ready", None), then serves."""
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
            episodes = _episodes()
            local = episodes.EpisodeSource(model, tok, prepared, cfg.rollout,
                                           int(cfg.algo.group_size), seed=0)
            player, examples = local.player, local.examples
        engine_source = _engine_source()
        engine = engine_source.TorchEngine(model, tok.pad_token_id,
                                           share_prompts=bool(cfg.trainer.share_prompts),
                                           sample_dtype=cfg.rollout.sample_dtype)
    except Exception as exc:  # noqa: BLE001 - one line for the learner
        conn.send(("error", user_message(exc)[0]))
        return
    torch.manual_seed(cfg.seed * 1000 + 7919 * (index + 1))      # each engine its own stream
    # The learner is the bottleneck: when the cores are oversubscribed it keeps its core.
    os.nice(5)
    conn.send(("ready", None))
    engine_source.serve_engine(engine, conn, player, examples)


class LocalProcesses:
    """``n`` spawned children ``target(arg, conn, i)`` that first send ("ready", value) or
    ("error", one line); ``values`` once all are ready (``stop`` ends the wait)."""

    def __init__(self, target, arg, n: int, stop=None, what: str = "rollout server", first: int = 0):
        ctx = mp.get_context("spawn")
        self.procs, self.conns, self.values, self.what = [], [], [], what
        for i in range(n):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=target, args=(arg, theirs, i), daemon=True)
            p.start()
            theirs.close()
            self.procs.append(p)
            self.conns.append(mine)
        try:
            self.values = [self._ready(i, p, c, stop) for i, (p, c) in enumerate(zip(self.procs, self.conns), first)]
        except BaseException:
            self.close()
            raise

    def _ready(self, i: int, proc, conn, stop):
        deadline = time.monotonic() + START_S
        while not conn.poll(0.2):
            if stop is not None and stop.requested:
                raise UserError(f"stopped while the {self.what}s were starting")
            if not proc.is_alive() or time.monotonic() > deadline:
                raise UserError(f"{self.what} {i} did not start (exit code {proc.exitcode})")
        try:
            kind, value = conn.recv()
        except EOFError:
            raise UserError(f"{self.what} {i} exited while starting (exit code {proc.exitcode})") from None
        if kind == "error":
            raise UserError(f"{self.what} {i}: {value}")
        return value

    def close(self, wait_s: float = 10.0) -> None:
        """Wait ``wait_s`` for children asked to stop, then terminate (and kill) the rest."""
        deadline = time.monotonic() + wait_s
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for c in self.conns:
            c.close()


class LocalServers(LocalProcesses):
    """``n`` servers of the run's base model; ``urls`` once started; ``close()`` stops them at once."""

    def __init__(self, cfg_yaml: str, n: int, stop=None):
        super().__init__(serve_child, cfg_yaml, n, stop)
        self.urls = [f"http://127.0.0.1:{port}" for port in self.values]

    def close(self, wait_s: float = 0.0) -> None:
        super().close(wait_s)


def serve_child(cfg_yaml: str, conn, index: int = 0) -> None:
    """One `rlctl serve` of the learner's base model on a free port; sends ("ready", port)."""
    os.setpgrp()
    die_with_parent(mp.parent_process().pid)
    import uvicorn   # heavy, and only a server needs it
    serve_app = importlib.import_module("rlctl.rollout.engines.serve_app")
    cfg = OmegaConf.create(cfg_yaml)
    name, hw = str(cfg.model.name), cfg.hardware
    try:
        quiet_libraries(hw.device, hw.num_threads)
        opts = {k: v for k, v in OmegaConf.to_container(cfg.model).items() if k not in ("name", "lora")}
        model, tok = load_model_and_tokenizer(name, device=str(hw.device), **opts)
        model.eval()
        stops = resolve_stop_ids(model, tok, list(cfg.rollout.get("stop_token_ids", None) or ()))
        engine = _engine_source().TorchEngine(model, tok.pad_token_id)
        app = serve_app.build_app(engine, f"model={name}", default_stops=stops, tokenizer=tok)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
    except Exception as exc:  # noqa: BLE001 - one line for the learner
        conn.send(("error", user_message(exc)[0]))
        return
    conn.send(("ready", sock.getsockname()[1]))
    conn.close()
    server = uvicorn.Server(uvicorn.Config(app, log_level="error", lifespan="off"))
    server.run(sockets=[sock])
