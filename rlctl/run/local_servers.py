"""`rlctl serve` processes a run starts for itself (``rollout.engine=server`` with no
``rollout.server.urls``): ``rollout.server.num_local`` servers on 127.0.0.1, each the
torch engine behind the completions app (rlctl/rollout/serve_app.py), on a port the
system picks and the child reports back.

Each child builds the configured model as `rlctl serve` with no TARGET does (the
learner's base model: the learner pushes its own weights, or its adapter, before the
first request), puts itself in its own process group (a terminal's Ctrl-C reaches the
learner, which stops at a step and closes the servers) and gets SIGTERM if the learner
dies (PR_SET_PDEATHSIG). ``ServeSpec`` is what a local server loads: it is pickled to
each child.
"""
from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import torch.multiprocessing as mp
import uvicorn
from omegaconf import OmegaConf

from rlctl.backends.launch import die_with_parent
from rlctl.errors import UserError, user_message
from rlctl.models.loading import load_model_and_tokenizer
from rlctl.models.quiet import quiet_libraries
from rlctl.models.stop_ids import resolve_stop_ids
from rlctl.rollout.engine import TorchEngine
from rlctl.rollout.serve_app import build_app

START_S = 600.0          # a child that has not reported its port by then failed


@dataclass(frozen=True)
class ServeSpec:
    """What a local server loads, derived from three sections: the learner's base model
    (``model`` without ``lora``), on ``device`` with ``num_threads``, and the run's extra
    stop ids."""
    model_name: str
    model_opts: Dict = field(default_factory=dict)
    device: str = "cpu"
    num_threads: Optional[int] = None
    stop_token_ids: Tuple = ()

    @classmethod
    def from_config(cls, cfg) -> "ServeSpec":
        opts = {k: v for k, v in OmegaConf.to_container(cfg.model, resolve=True).items()
                if k not in ("name", "lora")}
        return cls(str(cfg.model.name), opts, str(cfg.hardware.device), cfg.hardware.num_threads,
                   tuple(cfg.rollout.get("stop_token_ids", None) or ()))


class LocalServers:
    """``n`` servers of ``spec``; ``urls`` once started; ``close()`` stops them."""

    def __init__(self, spec: ServeSpec, n: int, stop=None):
        ctx = mp.get_context("spawn")
        self.procs, self.urls, pipes = [], [], []
        for _ in range(n):
            mine, theirs = ctx.Pipe(duplex=False)
            p = ctx.Process(target=serve_child, args=(spec, theirs), daemon=True)
            p.start()
            theirs.close()
            self.procs.append(p)
            pipes.append(mine)
        try:
            self.urls = [self._port(i, p, pipe, stop) for i, (p, pipe) in enumerate(zip(self.procs, pipes))]
        except BaseException:
            self.close()
            raise
        finally:
            for pipe in pipes:          # the port is all they say
                pipe.close()

    @staticmethod
    def _port(i: int, proc, pipe, stop) -> str:
        deadline = time.monotonic() + START_S
        while not pipe.poll(0.2):
            if stop is not None and stop.requested:
                raise UserError("stopped while the rollout servers were starting")
            if not proc.is_alive() or time.monotonic() > deadline:
                raise UserError(f"rollout server {i} did not start (exit code {proc.exitcode})")
        try:
            kind, value = pipe.recv()
        except EOFError:
            raise UserError(f"rollout server {i} exited while starting (exit code {proc.exitcode})") from None
        if kind == "error":
            raise UserError(f"rollout server {i}: {value}")
        return f"http://127.0.0.1:{value}"

    def close(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


def serve_child(spec: ServeSpec, conn) -> None:
    """One server: build the model and app, bind 127.0.0.1:0, send ("port", p) (or
    ("error", one line)), then serve until terminated."""
    os.setpgrp()
    die_with_parent(mp.parent_process().pid)
    try:
        app, sock = _build(spec)
    except Exception as exc:  # noqa: BLE001 - one line for the learner
        conn.send(("error", user_message(exc)[0]))
        return
    conn.send(("port", sock.getsockname()[1]))
    conn.close()
    server = uvicorn.Server(uvicorn.Config(app, log_level="error", lifespan="off"))
    server.run(sockets=[sock])


def _build(spec: ServeSpec):
    """(app, listening socket on 127.0.0.1, port chosen by the system)."""
    quiet_libraries(spec.device, spec.num_threads)
    model, tok = load_model_and_tokenizer(spec.model_name, device=spec.device, **spec.model_opts)
    model.eval()
    stops = resolve_stop_ids(model, tok, list(spec.stop_token_ids))
    app = build_app(TorchEngine(model, tok.pad_token_id), f"model={spec.model_name}",
                    default_stops=stops, tokenizer=tok)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    return app, sock

