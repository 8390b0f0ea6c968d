"""Server kinds: what differs between the servers ``ServerEngine`` talks to (docs/server-kinds.md)."""
from __future__ import annotations

import itertools
import json
import os
import re
from collections import OrderedDict
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch
from safetensors.torch import save_file

from rlctl.errors import UserError
from rlctl.rollout.engines.protocol import (LENGTH, STOP, Completion, Sampling, chunk_seed, claim_version,
                                  prune_versions, read_dir, to_bytes)

JSON = "application/json"


class Link:
    """One server: ``link(route, body=None, ctype, expect_json)`` GETs without a body, POSTs
    with one (a dict as JSON) -> the reply's JSON ({} for other text unless ``expect_json``)."""

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
    sends_parts = False       # True: each part of a push is sent (the server holds them until the last)

    def probe(self, link: Link) -> Optional[int]:
        """The server's weights version (None: not reported); raises when it does not answer."""
        raise NotImplementedError

    def complete(self, link: Link, rows: List[List[int]], sampling: Sampling,
                 seed: Optional[int]) -> Tuple[List[Completion], Optional[int]]:
        """One request's completions, one per row in order, and the version it reports."""
        raise NotImplementedError

    def push(self, version: int, tensors: Dict[str, torch.Tensor], kind: str, part: int = 0,
             last: bool = True) -> Optional[Push]:
        """Prepare a push of full weights or an adapter, or its ``part``-th part (``last``: the
        final one); the result sends it to one server (None: nothing to send for this part)."""
        raise NotImplementedError

    def push_from_disk(self, version: int, path: str) -> Push:
        raise NotImplementedError


# -- rlctl: our own server (rollout/engines/serve_app.py) ----------------------------------------

def parse_openai(reply: dict, version: int) -> List[Completion]:
    """An OpenAI completion object with per-choice ``token_ids`` -> completions in choice order."""
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
    """``rlctl serve``: replies carry ``weights_version``; weights go as bytes or by path."""
    name = "rlctl"
    parallel_push = sends_parts = True

    def probe(self, link: Link) -> Optional[int]:
        return int(link("/version")["weights_version"])

    def complete(self, link, rows, sampling, seed):
        reply = link("/v1/completions", {
            "prompt": rows, "max_tokens": sampling.max_new_tokens, "seed": seed,
            "temperature": sampling.temperature, "top_k": sampling.top_k, "logprobs": 0,
            "stop_token_ids": list(sampling.stop_ids), "ignore_eos": True})
        version = int(reply.get("weights_version", 0))
        return parse_openai(reply, version), version

    def push(self, version, tensors, kind, part=0, last=True):
        data = to_bytes(tensors, kind)
        route = f"/update_weights?version={int(version)}" + ("" if last else "&last=false")
        return lambda link: int(link(route, data, "application/octet-stream")["weights_version"])

    def push_from_disk(self, version, path):
        body = {"path": str(path), "version": int(version)}
        return lambda link: int(link("/update_weights_from_disk", body)["weights_version"])


# -- LoRA adapters on disk, as PEFT writes them (vLLM and SGLang load this layout) --------

def write_peft_adapter(tensors: Dict[str, torch.Tensor], directory: Path) -> Path:
    """rlctl adapter tensors -> ``directory`` in PEFT's layout (lora_alpha = r: B is scaled)."""
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

    def __init__(self, prefix: str, routes: str, expect_json: bool):
        self.current: Optional[str] = None      # the name requests use; None: base weights
        self.parts: Dict[str, torch.Tensor] = {}   # a push's parts so far: PEFT reads one file
        self.loaded: Dict[str, str] = {}
        self.routes, self.expect_json = routes, expect_json
        # a tag of this client's own: a server that outlives a run may hold the same name
        self.prefix = f"{prefix}-{os.urandom(3).hex()}-v"

    def push(self, version: int, tensors: Dict[str, torch.Tensor], directory: Path, part: int = 0,
             last: bool = True) -> Optional[Push]:
        """Write the adapter (at its last part) under ``directory``; the push loads it and
        unloads the last one."""
        self.parts = {**(self.parts if part else {}), **tensors}
        if not last:
            return None
        tensors, self.parts = self.parts, {}
        name = f"{self.prefix}{int(version)}"
        body = {"lora_name": name, "lora_path": str(write_peft_adapter(tensors, directory / name))}

        def send(link: Link) -> None:
            reply = link(f"{self.routes}/load_lora_adapter", body, expect_json=self.expect_json)
            _checked(reply if self.expect_json else {})
            old = self.loaded.pop(link.url, None)
            if old and old != name:
                try:
                    link(f"{self.routes}/unload_lora_adapter", {"lora_name": old},
                         expect_json=self.expect_json)
                except UserError:        # already gone (a restarted server): nothing to free
                    pass
            self.loaded[link.url] = name
            self.current = name
        return send


def _checked(reply: dict) -> dict:
    if reply.get("success") is False:
        raise UserError(f"the server refused the weights: {reply.get('message', 'no message')}")
    return reply


# -- vLLM ------------------------------------------------------------------------------

def vllm_requests(rows, sampling: Sampling, seed: Optional[int], model: Optional[str]):
    """Token-id prompts -> [(body, row indices its choices fill)]. vLLM seeds sample i of a
    request seed + i: runs of equal consecutive prompts go once with ``n`` = the run length,
    in one request when every run has the same length, else one request per run (run k
    seeded ``chunk_seed(seed, k)``); without a seed the prompts go as they are."""
    runs = [[i for i, _ in run]                                   # equal consecutive prompts
            for _, run in itertools.groupby(enumerate(rows), lambda r: list(r[1]))]
    if seed is None:
        groups = [(list(range(len(rows))), [list(r) for r in rows], 1, None)]
    elif len({len(ix) for ix in runs}) == 1:
        groups = [([i for ix in runs for i in ix], [list(rows[ix[0]]) for ix in runs],
                   len(runs[0]), seed)]
    else:
        groups = [(ix, [list(rows[ix[0]])], len(ix), chunk_seed(seed, k))
                  for k, ix in enumerate(runs)]
    out = []
    for indices, prompts, n, s in groups:
        body = {"prompt": prompts, "n": n, "max_tokens": sampling.max_new_tokens,
                "temperature": sampling.temperature, "top_k": sampling.top_k or -1,
                "top_p": 1.0, "stop_token_ids": list(sampling.stop_ids), "ignore_eos": True,
                "logprobs": 0, "return_token_ids": True}
        if s is not None:
            body["seed"] = s
        if model:
            body["model"] = model
        out.append((body, indices))
    return out


class VLLMKind(ServerKind):
    """A vLLM server (``vllm serve``): full weights reloaded from ``model_dir``, LoRA under ``lora_dir``."""
    name = "vllm"

    def __init__(self, model_dir: Optional[str] = None, lora_dir: Optional[str] = None,
                 model: Optional[str] = None):
        self.model_dir, self.lora_dir, self.model = model_dir, lora_dir, model
        self.lora = _LoraNames("rlctl", "/v1", expect_json=False)

    def probe(self, link: Link) -> Optional[int]:
        served = link("/v1/models").get("data") or []
        if self.model is None and served:
            self.model = served[0]["id"]
        return None

    def complete(self, link, rows, sampling, seed):
        out: List[Optional[Completion]] = [None] * len(rows)
        for body, indices in vllm_requests(rows, sampling, seed, self.lora.current or self.model):
            for i, c in zip(indices, parse_openai(link("/v1/completions", body), 0)):
                out[i] = c
        return out, None

    def push(self, version, tensors, kind, part=0, last=True):
        if kind == "adapter":
            lora_dir = _needs(self.lora_dir, "lora_dir (a directory the servers read at the same "
                              "path)", self.name)
            return self.lora.push(version, tensors, Path(lora_dir), part, last)
        if kind != "full":
            raise UserError(f"unknown weights kind '{kind}'; valid: full, adapter")
        model_dir = Path(_needs(self.model_dir, "model_dir (the directory vllm serve loads, "
                                "shared with this machine)", self.name))
        others = [p.name for p in model_dir.glob("*.safetensors") if not PART.fullmatch(p.name)]
        if others:
            raise UserError(f"{model_dir} holds other weight files ({others[0]}): vLLM would "
                            "reload them too; serve a directory with one model.safetensors")
        _write_part(model_dir, part, tensors)
        if not last:
            return None
        for old in model_dir.glob("model-part*.safetensors"):     # an earlier push's, beyond this one's
            if int(PART.fullmatch(old.name).group(1) or 0) > part:
                old.unlink()

        def send(link: Link) -> None:
            link("/collective_rpc", {"method": "reload_weights"}, expect_json=False)
            link("/reset_prefix_cache", b"", expect_json=False)
            self.lora.current = None
        return send

    def push_from_disk(self, version, path):
        tensors, kind = read_dir(path)        # read here: vLLM reloads only its own directory
        return self.push(version, tensors, kind)


PART = re.compile(r"model(?:-part(\d+))?\.safetensors")      # the files a full push writes


def _write_part(directory: Path, part: int, tensors: Dict[str, torch.Tensor]) -> None:
    """Part ``part`` of a full push: ``directory``/model.safetensors (the first) or
    model-part<part>.safetensors, renamed into place."""
    name = "model.safetensors" if part == 0 else f"model-part{part:05d}.safetensors"
    tmp = directory / f".{name}.tmp"
    tmp.write_bytes(to_bytes(tensors, "full"))
    os.replace(tmp, directory / name)


# -- SGLang ------------------------------------------------------------------------------

def sglang_body(rows, sampling: Sampling, seed: Optional[int], lora: Optional[str]) -> dict:
    """Token-id prompts -> a native /generate body, one sampling_params per row (row i
    seeded ``chunk_seed(seed, i)``, so equal prompts draw different tokens)."""
    params = []
    for i in range(len(rows)):
        p = {"max_new_tokens": sampling.max_new_tokens, "temperature": sampling.temperature,
             "top_k": sampling.top_k or -1, "top_p": 1.0,
             "stop_token_ids": list(sampling.stop_ids), "ignore_eos": False}
        if seed is not None:
            p["sampling_seed"] = chunk_seed(seed, i)
        params.append(p)
    body = {"input_ids": [list(r) for r in rows], "sampling_params": params,
            "return_logprob": True, "logprob_start_len": -1, "top_logprobs_num": 0}
    if lora:
        body["lora_path"] = [lora] * len(rows)
    return body


def parse_sglang(reply, version: int) -> List[Completion]:
    """/generate's reply (a list for a batch; meta_info.output_token_logprobs holds
    [logprob, token_id, text] per sampled token) -> completions in order."""
    items = reply if isinstance(reply, list) else [reply]
    out = []
    for item in items:
        meta = item["meta_info"]
        pairs = meta["output_token_logprobs"]
        ids = [int(p[1]) for p in pairs]
        if "output_ids" in item and list(item["output_ids"]) != ids:
            raise UserError("SGLang's output_ids and output_token_logprobs disagree")
        reason = meta["finish_reason"]
        reason = reason.get("type") if isinstance(reason, dict) else reason
        out.append(Completion(ids, [float(p[0]) for p in pairs], _finish(reason), version))
    return out


class SGLangKind(ServerKind):
    """An SGLang server: one ``sampling_params`` per row; weights pushed through ``weights_dir``."""
    name = "sglang"

    def __init__(self, weights_dir: Optional[str] = None):
        self.weights_dir = weights_dir
        self.lora = _LoraNames("rlctl-lora", "", expect_json=True)

    def probe(self, link: Link) -> Optional[int]:
        link("/health", expect_json=False)
        return None

    def complete(self, link, rows, sampling, seed):
        reply = link("/generate", sglang_body(rows, sampling, seed, self.lora.current))
        return parse_sglang(reply, 0), None

    def _dir(self) -> Path:
        return Path(_needs(self.weights_dir, "weights_dir (a directory the servers read at "
                           "the same path)", self.name))

    def push(self, version, tensors, kind, part=0, last=True):
        if kind == "adapter":
            return self.lora.push(version, tensors, self._dir(), part, last)
        if kind != "full":
            raise UserError(f"unknown weights kind '{kind}'; valid: full, adapter")
        directory = claim_version(self._dir(), f"rlctl-v{int(version)}")
        directory.mkdir(exist_ok=True)
        _write_part(directory, part, tensors)
        if not last:
            return None
        prune_versions(self._dir(), "rlctl-v", int(version))        # a model per push: keep two
        return self.push_from_disk(version, str(directory))

    def push_from_disk(self, version, path):
        body = {"model_path": str(path), "weight_version": str(int(version)), "flush_cache": True}

        def send(link: Link) -> None:
            _checked(link("/update_weights_from_disk", body))
            self.lora.current = None
        return send


KINDS: "OrderedDict[str, type]" = OrderedDict(
    [("rlctl", RlctlKind), ("vllm", VLLMKind), ("sglang", SGLangKind)])


def server_kind(kind) -> ServerKind:
    """A kind's name (its adapter with default options) or an adapter -> the adapter."""
    if isinstance(kind, ServerKind):
        return kind
    if kind not in KINDS:
        raise UserError(f"unknown server kind '{kind}'; valid: {', '.join(KINDS)}")
    return KINDS[kind]()


def configured_kind(name: str, weight_dir=None, model_dir=None) -> ServerKind:
    """The adapter of ``rollout.server.kind`` with the run's ``weight_dir`` and ``model_dir``."""
    if name == "vllm":
        return VLLMKind(model_dir=model_dir, lora_dir=weight_dir)
    if name == "sglang":
        return SGLangKind(weights_dir=weight_dir)
    return server_kind(name)
