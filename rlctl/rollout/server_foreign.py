"""The vLLM and SGLang server kinds (rollout/server_kinds.py has the routes, the
documents they were written from, and what was run where)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import List, Optional

from rlctl.errors import UserError
from rlctl.rollout.engine import Completion, Sampling, chunk_seed
from rlctl.rollout.server_kind_base import (Link, ServerKind, _checked, _finish, _LoraNames, _needs,
                                            parse_openai, write_peft_adapter)
from rlctl.rollout.weights import prune_versions, read_dir, to_bytes


def vllm_requests(rows, sampling: Sampling, seed: Optional[int], model: Optional[str]):
    """Token-id prompts -> [(body, row indices its choices fill, in order)].

    vLLM seeds each prompt of a request with the request's seed, so equal prompts would
    sample equal tokens. Runs of equal consecutive prompts are therefore sent once with
    ``n`` = the run length (sample i is seeded seed + i): one request when every run has
    the same length (rlctl's groups), else one request per run, run k seeded
    ``chunk_seed(seed, k)``. Without a seed the prompts go as they are, n = 1."""
    runs = _runs(rows)
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


def _runs(rows) -> List[List[int]]:
    runs: List[List[int]] = []
    for i, row in enumerate(rows):
        if runs and list(rows[runs[-1][0]]) == list(row):
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


class VLLMKind(ServerKind):
    """A vLLM OpenAI-compatible server (``vllm serve``).

    * generate: POST /v1/completions with ``return_token_ids`` and ``logprobs: 0`` (the
      sampled token's log-prob). Start the server with ``--logprobs-mode
      processed_logprobs`` so that log-probs are taken after temperature, as the learner's.
    * full weights: ``model_dir`` is the directory ``vllm serve`` was started on, seen at
      the same path here (a shared filesystem). A push writes its ``model.safetensors``
      (Hugging Face names, as ``named_parameters()``), then each server gets
      ``POST /collective_rpc {"method": "reload_weights"}`` (vLLM reloads its checkpoint in
      place) and ``POST /reset_prefix_cache``. Needs ``VLLM_SERVER_DEV_MODE=1``.
    * LoRA: the adapter is written in PEFT layout under ``lora_dir`` (shared), then
      ``POST /v1/load_lora_adapter {"lora_name": "rlctl-<tag>-v<V>", "lora_path": ...}``; later
      requests name it as ``model``; the previous one is unloaded. Needs ``--enable-lora``,
      ``--max-lora-rank`` >= r and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``.
    * version: not reported: tracked client-side. ``model``: the served model's name
      (default: the first of GET /v1/models, the probe route)."""
    name = "vllm"

    def __init__(self, model_dir: Optional[str] = None, lora_dir: Optional[str] = None,
                 model: Optional[str] = None):
        self.model_dir, self.lora_dir, self.model = model_dir, lora_dir, model
        self.lora = _LoraNames()

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

    def push(self, version, tensors, kind):
        if kind == "adapter":
            return self._push_lora(version, tensors)
        if kind != "full":
            raise UserError(f"unknown weights kind '{kind}'; valid: full, adapter")
        model_dir = Path(_needs(self.model_dir, "model_dir (the directory vllm serve loads, "
                                "shared with this machine)", self.name))
        others = [p.name for p in model_dir.glob("*.safetensors") if p.name != "model.safetensors"]
        if others:
            raise UserError(f"{model_dir} holds other weight files ({others[0]}): vLLM would "
                            "reload them too; serve a directory with one model.safetensors")
        tmp = model_dir / ".model.safetensors.tmp"
        tmp.write_bytes(to_bytes(tensors, "full"))
        os.replace(tmp, model_dir / "model.safetensors")

        def send(link: Link) -> None:
            link("/collective_rpc", {"method": "reload_weights"}, expect_json=False)
            link("/reset_prefix_cache", b"", expect_json=False)
            self.lora.current = None
        return send

    def _push_lora(self, version, tensors) -> Push:
        name = self.lora.name("rlctl", version)
        path = write_peft_adapter(tensors, Path(_needs(self.lora_dir, "lora_dir (a directory the "
                                                       "servers read at the same path)", self.name)) / name)

        def send(link: Link) -> None:
            self.lora.swap(link, name,
                           lambda: link("/v1/load_lora_adapter",
                                        {"lora_name": name, "lora_path": str(path)}, expect_json=False),
                           lambda old: link("/v1/unload_lora_adapter", {"lora_name": old},
                                            expect_json=False))
            self.lora.current = name
        return send

    def push_from_disk(self, version, path):
        tensors, kind = read_dir(path)        # read here: vLLM reloads only its own directory
        return self.push(version, tensors, kind)


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
    """An SGLang server (``python -m sglang.launch_server``).

    * generate: POST /generate (native), ``input_ids`` and one ``sampling_params`` per row
      with its ``sampling_seed``; ``return_logprob`` gives the sampled tokens' log-probs.
    * full weights: written as ``<weights_dir>/rlctl-v<V>/model.safetensors`` (shared;
      versions older than the one before are removed),
      then ``POST /update_weights_from_disk {"model_path": ..., "weight_version": "V"}``;
      ``update_weights_from_disk(V, path)`` sends ``path`` itself.
    * LoRA: PEFT layout under ``weights_dir``, ``POST /load_lora_adapter``, then
      ``lora_path`` on each request; the previous adapter is unloaded. Needs ``--enable-lora``.
    * version: tracked client-side (adapters do not change SGLang's weight_version label).
      Probe: GET /health (an empty 200)."""
    name = "sglang"

    def __init__(self, weights_dir: Optional[str] = None):
        self.weights_dir = weights_dir
        self.lora = _LoraNames()

    def probe(self, link: Link) -> Optional[int]:
        link("/health", expect_json=False)
        return None

    def complete(self, link, rows, sampling, seed):
        reply = link("/generate", sglang_body(rows, sampling, seed, self.lora.current))
        return parse_sglang(reply, 0), None

    def _dir(self) -> Path:
        return Path(_needs(self.weights_dir, "weights_dir (a directory the servers read at "
                           "the same path)", self.name))

    def push(self, version, tensors, kind):
        if kind == "adapter":
            name = self.lora.name("rlctl-lora", version)
            path = write_peft_adapter(tensors, self._dir() / name)

            def send(link: Link) -> None:
                self.lora.swap(link, name,
                               lambda: _checked(link("/load_lora_adapter",
                                                     {"lora_name": name, "lora_path": str(path)})),
                               lambda old: link("/unload_lora_adapter", {"lora_name": old}))
                self.lora.current = name
            return send
        if kind != "full":
            raise UserError(f"unknown weights kind '{kind}'; valid: full, adapter")
        directory = self._dir() / f"rlctl-v{int(version)}"
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "model.safetensors").write_bytes(to_bytes(tensors, "full"))
        prune_versions(self._dir(), "rlctl-v", int(version))        # a model per push: keep two
        return self.push_from_disk(version, str(directory))

    def push_from_disk(self, version, path):
        body = {"model_path": str(path), "weight_version": str(int(version)), "flush_cache": True}

        def send(link: Link) -> None:
            _checked(link("/update_weights_from_disk", body))
            self.lora.current = None
        return send
