"""An engine behind an OpenAI-compatible completions server (FastAPI; ``rlctl serve``;
docs/engines.md has the routes and fields). Bad input is a 400 (409: a weights version older
than the served one) with OpenAI's error body; requests are served one at a time.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Dict, List, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.concurrency import run_in_threadpool

from rlctl.errors import UserError
from rlctl.rollout.engines.protocol import Sampling, TorchEngine
from rlctl.rollout.engines.protocol import from_bytes, read_dir

_FIELDS = {"prompt", "model", "max_tokens", "temperature", "top_k", "top_p", "n", "seed",
           "stop_token_ids", "logprobs", "ignore_eos", "return_token_ids", "stream", "echo"}


class StaleVersion(UserError):
    """A weights push older than the served weights."""


def build_app(engine: TorchEngine, model_name: str, default_stops=(), tokenizer=None) -> FastAPI:
    """``default_stops``: added to a request's ``stop_token_ids`` unless it sets ``ignore_eos``
    (as vLLM stops at EOS). ``tokenizer``: fills each choice's ``text``."""
    app = FastAPI(title="rlctl serve", docs_url=None, redoc_url=None)

    @app.exception_handler(UserError)
    async def _bad_input(request: Request, exc: UserError):
        code = 409 if isinstance(exc, StaleVersion) else 400
        return JSONResponse(status_code=code, content={"error": {
            "message": str(exc), "type": "BadRequestError", "code": code}})

    @app.get("/health")
    def health() -> Dict[str, Any]:
        return engine.health()

    @app.get("/version")
    def version() -> Dict[str, Any]:
        return {"weights_version": engine.version}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Dict[str, Any]:
        body = await _json(request)
        prompts, sampling, n, seed, want_logprobs = parse_completion(body, tuple(default_stops))
        rows = [p for p in prompts for _ in range(n)]
        outs = await run_in_threadpool(engine.generate, rows, sampling, seed)
        return completion_response(outs, model_name, want_logprobs, prompts, tokenizer)

    @app.post("/update_weights")
    async def update_weights(request: Request, version: Optional[str] = None) -> Dict[str, Any]:
        v = _version(version)
        tensors, kind = from_bytes(await request.body())
        await run_in_threadpool(_update, engine, v, tensors, kind)
        return {"success": True, "weights_version": engine.version}

    @app.post("/update_weights_from_disk")
    async def update_from_disk(request: Request) -> Dict[str, Any]:
        body = await _json(request)
        if not isinstance(body.get("path"), str):
            raise UserError('update_weights_from_disk takes {"path": DIR_OR_FILE, "version": V}')
        v = _version(body.get("version"))
        tensors, kind = read_dir(body["path"])
        await run_in_threadpool(_update, engine, v, tensors, kind)
        return {"success": True, "weights_version": engine.version}

    return app


def _update(engine: TorchEngine, version: int, tensors, kind: str) -> None:
    if version < engine.version:
        raise StaleVersion(f"weights version {version} is older than the served version "
                           f"{engine.version}")
    engine.update_weights(version, tensors, kind)


async def _json(request: Request) -> Dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        raise UserError("the request body is not JSON") from None
    if not isinstance(body, dict):
        raise UserError("the request body must be a JSON object")
    return body


def _version(value) -> int:
    try:
        v = int(value)
    except (TypeError, ValueError):
        raise UserError(f"version must be an integer >= 0, got {value!r}") from None
    if v < 0:
        raise UserError(f"version must be an integer >= 0, got {v}")
    return v


def parse_completion(body: Dict[str, Any], default_stops):
    """A /v1/completions body -> (prompts [[int]], Sampling, n, seed, logprobs wanted)."""
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise UserError(f"unknown field '{unknown[0]}'; fields: {', '.join(sorted(_FIELDS))}")
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], str)):
        raise UserError("prompt must be token ids (a list of ints or a list of lists): "
                        "rlctl serve does not tokenize text")
    prompts = [prompt] if isinstance(prompt, list) and prompt and isinstance(prompt[0], int) \
        else prompt
    if body.get("stream"):
        raise UserError("stream=true is not served; omit it")
    if body.get("echo"):
        raise UserError("echo=true is not served; omit it")
    if body.get("top_p", 1.0) != 1.0:
        raise UserError("top_p must be 1.0: the engine samples from the full softmax "
                        "(optionally top_k)")
    logprobs = body.get("logprobs")
    if logprobs not in (None, 0, 1) or isinstance(logprobs, bool):
        raise UserError(f"logprobs must be 0 or 1 (the sampled tokens' log-probs; no top "
                        f"alternatives are computed), got {logprobs!r}")
    n, seed = body.get("n", 1), body.get("seed")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise UserError(f"n must be an integer >= 1, got {n!r}")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise UserError(f"seed must be an integer, got {seed!r}")
    stops = body.get("stop_token_ids") or []
    if not isinstance(stops, list) or not all(isinstance(s, int) and not isinstance(s, bool)
                                              for s in stops):
        raise UserError(f"stop_token_ids must be a list of token ids, got {stops!r}")
    top_k = body.get("top_k", 0)
    top_k = 0 if top_k == -1 else top_k            # vLLM's and SGLang's "off"
    temperature = body.get("temperature", 1.0)
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool):
        raise UserError(f"temperature must be a number >= 0, got {temperature!r}")
    all_stops = tuple(dict.fromkeys(list(stops) + ([] if body.get("ignore_eos") else list(default_stops))))
    sampling = Sampling(body.get("max_tokens", 16), float(temperature), top_k, all_stops)
    return prompts, sampling, n, seed, logprobs is not None


def completion_response(outs, model_name: str, want_logprobs: bool, prompts,
                        tokenizer=None) -> Dict[str, Any]:
    """The OpenAI completion object with vLLM's token-id fields."""
    choices: List[Dict[str, Any]] = []
    for i, c in enumerate(outs):
        choice = {"index": i, "text": tokenizer.decode(c.token_ids) if tokenizer is not None else "",
                  "token_ids": c.token_ids, "finish_reason": c.finish_reason,
                  "stop_reason": c.token_ids[-1] if c.finish_reason == "stop" else None,
                  "logprobs": None}
        if want_logprobs:
            choice["logprobs"] = {"tokens": [f"token_id:{t}" for t in c.token_ids],
                                  "token_logprobs": c.logprobs, "top_logprobs": None,
                                  "text_offset": []}
        choices.append(choice)
    n_prompt = sum(len(p) for p in prompts) * (len(outs) // max(len(prompts), 1))
    n_out = sum(len(c.token_ids) for c in outs)
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": model_name, "choices": choices,
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out,
                      "total_tokens": n_prompt + n_out},
            "weights_version": outs[0].weights_version if outs else 0}
