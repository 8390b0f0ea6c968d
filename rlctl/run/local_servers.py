"""Engine processes a run starts for itself: ``LocalProcesses`` starts children and waits
for each to say it is ready. ``LocalServers``: `rlctl serve` processes
(``rollout.engine=server`` with no ``rollout.server.urls``), ``rollout.server.num_local``
servers on 127.0.0.1, each the torch engine behind the completions app
(rlctl/rollout/serve_app.py), on a port the system picks and the child reports back.
The local engine processes of ``trainer.async_rollout`` (rlctl/run/rollout_setup.py) are
started with ``LocalProcesses`` too and keep their pipe.

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
from rlctl.models.loading import load_model_and_tokenizer, quiet_libraries
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


class LocalProcesses:
    """``n`` children ``target(arg, conn, i)`` (spawned; ``conn`` their end of a duplex
    pipe), each of which first sends ("ready", value) or ("error", one line); ``values``
    once all are ready (a ``stop`` flag raised meanwhile ends the wait); ``close()``
    stops them. ``what``: how an error names the i-th child ("rollout server 0"), counted
    from ``first``."""

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
    """``n`` servers of ``spec``; ``urls`` once started; ``close()`` stops them."""

    def __init__(self, spec: ServeSpec, n: int, stop=None):
        super().__init__(serve_child, spec, n, stop)
        self.urls = [f"http://127.0.0.1:{port}" for port in self.values]

    def close(self, wait_s: float = 0.0) -> None:
        super().close(wait_s)


def serve_child(spec: ServeSpec, conn, index: int = 0) -> None:
    """One server: build the model and app, bind 127.0.0.1:0, send ("ready", port) (or
    ("error", one line)), then serve until terminated."""
    os.setpgrp()
    die_with_parent(mp.parent_process().pid)
    try:
        app, sock = _build(spec)
    except Exception as exc:  # noqa: BLE001 - one line for the learner
        conn.send(("error", user_message(exc)[0]))
        return
    conn.send(("ready", sock.getsockname()[1]))
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

