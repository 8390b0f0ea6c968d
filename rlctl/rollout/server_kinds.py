"""Server kinds: what differs between the completions servers the server engine talks to.

``ServerEngine`` (rollout/server_engine.py) owns what every kind shares: chunks, seeds,
threads, lost servers, staleness. An adapter here owns only what differs per kind:

* the completion request for token-id prompts and the parsing of its reply into
  ``Completion`` (token ids, per-token log-probs, finish reason, weights version);
* the probe route that says a server is alive (and, where it can, its weights version);
* how weights are pushed.

``KINDS`` maps a name to its adapter class; ``server_kind(name)`` refuses an unknown name
in one line. docs/server-kinds.md has the routes in full.

| kind     | generate                 | weights pushed by                                       | version     |
|----------|--------------------------|---------------------------------------------------------|-------------|
| rlctl    | POST /v1/completions     | POST /update_weights (safetensors bytes), .../from_disk | reported    |
| vllm     | POST /v1/completions     | full: model.safetensors rewritten in the served model   | client-side |
|          | (return_token_ids)       | directory + POST /collective_rpc reload_weights + POST  |             |
|          |                          | /reset_prefix_cache; LoRA: POST /v1/load_lora_adapter   |             |
| sglang   | POST /generate           | full: POST /update_weights_from_disk; LoRA: POST        | client-side |
|          | (input_ids, per-row seed)| /load_lora_adapter                                      |             |

Written from these documents and sources (not run here: no GPU machine was lent):

* vLLM docs ``features/sleep_mode.md`` (online serving, dev mode: ``POST /collective_rpc``
  ``{"method": "reload_weights"}`` loads the weights in place from the served checkpoint),
  ``features/lora.md`` ("Dynamically serving LoRA Adapters": ``POST /v1/load_lora_adapter``
  and ``/v1/unload_lora_adapter`` with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``), the
  completions API (``return_token_ids``, ``logprobs``, ``stop_token_ids``, ``ignore_eos``,
  ``seed``, ``top_k``; vLLM 0.10.2 and later docs) and ``v1/engine/parallel_sampling.py``
  (with ``n`` > 1 and a seed, sample i is seeded seed + i). vLLM's weight-transfer routes
  (``/init_weight_transfer_engine`` ... ``/update_weights``) move tensors over NCCL or
  CUDA IPC, not HTTP, and are not used. The completion reply carries no weights version.
* SGLang docs ``basic_usage/sampling_params.md`` (``/generate`` with ``input_ids``, a list
  of ``sampling_params``, ``return_logprob``), ``advanced_features/sglang_for_rl.md``
  (``POST /update_weights_from_disk`` with ``model_path`` and ``weight_version``; reply
  ``success``/``message``) and ``srt/sampling/sampling_params.py`` (``sampling_seed``);
  LoRA: ``/load_lora_adapter``, ``/unload_lora_adapter``, ``lora_path`` per request.
  In SGLang ``ignore_eos`` also turns off ``stop_token_ids`` (its ``Req.check_finished``),
  so this adapter sends ``ignore_eos: false`` and SGLang stops at the model's EOS ids too.

A kind whose replies carry no weights version is tracked client-side: a server's version
is the version this client last pushed to it successfully, and 0 (the weights it was
started with) whenever it is first seen or comes back after being lost.
"""
from __future__ import annotations

from collections import OrderedDict

from rlctl.errors import UserError
from rlctl.rollout.server_foreign import SGLangKind, VLLMKind, parse_sglang, sglang_body, vllm_requests  # noqa: F401
from rlctl.rollout.server_kind_base import (Link, RlctlKind, ServerKind, parse_openai,  # noqa: F401
                                            rlctl_body, write_peft_adapter)


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
    """The adapter of ``rollout.server.kind`` with the directories the run names:
    ``weight_dir`` (vllm: its LoRA adapters; sglang: every push), ``model_dir`` (vllm:
    the directory ``vllm serve`` loads, for full weights). rlctl takes neither: its
    pushes go in the request body or through EngineSource's own ``weight_dir``."""
    if name == "vllm":
        return VLLMKind(model_dir=model_dir, lora_dir=weight_dir)
    if name == "sglang":
        return SGLangKind(weights_dir=weight_dir)
    return server_kind(name)
