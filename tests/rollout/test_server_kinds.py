"""Server kinds (rlctl/rollout/engines/kinds.py): the request/reply translation of each
kind, the registry, the PEFT layout LoRA pushes write, and the ``rlctl`` kind end to end
against real `rlctl serve` apps (tests/rollout/serving.py).

Where the reply shapes come from (written by hand from the servers' documents, not
captured from a running server: no GPU machine was lent):
* vLLM: the OpenAI completion object of its /v1/completions (docs "OpenAI-Compatible
  Server"): ``choices[i]`` with ``index``, ``text``, ``token_ids`` (present with
  ``return_token_ids``), ``logprobs`` {``text_offset``, ``token_logprobs``, ``tokens``,
  ``top_logprobs``}, ``finish_reason``, ``stop_reason``; choice index = prompt x n + sample;
  ``tokens`` written "token_id:N" under ``--return-tokens-as-token-ids``.
* SGLang: /generate's reply for a batch of ``input_ids`` (docs "Sampling Parameters",
  native API): a list of {``text``, ``output_ids``, ``meta_info``: {``finish_reason``:
  {``type``, ``matched``}, ``output_token_logprobs``: [[logprob, token_id, text], ...]}}.

Tests that need a real vLLM or SGLang server run only when RLCTL_VLLM_URL /
RLCTL_SGLANG_URL name one; otherwise they are skipped with the reason.
"""
import copy
import http.server
import json
import os
import threading

import pytest
import torch
from safetensors import safe_open

from rlctl.config.compose import compose
from rlctl.errors import UserError
from rlctl.demo.tiny import build_model, build_tokenizer
from rlctl.rollout.engines.protocol import Sampling, TorchEngine, chunk_seed
from rlctl.rollout.engines.server import ServerEngine
from rlctl.rollout.engines.kinds import (KINDS, Link, RlctlKind, SGLangKind, VLLMKind, parse_openai,
                                        parse_sglang, server_kind, sglang_body, vllm_requests,
                                        write_peft_adapter)
from rlctl.rollout.engines.protocol import load_adapter, read_dir

from serving import ServeThread, tiny_app

SAMPLED = Sampling(6, 1.1, 0, (2, 7))


@pytest.fixture(scope="module")
def tiny():
    tok = build_tokenizer()
    model = build_model(tok, hidden_size=32, num_layers=2, num_heads=4, seed=0).eval()
    other = build_model(tok, hidden_size=32, num_layers=2, num_heads=4, seed=3).eval()
    prompts = [tok(t)["input_ids"] for t in ["3 1 2 :", "3 1 2 :", "9 :", "9 :"]]
    return model, other, tok, prompts


def fields(outs):
    return [(c.token_ids, c.logprobs, c.finish_reason) for c in outs]


# -- registry ------------------------------------------------------------------------------

def test_unknown_kind_is_one_line_naming_the_valid_ones():
    with pytest.raises(UserError) as err:
        server_kind("tgi")
    assert str(err.value) == "unknown server kind 'tgi'; valid: rlctl, vllm, sglang"
    with pytest.raises(UserError, match="valid: rlctl, vllm, sglang"):
        ServerEngine(["http://127.0.0.1:9"], kind="tgi")
    assert list(KINDS) == ["rlctl", "vllm", "sglang"]
    assert isinstance(server_kind("vllm"), VLLMKind)
    own = SGLangKind(weights_dir="/shared")
    assert server_kind(own) is own                       # an adapter with options passes


# -- vLLM ----------------------------------------------------------------------------------

def test_vllm_groups_equal_prompts_into_n_so_seeded_samples_differ():
    rows = [[5, 6], [5, 6], [5, 6], [9], [9], [9]]
    (body, indices), = vllm_requests(rows, Sampling(4, 0.7, 0, (2,)), seed=11, model="m")
    assert body["prompt"] == [[5, 6], [9]] and body["n"] == 3 and body["seed"] == 11
    assert indices == [0, 1, 2, 3, 4, 5]                 # choice index = prompt x n + sample
    assert body["top_k"] == -1 and body["top_p"] == 1.0 and body["model"] == "m"
    assert body["logprobs"] == 0 and body["return_token_ids"] is True
    assert body["ignore_eos"] is True and body["stop_token_ids"] == [2]
    assert body["max_tokens"] == 4 and body["temperature"] == 0.7
    # runs of unequal length: one request per run, run k seeded chunk_seed(seed, k)
    bodies = vllm_requests([[1], [1], [3], [1]], SAMPLED, seed=5, model=None)
    assert [(b["prompt"], b["n"], b["seed"], ix) for b, ix in bodies] == [
        ([[1]], 2, 5, [0, 1]), ([[3]], 1, chunk_seed(5, 1), [2]), ([[1]], 1, chunk_seed(5, 2), [3])]
    assert "model" not in bodies[0][0]
    # no seed: the rows as they are, n = 1, no seed field
    (body, indices), = vllm_requests([[1], [1]], SAMPLED, seed=None, model=None)
    assert body["prompt"] == [[1], [1]] and body["n"] == 1 and "seed" not in body


def vllm_reply(prompts, n, with_ids=True):
    """A vLLM completion object for ``prompts`` x ``n``: sample s of prompt p is the tokens
    [p[0], s, 2] (2 ends it: "stop", stop_reason 2), log-probs -(s + 1) / 10 each; choices
    shuffled (the client must order them by index)."""
    choices = []
    for p, prompt in enumerate(prompts):
        for s in range(n):
            ids = [prompt[0], s, 2]
            c = {"index": p * n + s, "text": "", "finish_reason": "stop", "stop_reason": 2,
                 "logprobs": {"text_offset": [0, 0, 0], "token_logprobs": [-(s + 1) / 10] * 3,
                              "tokens": [f"token_id:{t}" for t in ids], "top_logprobs": None}}
            if with_ids:
                c["token_ids"] = ids
            choices.append(c)
    return {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m",
            "choices": choices[::-1], "usage": {}}


def test_vllm_replies_parse_into_completions_in_row_order():
    got = parse_openai(vllm_reply([[5], [9]], 2), 3)
    assert [(c.token_ids, c.logprobs, c.finish_reason, c.weights_version) for c in got] == [
        ([5, 0, 2], [-0.1] * 3, "stop", 3), ([5, 1, 2], [-0.2] * 3, "stop", 3),
        ([9, 0, 2], [-0.1] * 3, "stop", 3), ([9, 1, 2], [-0.2] * 3, "stop", 3)]
    # without token_ids: the "token_id:N" tokens of --return-tokens-as-token-ids
    assert fields(parse_openai(vllm_reply([[5]], 1, with_ids=False), 0)) == [([5, 0, 2], [-0.1] * 3, "stop")]
    bad = vllm_reply([[5]], 1)
    bad["choices"][0]["finish_reason"] = "abort"
    with pytest.raises(UserError, match="finish reason 'abort'"):
        parse_openai(bad, 0)
    bad["choices"][0].update(finish_reason="length", token_ids=[5, 0])
    with pytest.raises(UserError, match="2 tokens but 3 log-probs"):
        parse_openai(bad, 0)


def replaying(replies):
    """A Link that answers each POST /v1/completions from ``replies(body)`` and keeps the
    bodies it was sent (the documented reply shapes above, no network)."""
    sent = []

    def call(route, body, ctype, expect_json):
        sent.append((route, json.loads(body) if body else None))
        return replies(json.loads(body))
    return Link("http://vllm.test", call), sent


def test_vllm_kind_puts_every_choice_back_on_its_row():
    rows = [[5], [5], [7], [9], [9]]                     # runs of 2, 1, 2: one request per run
    link, sent = replaying(lambda b: vllm_reply(b["prompt"], b["n"]))
    outs, version = VLLMKind(model="m").complete(link, rows, SAMPLED, seed=1)
    assert version is None and len(sent) == 3
    assert [c.token_ids for c in outs] == [[5, 0, 2], [5, 1, 2], [7, 0, 2], [9, 0, 2], [9, 1, 2]]


def test_vllm_full_push_rewrites_the_served_checkpoint_and_refuses_shards(tiny, tmp_path):
    _, other, _, _ = tiny
    params = dict(other.named_parameters())
    with pytest.raises(UserError, match="needs model_dir"):
        VLLMKind().push(1, params, "full")
    VLLMKind(model_dir=str(tmp_path)).push(1, params, "full")
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == set(params)
        name = "model.embed_tokens.weight"
        assert torch.equal(f.get_tensor(name), params[name].detach())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]   # no temp left
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"")
    with pytest.raises(UserError, match="other weight files"):
        VLLMKind(model_dir=str(tmp_path)).push(2, params, "full")


# -- SGLang --------------------------------------------------------------------------------

def test_two_runs_push_the_same_lora_version_to_one_vllm_server_under_their_own_names(tmp_path):
    """vLLM refuses to load a lora_name it holds. A server that outlives a run (or two runs
    on one server) saw rlctl-v1 twice: the second run's first push failed. Each client's
    names carry its own tag. The Link below refuses a repeated name as vLLM does (a 4xx:
    UserError, as the engine's HTTP layer raises it)."""
    loaded = set()

    def call(route, body, ctype, expect_json):
        if route == "/v1/load_lora_adapter":
            name = json.loads(body)["lora_name"]
            if name in loaded:
                raise UserError(f"HTTP 400: The lora adapter '{name}' has already been loaded")
            loaded.add(name)
        return {}
    link = Link("http://vllm.test", call)
    adapter = {"model.layers.0.self_attn.q_proj.lora_A": torch.zeros(2, 8),
               "model.layers.0.self_attn.q_proj.lora_B": torch.zeros(8, 2)}
    runs = [VLLMKind(lora_dir=str(tmp_path)) for _ in range(2)]
    for kind in runs:
        kind.push(1, adapter, "adapter")(link)
    assert len(loaded) == 2 and {k.lora.current for k in runs} == loaded
    assert len(list(tmp_path.iterdir())) == 2                      # nor one directory for both


def test_sglang_body_seeds_each_row_and_keeps_the_stop_ids():
    body = sglang_body([[5, 6], [5, 6], [9]], Sampling(4, 0.0, 3, (2,)), seed=8, lora="a1")
    assert body["input_ids"] == [[5, 6], [5, 6], [9]] and body["return_logprob"] is True
    assert body["logprob_start_len"] == -1 and body["lora_path"] == ["a1"] * 3
    params = body["sampling_params"]
    assert [p["sampling_seed"] for p in params] == [8, chunk_seed(8, 1), chunk_seed(8, 2)]
    assert len({p["sampling_seed"] for p in params}) == 3
    assert params[0] == {"max_new_tokens": 4, "temperature": 0.0, "top_k": 3, "top_p": 1.0,
                         "stop_token_ids": [2], "ignore_eos": False, "sampling_seed": 8}
    body = sglang_body([[1]], SAMPLED, seed=None, lora=None)
    assert "sampling_seed" not in body["sampling_params"][0] and "lora_path" not in body
    assert body["sampling_params"][0]["top_k"] == -1


def test_sglang_replies_parse_into_completions():
    reply = [{"text": "", "output_ids": [4, 2],
              "meta_info": {"id": "a", "finish_reason": {"type": "stop", "matched": 2},
                            "output_token_logprobs": [[-0.5, 4, None], [-0.25, 2, None]]}},
             {"text": "", "output_ids": [4, 4, 4],
              "meta_info": {"id": "b", "finish_reason": {"type": "length", "length": 3},
                            "output_token_logprobs": [[-1.0, 4, None]] * 3}}]
    assert fields(parse_sglang(reply, 0)) == [([4, 2], [-0.5, -0.25], "stop"),
                                             ([4, 4, 4], [-1.0] * 3, "length")]
    assert fields(parse_sglang(reply[0], 0)) == [([4, 2], [-0.5, -0.25], "stop")]  # one prompt
    reply[0]["output_ids"] = [4]
    with pytest.raises(UserError, match="disagree"):
        parse_sglang(reply, 0)


def test_sglang_full_pushes_keep_the_newest_two_copies_on_the_shared_disk(tiny, tmp_path):
    """Every full push is a copy of the model under weights_dir; SGLang has loaded it by
    the time the next one is written, so the copies older than the one before go (as
    weight_sync=disk's): a run's pushes filled the disk, a model per step."""
    _, other, _, _ = tiny
    params = dict(other.named_parameters())
    kind = SGLangKind(weights_dir=str(tmp_path))
    (tmp_path / "mine").mkdir()                                     # not the adapter's: kept
    for version in range(1, 5):
        kind.push(version, params, "full")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".rlctl-written.json", "mine", "rlctl-v3", "rlctl-v4"]
    with safe_open(str(tmp_path / "rlctl-v4" / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == set(params)


def test_vllm_and_sglang_write_a_push_in_parts_part_by_part_and_load_it_once_at_the_last(tiny, tmp_path):
    """Full weights in parts: each part a file as it comes (the learner keeps none), one
    reload at the last part; vLLM's files of an earlier push with more parts are removed.
    An adapter's parts are assembled first (PEFT reads one file) and loaded once."""
    _, other, _, _ = tiny
    params = {k: v.detach() for k, v in other.named_parameters()}
    names = list(params)
    parts = lambda n: [{k: params[k] for k in names[i::n]} for i in range(n)]   # noqa: E731
    sent = []
    link = Link("http://x.test", lambda route, body, ctype, expect_json: sent.append(route) or {})
    vllm, sglang = VLLMKind(model_dir=str(tmp_path / "m"), lora_dir=str(tmp_path / "l")), \
        SGLangKind(weights_dir=str(tmp_path / "s"))
    (tmp_path / "m").mkdir()
    for kind, version, n, where in ((vllm, 1, 3, "m"), (vllm, 2, 2, "m"), (sglang, 1, 3, "s/rlctl-v1")):
        pushes = [kind.push(version, part, "full", i, i == n - 1) for i, part in enumerate(parts(n))]
        assert pushes[:-1] == [None] * (n - 1) and not sent
        pushes[-1](link)
        assert len(sent) == (2 if kind is vllm else 1) and sent.clear() is None   # one reload
        got, _ = read_dir(str(tmp_path / where))
        assert set(got) == set(names) and all(torch.equal(got[k], params[k]) for k in names)
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["model-part00001.safetensors",
                                                                  "model.safetensors"]
    adapter = {"model.layers.0.self_attn.q_proj.lora_A": torch.zeros(2, 32),
               "model.layers.0.self_attn.q_proj.lora_B": torch.zeros(32, 2)}
    first, last = ({k: v} for k, v in adapter.items())
    assert vllm.push(3, first, "adapter", 0, False) is None
    vllm.push(3, last, "adapter", 1, True)(link)
    assert sent == ["/v1/load_lora_adapter"]
    with safe_open(str(next((tmp_path / "l").iterdir()) / "adapter_model.safetensors"), framework="pt") as f:
        assert len(f.keys()) == 2


# -- LoRA pushes: PEFT's layout, checked by PEFT itself ------------------------------------

def test_peft_layout_merges_to_the_weights_rlctl_serves(tiny, tmp_path):
    """PEFT loads the adapter directory and merges it; the result must equal rlctl's own
    merge (rollout/weights.py) of the same tensors. float64, so only rounding of the
    products differs (measured 0; allowed 1e-12)."""
    from peft import PeftModel
    model, _, _, _ = tiny
    g = torch.Generator().manual_seed(0)
    names = ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"]
    modules = dict(model.named_modules())
    tensors = {}
    for n in names:
        w = modules[n].weight                                              # [out, in]
        tensors[f"{n}.lora_A"] = torch.randn(4, w.shape[1], generator=g, dtype=torch.float64)
        tensors[f"{n}.lora_B"] = torch.randn(w.shape[0], 4, generator=g, dtype=torch.float64) * 0.1
    write_peft_adapter(tensors, tmp_path / "a")
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert config["r"] == config["lora_alpha"] == 4
    assert config["target_modules"] == sorted(names)
    merged = PeftModel.from_pretrained(copy.deepcopy(model).double(), str(tmp_path / "a")).merge_and_unload()
    ours = copy.deepcopy(model).double()
    load_adapter(ours, tensors, {})
    theirs = dict(merged.named_parameters())
    for name, p in ours.named_parameters():
        assert torch.allclose(theirs[name], p, rtol=0, atol=1e-12), name
    base = dict(copy.deepcopy(model).double().named_parameters())
    assert not torch.allclose(theirs[names[0] + ".weight"], base[names[0] + ".weight"])  # it did merge
    bad = dict(tensors, **{f"{names[1]}.lora_A": torch.zeros(2, 8), f"{names[1]}.lora_B": torch.zeros(8, 2)})
    with pytest.raises(UserError, match="ranks differ"):
        write_peft_adapter(bad, tmp_path / "b")


# -- the rlctl kind end to end -------------------------------------------------------------

def test_rlctl_kind_against_real_servers(tiny, tmp_path):
    model, other, tok, prompts = tiny
    server = ServeThread(tiny_app(model, tok.pad_token_id)[0])
    try:
        kind = RlctlKind()
        engine = ServerEngine([server.url], kind=kind)
        assert kind.probe(engine._link(engine.servers[0], 5.0)) == 0
        local = TorchEngine(model, tok.pad_token_id)
        assert fields(engine.generate(prompts, SAMPLED, seed=2)) == fields(local.generate(prompts, SAMPLED, seed=2))
        engine.update_weights(4, dict(other.named_parameters()))
        after = engine.generate(prompts, SAMPLED, seed=2)
        assert fields(after) == fields(TorchEngine(other, tok.pad_token_id).generate(prompts, SAMPLED, seed=2))
        assert {c.weights_version for c in after} == {4}
        assert engine.health()["servers"][server.url] == {"up": True, "weights_version": 4}
    finally:
        server.stop()


# -- real vLLM / SGLang servers (only where one is named) ----------------------------------

def _real(var: str) -> str:
    url = os.environ.get(var)
    if not url:
        pytest.skip(f"{var} is not set: no real server to run against (vLLM and SGLang need a "
                    "GPU; this adapter is written to their documented APIs)")
    return url


@pytest.mark.parametrize("var, kind", [("RLCTL_VLLM_URL", "vllm"), ("RLCTL_SGLANG_URL", "sglang")])
def test_a_real_server_of_the_kind_generates(var, kind):
    """Token ids below 100 exist in every real vocabulary; 16 tokens at temperature 1."""
    engine = ServerEngine([_real(var)], kind=kind, chunk_size=4)
    rows = [[10, 11, 12]] * 4 + [[20, 21]] * 4
    outs = engine.generate(rows, Sampling(16, 1.0, 0, ()), seed=0)
    assert len(outs) == 8
    for c in outs:
        assert c.finish_reason in ("stop", "length") and 1 <= len(c.token_ids) <= 16
        assert len(c.logprobs) == len(c.token_ids) and all(lp <= 0 for lp in c.logprobs)
    assert len({tuple(c.token_ids) for c in outs[:4]}) > 1     # seeded samples still differ


# -- a server of another kind than configured ----------------------------------------------

class _Stdlib:
    """A real stdlib HTTP server on 127.0.0.1 (a thread of this process)."""

    def serve(self, handler):
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


class _Other(_Stdlib):
    """A real HTTP server on 127.0.0.1 answering fixed JSON per route (``replies``):
    what a server of another kind sends an rlctl-kind client."""

    def __init__(self, replies):
        class Handler(http.server.BaseHTTPRequestHandler):
            def _reply(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                data = json.dumps(replies[self.path.split("?")[0]]).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            do_GET = do_POST = _reply

            def log_message(self, *args):
                pass
        self.serve(Handler)


def test_replies_of_another_kind_are_one_line_naming_the_server_and_the_kind(tiny):
    """vLLM's GET /version ({"version": ...}) read as rlctl's probe; an OpenAI reply with no
    log-probs read as rlctl's completions (from a worker thread, where an error must reach
    the caller: it was printed as a thread's traceback and its request left out); a reply
    with fewer completions than prompts (the rows would shift onto other prompts)."""
    _, _, _, prompts = tiny
    vllm = _Other({"/version": {"version": "0.10.2"}})
    plain = _Other({"/version": {"weights_version": 0}, "/v1/completions": {
        "choices": [{"index": 0, "text": " 1 2 3", "finish_reason": "stop", "logprobs": None}]}})
    short = _Other({"/version": {"weights_version": 0}, "/v1/completions": {   # one choice, rows left out
        "choices": [{"index": 0, "token_ids": [2], "finish_reason": "stop",
                     "logprobs": {"token_logprobs": [-0.5]}}], "weights_version": 0}})
    try:
        with pytest.raises(UserError) as err:
            ServerEngine([vllm.url])
        assert vllm.url in str(err.value) and "rollout.server.kind" in str(err.value)
        engine = ServerEngine([plain.url], chunk_size=2)
        with pytest.raises(UserError) as err:
            engine.generate(prompts, SAMPLED, seed=0)
        assert plain.url in str(err.value) and "rollout.server.kind" in str(err.value)
        assert "\n" not in str(err.value)
        with pytest.raises(UserError, match="answered 1 completions for a request of 2 prompts"):
            ServerEngine([short.url], chunk_size=2).generate(prompts, SAMPLED, seed=0)
    finally:
        for server in (vllm, plain, short):
            server.close()


# -- rlctl train with kind=sglang: the config's directories reach the adapter -----------------

class _SGLangLike(_Stdlib):
    """A real HTTP server on 127.0.0.1 speaking SGLang's documented routes: GET /health
    (empty 200), POST /generate (each row completes with ``stop`` at once, log-prob -0.5),
    POST /update_weights_from_disk (recorded, ``{"success": true}``)."""

    def __init__(self, stop: int):
        pushes = self.pushes = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def _send(self, data: bytes):
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._send(b"")

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/update_weights_from_disk":
                    pushes.append(body)
                    reply = {"success": True, "message": "ok"}
                else:
                    reply = [{"text": "", "output_ids": [stop], "meta_info": {
                        "finish_reason": {"type": "stop", "matched": stop},
                        "output_token_logprobs": [[-0.5, stop, None]]}} for _ in body["input_ids"]]
                self._send(json.dumps(reply).encode())

            def log_message(self, *args):
                pass
        self.serve(Handler)


def test_rlctl_train_with_kind_sglang_pushes_through_weight_dir(tiny, tmp_path, rlctl_app):
    """``rollout.server.weight_dir`` reaches the sglang adapter (it was built with no
    directory: the first push failed with 'needs weights_dir'). Two steps push versions 1
    and 2 (the first is one past the server's 0), each a model.safetensors under weight_dir holding every policy parameter."""
    _, _, tok, _ = tiny
    server = _SGLangLike(int(tok.eos_token_id))
    shared = tmp_path / "shared"
    try:
        out = rlctl_app("train", "trainer.steps=2", "trainer.prompts_per_step=2", "algo.group_size=2",
                        "trainer.eval_every=0", "task.reward_timeout_s=0", "logger=jsonl",
                        "logger.console=false", "run.save_model=false", "rollout.engine=server",
                        "rollout.server.kind=sglang", f"rollout.server.urls=[{server.url}]",
                        f"rollout.server.weight_dir={shared}", f"run.output_dir={tmp_path / 'runs'}")
    finally:
        server.close()
    assert out.returncode == 0, out.stderr[-2000:]
    assert [p["weight_version"] for p in server.pushes] == ["1", "2"]
    m = compose([]).cfg.model                      # the run's model: its sizes, any seed
    shapes = {n: tuple(p.shape) for n, p in build_model(tok, hidden_size=m.hidden_size, num_layers=m.num_layers,
                                                       num_heads=m.num_heads, seed=0).named_parameters()}
    for push in server.pushes:
        path = shared / f"rlctl-v{push['weight_version']}" / "model.safetensors"
        assert push["model_path"] == str(path.parent)
        with safe_open(str(path), "pt") as f:
            assert {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()} == shapes
