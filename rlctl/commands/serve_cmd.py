"""`rlctl serve TARGET`: the torch engine behind an OpenAI-compatible completions server
(rollout/engines/serve_app.py; docs/engines.md) for a TARGET as `rlctl eval` takes it; the model's
stop set is added to each request's stop_token_ids."""
from __future__ import annotations

from typing import Optional, Sequence

import uvicorn

from rlctl.commands.targets import load_config, load_policy, resolve_target
from rlctl.errors import UserError
from rlctl.models.stop_ids import resolve_stop_ids
from rlctl.rollout.engines.protocol import TorchEngine
from rlctl.rollout.engines.serve_app import build_app


def serving_app(target_arg: Optional[str], overrides: Sequence[str]):
    """(FastAPI app, one-line description) for TARGET + overrides."""
    target = resolve_target(target_arg)
    cfg = load_config(target, overrides)
    model, tokenizer, what = load_policy(target, cfg)
    stops = resolve_stop_ids(model, tokenizer, cfg.rollout.get("stop_token_ids", None))
    engine = TorchEngine(model, tokenizer.pad_token_id)
    return build_app(engine, what, default_stops=stops, tokenizer=tokenizer), what


def run_serve(target_arg: Optional[str], overrides: Sequence[str], host: str, port: int) -> None:
    if not 0 <= port < 65536:
        raise UserError(f"--port must be in [0, 65535], got {port}")
    app, what = serving_app(target_arg, overrides)
    print(f"serving {what} on http://{host}:{port} (POST /v1/completions, GET /health, "
          "POST /update_weights)", flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning")
