"""What every server kind shares (rollout/server_kinds.py says what differs and why):
``Link`` (one server's HTTP calls), the ``ServerKind`` adapter interface, the OpenAI
completion reply parser, the ``rlctl`` kind (our `rlctl serve`), and the helpers the
foreign kinds share (PEFT adapter directories, LoRA names, refused pushes)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch
from safetensors.torch import save_file

from rlctl.errors import UserError
from rlctl.rollout.engine import LENGTH, STOP, Completion, Sampling
from rlctl.rollout.weights import to_bytes

JSON = "application/json"

class Link:
    """One server as an adapter sees it: ``url``, and ``call(route, body=None, ctype=JSON,
    expect_json=True)``: GET without a body, POST with one (a dict is sent as JSON); the
    reply's JSON ({} for a reply that is not JSON when ``expect_json`` is false). Raises
    what the engine's HTTP layer raises (a lost server, or UserError for a 4xx)."""

    def __init__(self, url: str, call: Callable[..., dict]):
        self.url, self._call = url, call

    def __call__(self, route: str, body=None, ctype: str = JSON, expect_json: bool = True) -> dict:
        if isinstance(body, (dict, list)):
            body = json.dumps(body).encode()
        return self._call(route, body, ctype, expect_json)


Push = Callable[[Link], Optional[int]]     # pushes to one server -> the version it reports


class ServerKind:
    """The part of the server protocol that differs per kind (module docstring)."""
    name = ""
    parallel_push = False     # True: a push's sends hold no client state (servers pushed at once)

    def probe(self, link: Link) -> Optional[int]:
        """Raise when the server does not answer; else its weights version (None: not reported)."""
        raise NotImplementedError

    def complete(self, link: Link, rows: List[List[int]], sampling: Sampling,
                 seed: Optional[int]) -> Tuple[List[Completion], Optional[int]]:
        """One request's completions (one per row, in order) and the version the reply reports."""
        raise NotImplementedError

    def push(self, version: int, tensors: Dict[str, torch.Tensor], kind: str) -> Push:
        """Prepare a push of full weights or an adapter (rollout/weights.py); the result sends
        it to one server."""
        raise NotImplementedError

    def push_from_disk(self, version: int, path: str) -> Push:
        raise NotImplementedError


# -- rlctl: our own server (rollout/serve_app.py) ----------------------------------------

def rlctl_body(rows, sampling: Sampling, seed: Optional[int]) -> dict:
    return {"prompt": rows, "max_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature, "top_k": sampling.top_k,
            "stop_token_ids": list(sampling.stop_ids), "ignore_eos": True, "logprobs": 0,
            "seed": seed}


def parse_openai(reply: dict, version: int) -> List[Completion]:
    """An OpenAI completion object with per-choice ``token_ids`` (rlctl serve, vLLM with
    ``return_token_ids``) -> completions in choice order."""
    choices = sorted(reply["choices"], key=lambda c: c["index"])
    out = []
    for c in choices:
        ids = c.get("token_ids")
        logprobs = c["logprobs"]["token_logprobs"]
        if ids is None:      # vLLM without return_token_ids, --return-tokens-as-token-ids
            ids = [int(t.split(":", 1)[1]) for t in c["logprobs"]["tokens"]]
        if len(ids) != len(logprobs):
            raise UserError(f"a completion holds {len(ids)} tokens but {len(logprobs)} log-probs")
        out.append(Completion(list(ids), [float(x) for x in logprobs],
                              _finish(c["finish_reason"]), version))
    return out


def _finish(reason) -> str:
    if reason in (STOP, LENGTH):
        return reason
    raise UserError(f"the server ended a completion with finish reason {reason!r}; "
                    "expected 'stop' or 'length'")


class RlctlKind(ServerKind):
    """``rlctl serve``: every reply carries ``weights_version``; weights travel as
    safetensors bytes (POST /update_weights?version=V) or by path on a shared directory."""
    name = "rlctl"
    parallel_push = True

    def probe(self, link: Link) -> Optional[int]:
        return int(link("/version")["weights_version"])

    def complete(self, link, rows, sampling, seed):
        reply = link("/v1/completions", rlctl_body(rows, sampling, seed))
        version = int(reply.get("weights_version", 0))
        return parse_openai(reply, version), version

    def push(self, version, tensors, kind):
        data = to_bytes(tensors, kind)
        route = f"/update_weights?version={int(version)}"
        return lambda link: int(link(route, data, "application/octet-stream")["weights_version"])

    def push_from_disk(self, version, path):
        body = {"path": str(path), "version": int(version)}
        return lambda link: int(link("/update_weights_from_disk", body)["weights_version"])


# -- LoRA adapters on disk, as PEFT writes them (vLLM and SGLang load this layout) --------

def write_peft_adapter(tensors: Dict[str, torch.Tensor], directory: Path) -> Path:
    """rlctl adapter tensors (``M.lora_A`` [r, in], ``M.lora_B`` [out, r], alpha/r already
    in B) -> ``directory`` with adapter_config.json (lora_alpha = r: scaling 1; the adapted
    modules' full names as target_modules) and adapter_model.safetensors
    (``base_model.model.M.lora_A.weight`` ...)."""
    ranks, modules, flat = set(), set(), {}
    for key, t in tensors.items():
        name, _, part = key.rpartition(".")
        if part not in ("lora_A", "lora_B") or not name:
            raise UserError(f"adapter tensor '{key}' is not <module>.lora_A|lora_B")
        if part == "lora_A":
            ranks.add(int(t.shape[0]))
        modules.add(name)
        flat[f"base_model.model.{name}.{part}.weight"] = t.detach().to("cpu").contiguous()
    if len(ranks) != 1:
        raise UserError(f"adapter ranks differ across modules ({sorted(ranks)}); one rank per adapter")
    r = ranks.pop()
    directory.mkdir(parents=True, exist_ok=True)
    save_file(flat, str(directory / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": r,
              "target_modules": sorted(modules), "lora_dropout": 0.0, "bias": "none",
              "fan_in_fan_out": False}
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return directory


def _needs(value, what: str, kind: str):
    if not value:
        raise UserError(f"the {kind} server kind needs {what} to push these weights")
    return value


class _LoraNames:
    """The LoRA adapter each server has loaded (by url): replaced, never stacked."""

    def __init__(self):
        self.current: Optional[str] = None      # the name requests use; None: base weights
        self.loaded: Dict[str, str] = {}
        # this client's own tag: a server that outlives a run, or another run sharing the
        # directory, may hold the same version's name already (a load would be refused)
        self.tag = os.urandom(3).hex()

    def name(self, prefix: str, version: int) -> str:
        return f"{prefix}-{self.tag}-v{int(version)}"

    def swap(self, link: Link, name: str, load: Callable[[], None], unload: Callable[[str], None]):
        load()
        old = self.loaded.pop(link.url, None)
        if old and old != name:
            try:
                unload(old)
            except UserError:        # already gone (a restarted server): nothing to free
                pass
        self.loaded[link.url] = name


# -- vLLM ------------------------------------------------------------------------------


def _checked(reply: dict) -> dict:
    if reply.get("success") is False:
        raise UserError(f"the server refused the weights: {reply.get('message', 'no message')}")
    return reply
