"""An engine behind an OpenAI-compatible server (FastAPI; ``rlctl serve``; docs/engines.md)."""
from __future__ import annotations

import time
import uuid
from http import HTTPStatus
from typing import Any, Dict, List, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from rlctl.errors import UserError
from rlctl.rollout.engines.protocol import Sampling, TorchEngine
from rlctl.rollout.engines.protocol import from_bytes, read_dir
from rlctl.tasks.task import render_chat

_COMMON = {"model", "max_tokens", "temperature", "top_k", "top_p", "n", "seed", "stop_token_ids",
           "ignore_eos", "return_token_ids", "stream", "user"}
_FIELDS = _COMMON | {"prompt", "logprobs", "echo"}
_CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}


class StaleVersion(UserError):
    """A weights push older than the served weights."""


def _error(code: int, message: str) -> JSONResponse:
    kind = HTTPStatus(code).phrase.replace(" ", "").replace("-", "") + "Error"
    return JSONResponse(status_code=code, content={"error": {
        "message": message, "type": kind, "code": code}})


def build_app(engine: TorchEngine, model_name: str, default_stops=(), tokenizer=None) -> FastAPI:
    """``model_name``: the one model id served; ``default_stops``: added to a request's
    ``stop_token_ids`` unless it sets ``ignore_eos``; ``tokenizer``: encodes prompts, decodes text."""
    app = FastAPI(title="rlctl serve", docs_url=None, redoc_url=None)
    stops = tuple(default_stops)

    @app.exception_handler(UserError)
    async def _bad_input(request: Request, exc: UserError):
        return _error(409 if isinstance(exc, StaleVersion) else 400, str(exc))

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException):
        return _error(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}")

    @app.get("/health")
    def health() -> Dict[str, Any]:
        return engine.health()

    @app.get("/version")
    def version() -> Dict[str, Any]:
        return {"weights_version": engine.version}

    @app.get("/v1/models")
    def models() -> Dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "rlctl"}]}

    async def answer(request: Request, parse, chat: bool) -> Dict[str, Any]:
        prompts, sampling, n, seed, logprobs = parse(await _json(request), stops, tokenizer)
        rows = [p for p in prompts for _ in range(n)]
        outs = await run_in_threadpool(engine.generate, rows, sampling, seed)
        return completion_response(outs, model_name, logprobs, prompts, tokenizer, chat)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Dict[str, Any]:
        return await answer(request, parse_completion, False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Dict[str, Any]:
        return await answer(request, parse_chat, True)

    @app.post("/update_weights")
    async def update_weights(request: Request, version: Optional[str] = None,
                             last: bool = True) -> Dict[str, Any]:
        v = _version(version)
        tensors, kind = from_bytes(await request.body())
        await run_in_threadpool(_update, engine, v, tensors, kind, last)
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


def _update(engine: TorchEngine, version: int, tensors, kind: str, last: bool = True) -> None:
    if version < engine.version:
        raise StaleVersion(f"weights version {version} is older than the served version "
                           f"{engine.version}")
    engine.update_weights(version, tensors, kind, last)


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


def _is_id(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _known(body: Dict[str, Any], fields) -> None:
    unknown = sorted(set(body) - fields)
    if unknown:
        raise UserError(f"unknown field '{unknown[0]}'; fields: {', '.join(sorted(fields))}")


def prompt_ids(prompt, tokenizer) -> List[List[int]]:
    """A completion ``prompt`` (text, ids, or a list of either) -> token-id prompts, as the learner's."""
    one = isinstance(prompt, str) or (isinstance(prompt, list) and bool(prompt) and _is_id(prompt[0]))
    items = [prompt] if one else prompt
    if not isinstance(items, list) or not items:
        raise UserError(f"prompt must be text, token ids, or a non-empty list of either; got {prompt!r}")
    out = []
    for p in items:
        if isinstance(p, str):
            if tokenizer is None:
                raise UserError("prompt must be token ids: a server without a tokenizer does "
                                "not tokenize text")
            out.append(list(tokenizer(p)["input_ids"]))
        elif isinstance(p, list) and p and all(_is_id(t) for t in p):
            out.append(p)
        else:
            raise UserError(f"each prompt must be text or a non-empty list of token ids; got {p!r}")
    return out


def chat_ids(messages, tokenizer) -> List[int]:
    """OpenAI chat ``messages`` -> token ids through the chat template, as the learner encodes them."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise UserError("POST /v1/chat/completions needs a tokenizer with a chat template; this "
                        "model's tokenizer has none (use POST /v1/completions with a text prompt)")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise UserError('messages must be a non-empty list of {"role": ..., "content": ...} objects')
    msgs = [{**m, "content": _text(m.get("content"))} for m in messages]
    try:
        text = render_chat(tokenizer, msgs)
    except Exception as exc:  # noqa: BLE001 - a template's own error (raise_exception) is the request's
        raise UserError(f"the chat template cannot render these messages: {exc}") from None
    return list(tokenizer(text)["input_ids"])


def _text(content) -> str:
    """A message's content: a string, or a list of {"type": "text", "text": ...} parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(c, dict) and c.get("type") == "text"
                                         and isinstance(c.get("text"), str) for c in content):
        return "".join(c["text"] for c in content)
    raise UserError(f"a message's content must be text or a list of text parts; got {content!r}")


def parse_completion(body: Dict[str, Any], default_stops, tokenizer=None):
    """A /v1/completions body -> (prompts [[int]], Sampling, n, seed, logprobs wanted)."""
    _known(body, _FIELDS)
    if body.get("echo"):
        raise UserError("echo=true is not served; omit it")
    logprobs = body.get("logprobs")
    if logprobs not in (None, 0, 1) or isinstance(logprobs, bool):
        raise UserError(f"logprobs must be 0 or 1 (the sampled tokens' log-probs; no top "
                        f"alternatives are computed), got {logprobs!r}")
    return (prompt_ids(body.get("prompt"), tokenizer), *_sampling(body, default_stops),
            logprobs is not None)


def parse_chat(body: Dict[str, Any], default_stops, tokenizer):
    """A /v1/chat/completions body -> ([prompt ids], Sampling, n, seed, logprobs wanted)."""
    _known(body, _CHAT_FIELDS)
    logprobs, top = body.get("logprobs") or False, body.get("top_logprobs")
    if not isinstance(logprobs, bool):
        raise UserError(f"logprobs must be true or false, got {logprobs!r}")
    if top not in (None, 0) or isinstance(top, bool):
        raise UserError(f"top_logprobs must be 0 (no top alternatives are computed), got {top!r}")
    if "max_completion_tokens" in body:
        body = {**body, "max_tokens": body["max_completion_tokens"]}
    return ([chat_ids(body.get("messages"), tokenizer)], *_sampling(body, default_stops), logprobs)


def _sampling(body: Dict[str, Any], default_stops):
    """The sampling fields both routes share -> (Sampling, n, seed)."""
    if body.get("stream"):
        raise UserError("stream=true is not served; omit it")
    if body.get("top_p", 1.0) != 1.0:
        raise UserError("top_p must be 1.0: the engine samples from the full softmax "
                        "(optionally top_k)")
    n, seed = body.get("n", 1), body.get("seed")
    if not _is_id(n) or n < 1:
        raise UserError(f"n must be an integer >= 1, got {n!r}")
    if seed is not None and not _is_id(seed):
        raise UserError(f"seed must be an integer, got {seed!r}")
    stops = body.get("stop_token_ids") or []
    if not isinstance(stops, list) or not all(_is_id(s) for s in stops):
        raise UserError(f"stop_token_ids must be a list of token ids, got {stops!r}")
    top_k = body.get("top_k", 0)
    top_k = 0 if top_k == -1 else top_k            # vLLM's and SGLang's "off"
    temperature = body.get("temperature", 1.0)
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool):
        raise UserError(f"temperature must be a number >= 0, got {temperature!r}")
    all_stops = tuple(dict.fromkeys(list(stops) + ([] if body.get("ignore_eos") else list(default_stops))))
    return Sampling(body.get("max_tokens", 16), float(temperature), top_k, all_stops), n, seed


def completion_response(outs, model_name: str, want_logprobs: bool, prompts,
                        tokenizer=None, chat: bool = False) -> Dict[str, Any]:
    """The OpenAI (chat) completion object with vLLM's token-id fields and text decoding."""
    choices: List[Dict[str, Any]] = []
    for i, c in enumerate(outs):
        text = tokenizer.decode(c.token_ids, skip_special_tokens=True) if tokenizer is not None else ""
        choice = {"index": i, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
                  "stop_reason": c.token_ids[-1] if c.finish_reason == "stop" else None,
                  "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
            if want_logprobs:
                choice["logprobs"] = {"content": [
                    {"token": f"token_id:{t}", "logprob": lp, "bytes": None, "top_logprobs": []}
                    for t, lp in zip(c.token_ids, c.logprobs)]}
        else:
            choice["text"] = text
            if want_logprobs:
                choice["logprobs"] = {"tokens": [f"token_id:{t}" for t in c.token_ids],
                                      "token_logprobs": c.logprobs, "top_logprobs": None,
                                      "text_offset": []}
        choices.append(choice)
    n_prompt = sum(len(p) for p in prompts) * (len(outs) // max(len(prompts), 1))
    n_out = sum(len(c.token_ids) for c in outs)
    return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model_name, "choices": choices,
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out,
                      "total_tokens": n_prompt + n_out},
            "weights_version": outs[0].weights_version if outs else 0}
