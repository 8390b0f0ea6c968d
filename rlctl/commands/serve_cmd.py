"""`rlctl serve TARGET`: the torch engine behind an OpenAI-compatible server (docs/engines.md)."""
from __future__ import annotations

import socket
from typing import Optional, Sequence

import uvicorn

from rlctl.commands.targets import Target, load_config, load_policy, resolve_target
from rlctl.errors import UserError
from rlctl.models.stop_ids import resolve_stop_ids
from rlctl.rollout.engines.protocol import TorchEngine
from rlctl.rollout.engines.serve_app import build_app


def serving_app(target_arg: Optional[str], overrides: Sequence[str]):
    """(FastAPI app, one-line description) for TARGET + overrides."""
    target = resolve_target(target_arg)
    return _app(target, load_config(target, overrides))


def _app(target: Target, cfg):
    model, tokenizer, what = load_policy(target, cfg)
    stops = resolve_stop_ids(model, tokenizer, cfg.rollout.get("stop_token_ids", None))
    engine = TorchEngine(model, tokenizer.pad_token_id)
    return build_app(engine, model_id(target, cfg), default_stops=stops, tokenizer=tokenizer), what


def model_id(target: Target, cfg) -> str:
    """The served model's id: a run's directory name, a model directory, else the configured model."""
    if target.kind == "run":
        return target.path.resolve().name
    return str(target.path) if target.path is not None else cfg.model.name_or_path or cfg.model.name


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port, not yet listening; a failure is one line naming both."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as uvicorn: not a live port
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise _cannot_listen(host, port, exc) from None
    return sock


def _cannot_listen(host: str, port: int, exc: OSError) -> UserError:
    return UserError(f"cannot listen on {host}:{port}: {exc.strerror or exc} (choose another "
                     "--port, or --port 0 for a free one)")


def run_serve(target_arg: Optional[str], overrides: Sequence[str], host: str, port: int) -> None:
    if not 0 <= port < 65536:
        raise UserError(f"--port must be in [0, 65535], got {port}")
    target = resolve_target(target_arg)
    cfg = load_config(target, overrides)
    with bind(host, port) as sock:
        app, what = _app(target, cfg)
        try:
            sock.listen(2048)
        except OSError as exc:      # another socket bound the same port and listened first
            raise _cannot_listen(host, port, exc) from None
        addr, bound = sock.getsockname()[:2]
        url = f"http://{f'[{addr}]' if ':' in addr else addr}:{bound}"
        print(f"serving {what} as model '{model_id(target, cfg)}' on {url} (OpenAI: GET /v1/models, "
              "POST /v1/completions, POST /v1/chat/completions; GET /health, POST /update_weights)",
              flush=True)
        uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
