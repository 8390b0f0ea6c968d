"""The server engine (rlctl/rollout/engines/server.py) against real `rlctl serve` apps on
127.0.0.1 (uvicorn in threads of this process: tests/rollout/serving.py), compared with
the torch engine on the same weights.

Tolerance: none. The server runs the torch engine's code on the same tensors in this
process, and the log-probs travel as JSON numbers, which Python writes and reads back as
the same IEEE doubles, so tokens and log-probs must be equal, not close."""
import json
import urllib.error
import urllib.request

import pytest
import torch

from rlctl.errors import UserError
from rlctl.demo.tiny import build_model, build_tokenizer
from rlctl.rollout.engines.protocol import Sampling, TorchEngine, chunk_seed
from rlctl.rollout.engines.server import ServerEngine
from rlctl.rollout.engines.protocol import to_bytes

from serving import ServeThread, tiny_app

TEXTS = ["3 1 2 :", "3 1 2 :", "9 :", "9 :", "4 4 1 2 :", "4 4 1 2 :"]
SAMPLED = Sampling(8, 1.2, 0, (2,))


@pytest.fixture(scope="module")
def tiny():
    tok = build_tokenizer()
    model = build_model(tok, hidden_size=32, num_layers=2, num_heads=4, seed=0).eval()
    other = build_model(tok, hidden_size=32, num_layers=2, num_heads=4, seed=1).eval()
    return model, other, tok, [tok(t)["input_ids"] for t in TEXTS]


@pytest.fixture
def two(tiny):
    model, _, tok, _ = tiny
    servers = [(ServeThread(app), engine) for app, engine in
               (tiny_app(model, tok.pad_token_id) for _ in range(2))]
    yield servers
    for s, _ in servers:
        if s.thread.is_alive():
            s.stop()


def fields(outs):
    return [(c.token_ids, c.logprobs, c.finish_reason) for c in outs]


def by_chunks(engine, prompts, sampling, seed, size):
    """The torch engine run request by request, as the server engine cuts the batch."""
    return [c for j in range(0, len(prompts), size)
            for c in engine.generate(prompts[j:j + size], sampling, chunk_seed(seed, j // size))]


def test_one_and_two_servers_equal_the_torch_engine(tiny, two):
    model, _, tok, prompts = tiny
    local = TorchEngine(model, tok.pad_token_id)
    one = ServerEngine([two[0][0].url], chunk_size=64)
    both = ServerEngine([s.url for s, _ in two], chunk_size=2)
    greedy = Sampling(8, 0.0, 0, (2,))
    assert fields(one.generate(prompts, greedy)) == fields(local.generate(prompts, greedy))
    chunked = both.generate(prompts, greedy)
    assert fields(chunked) == fields(by_chunks(local, prompts, greedy, None, 2))
    # against the whole batch: other left padding, so float32 rounding differs (measured
    # 3e-7 at log-probs near -2.4); the argmax tokens are the same
    whole = local.generate(prompts, greedy)
    assert [c.token_ids for c in chunked] == [c.token_ids for c in whole]
    assert max(abs(a - b) for c, w in zip(chunked, whole) for a, b in zip(c.logprobs, w.logprobs)) < 1e-5
    # one request: the torch engine's own seed; three requests of 2: their chunk seeds
    assert fields(one.generate(prompts, SAMPLED, seed=4)) == fields(local.generate(prompts, SAMPLED, seed=4))
    calls = [e.calls for _, e in two]
    got = both.generate(prompts, SAMPLED, seed=4)
    assert fields(got) == fields(by_chunks(local, prompts, SAMPLED, 4, 2))
    assert all(e.calls > c for (_, e), c in zip(two, calls))         # both servers served
    alone = ServerEngine([two[1][0].url], chunk_size=2).generate(prompts, SAMPLED, seed=4)
    assert fields(alone) == fields(got)                              # not the server count


def test_weight_push_serves_the_new_weights(tiny, two, tmp_path):
    model, other, tok, prompts = tiny
    engine = ServerEngine([s.url for s, _ in two], chunk_size=2)
    before = engine.generate(prompts, SAMPLED, seed=1)
    engine.update_weights(1, dict(other.named_parameters()))
    want = by_chunks(TorchEngine(other, tok.pad_token_id), prompts, SAMPLED, 1, 2)
    after = engine.generate(prompts, SAMPLED, seed=1)
    assert fields(after) == fields(want) and fields(after) != fields(before)
    assert {c.weights_version for c in after} == {1}
    (tmp_path / "w.safetensors").write_bytes(to_bytes(dict(model.named_parameters())))
    engine.update_weights_from_disk(2, str(tmp_path))                # back to the first model
    want = by_chunks(TorchEngine(model, tok.pad_token_id), prompts, SAMPLED, 1, 2)
    assert fields(engine.generate(prompts, SAMPLED, seed=1)) == fields(want)
    for s, _ in two:
        assert json.loads(urllib.request.urlopen(s.url + "/version").read()) == {"weights_version": 2}


def test_a_lost_server_is_named_its_requests_go_to_the_other_and_it_comes_back(tiny, two):
    model, other, tok, prompts = tiny
    lines = []
    engine = ServerEngine([s.url for s, _ in two], chunk_size=2, recheck_s=0.0, say=lines.append)
    engine.update_weights(1, dict(other.named_parameters()))
    want = fields(by_chunks(TorchEngine(other, tok.pad_token_id), prompts, SAMPLED, 9, 2))
    lost, _ = two[0]
    lost.stop()
    assert fields(engine.generate(prompts, SAMPLED, seed=9)) == want
    assert len(lines) == 1 and lost.url in lines[0] and "lost" in lines[0]
    app, restarted = tiny_app(model, tok.pad_token_id)                # the old weights (v0)
    lost.start(app)
    assert fields(engine.generate(prompts, SAMPLED, seed=9)) == want  # sent v1, then used
    assert restarted.version == 1 and restarted.calls > 0
    assert "is back" in lines[-1] and lost.url in lines[-1]


def _restart_unseen(server, model, tok):
    """``server`` stopped and started again on its port, serving ``model`` as loaded
    (version 0), with no call in between: the client never sees it lost. Its engine."""
    server.stop()
    app, engine = tiny_app(model, tok.pad_token_id)
    server.start(app)
    return engine


def test_a_server_with_old_weights_is_not_used_past_max_staleness(tiny, two):
    model, other, tok, prompts = tiny
    lines = []
    engine = ServerEngine([s.url for s, _ in two], chunk_size=2, max_staleness=0,
                          recheck_s=3600.0, say=lines.append)
    engine.update_weights(1, dict(other.named_parameters()))
    quick, _ = two[0]
    restarted = _restart_unseen(quick, model, tok)        # between two calls: never seen lost
    want = fields(by_chunks(TorchEngine(other, tok.pad_token_id), prompts, SAMPLED, 3, 2))
    assert fields(engine.generate(prompts, SAMPLED, seed=3)) == want  # v0 replies discarded
    assert any("weights version 0" in l and quick.url in l for l in lines)
    assert restarted.version == 0 and two[1][1].calls >= 3


def test_a_server_back_within_max_staleness_is_sent_the_newest_weights_first(tiny, two):
    """A server that missed a push (down while it went out) and comes back with the
    version before it is within max_staleness=1 of the newest push; it must still be sent
    that push before it serves: the rows the learner reads one update later would
    otherwise be two updates old. Its requests then equal the newest weights' exactly."""
    model, other, tok, prompts = tiny
    lines = []
    engine = ServerEngine([s.url for s, _ in two], chunk_size=2, max_staleness=1,
                          recheck_s=0.0, say=lines.append)
    engine.update_weights(1, dict(other.named_parameters()))
    missed, _ = two[1]
    missed.stop()
    engine.update_weights(2, dict(model.named_parameters()))           # lost: misses v2
    assert any("lost" in ln and missed.url in ln for ln in lines)
    app, back = tiny_app(model, tok.pad_token_id)
    back.update_weights(1, dict(other.named_parameters()))             # back, still at v1
    missed.start(app)
    want = fields(by_chunks(TorchEngine(model, tok.pad_token_id), prompts, SAMPLED, 5, 2))
    assert fields(engine.generate(prompts, SAMPLED, seed=5)) == want
    assert back.version == 2 and back.calls > 0 and engine.servers[1].weights_version == 2


def test_a_server_restarted_unseen_within_max_staleness_is_sent_the_newest_weights(tiny, two):
    """Server A is restarted between two calls, unseen, on another model: it reports 0,
    within max_staleness=1 of push 1, yet its 0 is not the learner's version 0 (a
    version that went back is a restart: whatever it loaded). Its reply is discarded
    and it is sent push 1 before it serves again. Before, its rows (the other model's)
    were used as version 0. Exact: the same sampler code on the same weights."""
    model, other, tok, prompts = tiny
    lines = []
    engine = ServerEngine([s.url for s, _ in two], chunk_size=2, max_staleness=1,
                          recheck_s=3600.0, say=lines.append)
    engine.update_weights(1, dict(other.named_parameters()))
    quick, _ = two[0]
    restarted = _restart_unseen(quick, model, tok)                    # its own load, v0
    want = by_chunks(TorchEngine(other, tok.pad_token_id), prompts, SAMPLED, 3, 2)
    got = engine.generate(prompts, SAMPLED, seed=3)
    assert fields(got) == fields(want) and {c.weights_version for c in got} == {1}
    assert any(quick.url in ln and "restarted" in ln for ln in lines)
    calls = restarted.calls
    assert fields(engine.generate(prompts, SAMPLED, seed=3)) == fields(want)
    assert restarted.version == 1 and restarted.calls > calls          # sent v1, used again


def test_the_only_server_restarted_unseen_is_sent_the_newest_weights_not_given_up(tiny, two):
    """One server, max_staleness=0, restarted unseen: its stale reply is discarded and,
    no other server being left, it is sent the newest push and asked again (it was
    NoServerLeft while a usable server stood there needing only the push)."""
    model, other, tok, prompts = tiny
    only, _ = two[0]
    engine = ServerEngine([only.url], chunk_size=2, recheck_s=3600.0, say=lambda m: None)
    engine.update_weights(1, dict(other.named_parameters()))
    restarted = _restart_unseen(only, model, tok)
    want = by_chunks(TorchEngine(other, tok.pad_token_id), prompts, SAMPLED, 3, 2)
    assert fields(engine.generate(prompts, SAMPLED, seed=3)) == fields(want)
    assert restarted.version == 1


def post(url, body, ctype="application/json"):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": ctype})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.parametrize("body, message", [
    ({"prompt": [1, 99], "max_tokens": 4}, r"token ids are integers in [0, 19)"),
    ({"prompt": [1, 5], "max_tokens": 0}, "max_tokens must be an integer >= 1"),
    ({"prompt": "3 1 2", "max_tokens": 4}, "does not tokenize text"),
    ({"prompt": [1, 5], "logprobs": 5}, "logprobs must be 0 or 1"),
    ({"prompt": [1, 5], "top_p": 0.9}, "top_p must be 1.0"),
    ({"prompt": [1, 5], "best_of": 2}, "unknown field 'best_of'"),
])
def test_bad_requests_are_a_400_with_one_message(two, body, message):
    code, reply = post(two[0][0].url + "/v1/completions", body)
    assert code == 400 and message in reply["error"]["message"]
    assert "\n" not in reply["error"]["message"]


def test_bad_weights_and_old_versions_are_refused(tiny, two):
    model, other, _, prompts = tiny
    url = two[0][0].url
    assert post(url + "/update_weights?version=1", b"not safetensors", "application/octet-stream")[0] == 400
    code, reply = post(url + "/update_weights?version=1",
                       to_bytes({"lm_head.weight": other.lm_head.weight}), "application/octet-stream")
    assert code == 400 and "missing" in reply["error"]["message"]
    good = to_bytes(dict(other.named_parameters()))
    assert post(url + "/update_weights?version=2", good, "application/octet-stream")[0] == 200
    code, reply = post(url + "/update_weights?version=1", good, "application/octet-stream")
    assert code == 409 and "older than the served version 2" in reply["error"]["message"]
    with pytest.raises(UserError, match=r"HTTP 400: prompt 0 holds 99"):
        ServerEngine([url]).generate([[1, 99]], Sampling(4))


def test_completion_fields_are_the_vllm_subset(tiny, two):
    _, _, tok, prompts = tiny
    code, reply = post(two[0][0].url + "/v1/completions",
                       {"prompt": prompts[:2], "n": 2, "max_tokens": 3, "logprobs": 0,
                        "temperature": 1.0, "seed": 0, "stop_token_ids": [], "ignore_eos": True})
    assert code == 200 and reply["object"] == "text_completion"
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2, 3]     # prompt * n + sample
    for c in reply["choices"]:
        assert len(c["token_ids"]) == 3 and c["finish_reason"] == "length"
        assert c["logprobs"]["tokens"] == [f"token_id:{t}" for t in c["token_ids"]]
        assert len(c["logprobs"]["token_logprobs"]) == 3
    assert reply["usage"]["completion_tokens"] == 12
    assert reply["usage"]["prompt_tokens"] == 2 * (len(prompts[0]) + len(prompts[1]))
    health = json.loads(urllib.request.urlopen(two[0][0].url + "/health").read())
    assert health == {"status": "ok", "weights_version": 0}
