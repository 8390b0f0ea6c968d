"""Training against engines (rlctl/rollout/engines/engine_source.py): the torch engine in this
process, one and two real `rlctl serve` apps on 127.0.0.1 (uvicorn threads:
tests/rollout/serving.py), and servers the run starts itself.

Tolerance of the equality tests: none. At max_staleness=0 the learner recomputes pi_old
itself, so a step depends on the rollout's tokens, rewards and masks alone. Each engine
runs the same sampler code on the same weights (pushed as safetensors: a bit-exact copy)
with the same request seeds and the same chunking, and the log-probs travel as JSON
numbers, which round-trip IEEE doubles exactly; so every metric must be equal."""
import copy
import json
import threading
import time

import pytest
import torch
from omegaconf import OmegaConf

from rlctl.config.compose import compose
from rlctl.config.checks import validate
from rlctl.errors import ConfigError, UserError
from rlctl.train.trainer import Trainer
from rlctl.models.loading import load_model_and_tokenizer
from rlctl.models.lora import apply_lora
from rlctl.rollout.engines.protocol import Sampling, TorchEngine
from rlctl.rollout.engines.engine_source import CLOSE_WAIT_S, EngineSource, policy_weights
from rlctl.rollout.engines.serve_app import build_app
from rlctl.rollout.engines.server import ServerEngine
from rlctl.train.build import prepare_task
from rlctl.train.preflight import check_episodes
from rlctl.train.sources import build_source, weight_buckets
from rlctl.sinks import NullSink

from serving import ChunkedEngine, ServeThread, tiny_app

BASE = ["trainer.prompts_per_step=4", "algo.group_size=4", "trainer.eval_every=3", "trainer.lr=1e-3",
        "trainer.steps=3", "rollout.server.chunk_size=4"]     # N = 16 rows: 4 requests of 4


def _cfg(overrides):
    cfg = compose(BASE + list(overrides)).cfg
    OmegaConf.resolve(cfg)
    return cfg


def _model(cfg):
    model, tok = load_model_and_tokenizer("tiny", **{k: v for k, v in dict(cfg.model).items() if k != "name"})
    return model, tok


@pytest.fixture(scope="module")
def tiny():
    cfg = _cfg([])
    model, tok = _model(cfg)
    servers = [ServeThread(tiny_app(model, tok.pad_token_id, (tok.eos_token_id,))[0]) for _ in range(2)]
    yield model, tok, servers
    for s in servers:
        if s.thread.is_alive():
            s.stop()


def _train(cfg, engine_for, steps=3):
    """``steps`` metrics of a Trainer whose source is an EngineSource on ``engine_for(model,
    tok)`` (None: the source the config asks for, from build_source)."""
    model, tok = _model(cfg)
    task = prepare_task(cfg, tok, model, quiet=True)
    torch.manual_seed(0)
    if engine_for is None:
        source = build_source(cfg, model, tok, task)
    else:
        source = EngineSource(engine_for(model, tok), model, tok, list(task.train), task.scorer(),
                              cfg.rollout, cfg.algo.group_size, cfg.trainer.async_rollout,
                              seed=cfg.seed * 1000, gather=weight_buckets(cfg.hardware))
    tr = Trainer.from_config(cfg, model, tok, task, NullSink(), source=source)
    try:
        metrics = [tr.step(i) for i in range(1, steps + 1)]
        metrics[-1].update(tr._evaluate(steps))                 # what train() logs at an eval step
        return metrics
    finally:
        tr.close()


def _differ(a, b):
    keys = [k for k in a if not k.startswith(("time/", "perf/", "engine/"))]
    assert keys and all(k in b for k in keys)
    return {k: (a[k], b[k]) for k in keys if a[k] != b[k]}


def test_torch_engine_one_and_two_servers_train_alike(tiny, tmp_path):
    _, _, servers = tiny
    cfg = _cfg([])
    urls = [s.url for s in servers]
    here = _train(cfg, lambda m, tok: ChunkedEngine(copy.deepcopy(m), tok.pad_token_id, 4))
    one = _train(_cfg(["rollout.engine=server", f"rollout.server.urls=[{urls[0]}]"]), None)
    two = _train(cfg, lambda m, tok: ServerEngine(urls, chunk_size=4))
    disk = _train(_cfg(["rollout.engine=server", f"rollout.server.urls=[{urls[1]}]",
                        "rollout.server.weight_sync=disk", f"rollout.server.weight_dir={tmp_path}"]), None)
    for h, o, t, d in zip(here, one, two, disk):
        assert _differ(h, o) == {} and _differ(h, t) == {} and _differ(h, d) == {}
        assert h["async/staleness"] == 0
    assert "eval/exact_match" in here[-1]                      # the held-out result, equal too
    assert _differ(here[0], here[1]) != {}                     # the steps do differ (can fail)
    kept = sorted(int(p.name[1:]) for p in tmp_path.glob("v*"))      # the servers outlive runs:
    assert len(kept) == 2 and kept[1] == kept[0] + 1 >= 3            # versions go on; older removed


def test_one_server_lost_mid_run_the_run_finishes_on_the_other_and_it_comes_back(tiny):
    model, tok, _ = tiny
    apps = [tiny_app(model, tok.pad_token_id, (tok.eos_token_id,)) for _ in range(2)]
    servers = [ServeThread(app) for app, _ in apps]
    lines = []
    # rewards scored inline: a forked reward worker would inherit the test servers'
    # listening sockets and keep a stopped server's port open (its requests would hang)
    cfg = _cfg(["task.reward_timeout_s=0"])
    engines = []

    def engine_for(m, t):
        engines.append(ServerEngine([s.url for s in servers], chunk_size=4, recheck_s=0.0, timeout_s=20.0, say=lines.append))
        return engines[-1]
    model2, tok2 = _model(cfg)
    task = prepare_task(cfg, tok2, model2, quiet=True)
    source = EngineSource(engine_for(model2, tok2), model2, tok2, list(task.train), task.scorer(),
                          cfg.rollout, cfg.algo.group_size, cfg.trainer.async_rollout, seed=0,
                          gather=weight_buckets(cfg.hardware))
    tr = Trainer.from_config(cfg, model2, tok2, task, NullSink(), source=source)
    try:
        first = tr.step(1)
        assert first["engine/servers_up"] == 2
        servers[1].stop()
        lost = tr.step(2)                                       # on the other server alone
        assert [ln for ln in lines if "lost" in ln] == [
            next(ln for ln in lines if "lost" in ln)]           # one line
        assert servers[1].url in lines[0] and "its requests go to the other 1" in lines[0]
        assert lost["engine/servers_up"] == 1 and 0 <= lost["reward/mean"] <= 1
        calls = apps[1][1].calls
        servers[1].start(apps[1][0])                            # restarted on its port
        back = tr.step(3)
        assert any(servers[1].url in ln and "is back" in ln for ln in lines)
        assert back["engine/servers_up"] == 2 and apps[1][1].calls > calls   # it serves again
        b = engines[0].servers[1]
        assert b.up and b.weights_version == engines[0].version == 3         # the newest: 1 + 2 updates
    finally:
        tr.close()
        for s in servers:
            if s.thread.is_alive():
                s.stop()


def test_a_server_restarted_unseen_before_its_first_use_is_not_taken_for_the_learners(tiny):
    """The learner's weights differ from what the servers load. Server A is restarted on
    its port between two requests, unseen (no failed call): it reports 0, its own load.
    The first push is one past the engines' count, so A's 0 reads as stale and B serves
    the request; the rows equal those of a run on one server that was never restarted
    (exact, see the module docstring). With the first push at 0, A's base-model rows
    were taken as the learner's."""
    model, tok, _ = tiny
    cfg = _cfg(["task.reward_timeout_s=0"])        # inline: a forked worker keeps ports open
    task = prepare_task(cfg, tok, model, quiet=True)
    learner = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in learner.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    app = lambda: tiny_app(model, tok.pad_token_id, (tok.eos_token_id,))[0]   # noqa: E731
    servers = {name: ServeThread(app()) for name in ("ref", "a", "b")}
    lines = []

    def source(urls):
        engine = ServerEngine(urls, chunk_size=4, recheck_s=0.0, timeout_s=20.0, say=lines.append)
        return EngineSource(engine, learner, tok, list(task.train), task.scorer(),
                            cfg.rollout, cfg.algo.group_size, cfg.trainer.async_rollout, seed=0,
                            gather=weight_buckets(cfg.hardware))
    ref, two = source([servers["ref"].url]), source([servers["a"].url, servers["b"].url])
    try:
        batches = {}
        for name, src in (("ref", ref), ("two", two)):
            src.sample(4)
            if name == "two":
                servers["a"].stop()
                servers["a"].start(app())                # same port, its own load again
            batches[name] = src.sample(4)
        assert batches["two"].completions == batches["ref"].completions
        assert torch.equal(batches["two"].input_ids, batches["ref"].input_ids)
        assert any(servers["a"].url in ln and "weights version 0" in ln for ln in lines)
    finally:
        ref.close()
        two.close()
        for s in servers.values():
            s.stop()


def test_one_request_ahead_is_one_update_stale_and_uses_the_engine_logprobs(tiny):
    _, _, servers = tiny
    cfg = _cfg(["trainer.async_rollout.enabled=true", "trainer.async_rollout.max_staleness=1"])
    steps = _train(cfg, lambda m, tok: ServerEngine([servers[0].url], max_staleness=1, chunk_size=4))
    assert [s["async/staleness"] for s in steps] == [0, 1, 1]
    assert "policy/ratio_std" not in steps[0]                 # on-policy: pi_old is the learner's
    assert steps[2]["policy/ratio_std"] > 0                    # stale: pi / pi_engine != 1


class _HangsAfterFirst(TorchEngine):
    """The torch engine; every generate after the first waits for ``release`` (a server
    that stops answering while a request is ahead)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls, self.release = 0, threading.Event()

    def generate(self, *args, **kwargs):
        self.calls += 1
        if self.calls > 1:
            self.release.wait()
        return super().generate(*args, **kwargs)


def test_closing_with_a_request_ahead_on_a_hung_server_does_not_wait_for_it(tiny):
    """One request ahead, its server hung (request limit 300 s). close() waits
    CLOSE_WAIT_S at most, then leaves the request to its daemon thread (an executor's
    threads are joined at exit: the run's end was held until the request gave up). The
    hang is released after 60 s at the latest, so the old code ends and fails here."""
    model, tok, _ = tiny
    cfg = _cfg(["task.reward_timeout_s=0", "trainer.async_rollout.enabled=true",
                "trainer.async_rollout.max_staleness=1"])
    task = prepare_task(cfg, tok, model, quiet=True)
    engine = _HangsAfterFirst(copy.deepcopy(model), tok.pad_token_id)
    server = ServeThread(build_app(engine, "tiny", default_stops=(tok.eos_token_id,)))
    release = threading.Timer(60.0, engine.release.set)
    release.start()
    try:
        source = EngineSource(ServerEngine([server.url], max_staleness=1, chunk_size=16, timeout_s=300.0),
                              model, tok, list(task.train), task.scorer(),
                              cfg.rollout, cfg.algo.group_size, cfg.trainer.async_rollout, seed=0,
                              gather=weight_buckets(cfg.hardware))
        source.sample(4)                              # answered; the next request is ahead, hung
        deadline = time.monotonic() + 10.0
        while engine.calls < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.calls == 2
        t0 = time.monotonic()
        source.close()
        assert time.monotonic() - t0 < CLOSE_WAIT_S + 10.0 < 60.0
    finally:
        engine.release.set()
        release.cancel()
        server.stop()


def test_a_lora_policy_pushes_its_adapter_and_the_engine_serves_the_adapted_model():
    """float64 throughout: the engine merges W0 + B A while peft computes x W0^T +
    scale (x A^T) B^T, equal up to float64 rounding (~1e-15 per product, far below 1e-9)."""
    cfg = _cfg([])
    base, tok = _model(cfg)
    base = base.double()
    served = TorchEngine(copy.deepcopy(base), tok.pad_token_id)
    torch.manual_seed(3)
    policy = apply_lora(base, 4, 8, 0.0, ["all-linear"])
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)                               # B starts at zero: make it count
    [(tensors, kind)] = policy_weights(policy, weight_buckets(cfg.hardware))
    assert kind == "adapter" and tensors and all(k.endswith(("lora_A", "lora_B")) for k in tensors)
    served.update_weights(1, tensors, kind)
    prompt = tok("3 1 2 :")["input_ids"]
    out = served.generate([prompt], Sampling(6, 1.0, 0, (tok.eos_token_id,)), seed=0)[0]
    ids = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        logits = policy(input_ids=ids).logits[0, len(prompt) - 1:-1]              # [T, V]
    want = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt):, None])[:, 0]
    assert max(abs(a - b) for a, b in zip(out.logprobs, want.tolist())) < 1e-9


def test_full_weights_are_the_language_model_alone(tiny):
    model, _, _ = tiny
    [(tensors, kind)] = policy_weights(model, weight_buckets(_cfg([]).hardware))
    assert kind == "full" and set(tensors) == {n for n, _ in model.named_parameters()}
    name = next(iter(tensors))
    assert tensors[name].data_ptr() != dict(model.named_parameters())[name].data_ptr()   # a copy


def test_the_run_starts_its_own_servers_survives_one_killed_and_stops_them(capfd):
    """Real processes: two `rlctl serve` children of the run; one is SIGKILLed between two
    requests; the next request goes to the other, one line naming the lost one."""
    cfg = _cfg(["rollout.engine=server", "rollout.server.num_local=2"])
    model, tok = _model(cfg)
    task = prepare_task(cfg, tok, model, quiet=True)
    source = build_source(cfg, model, tok, task)
    procs = source.on_close.__self__.procs
    try:
        assert source.sample(2).input_ids.shape[0] == 8
        dead = source.engine.servers[0].url
        assert dead.startswith("http://127.0.0.1:")
        procs[0].kill()
        procs[0].join(10)
        batch = source.sample(2)
        assert batch.input_ids.shape[0] == 8 and bool((batch.logprobs.staleness == 0).all())
        said = [ln for ln in capfd.readouterr().err.splitlines() if "rollout server" in ln]
        assert len(said) == 1 and dead in said[0] and "lost" in said[0]
    finally:
        source.close()
    assert not any(p.is_alive() for p in procs)


URL = "rollout.server.urls=[http://127.0.0.1:9]"


@pytest.mark.parametrize("overrides, match", [
    (["hardware.num_processes=2"], "one learner process"),
    (["rollout.server.weight_sync=disk"], "weight_dir"),
    (["rollout.server.urls=[node1:8000]"], "http://HOST:PORT"),
    (["rollout.sample_dtype=bfloat16"], "its own precision"),
    (["rollout.server.weight_sync=ftp"], "http, disk"),
    (["rollout.server.kind=tgi"], "valid: rlctl, vllm, sglang"),          # before a run directory
    (["rollout.server.kind=vllm"], "needs rollout.server.urls"),          # not after spawning rlctl serve
    (["rollout.server.kind=vllm", URL], "needs rollout.server.model_dir"),      # before the first push
    (["rollout.server.kind=vllm", URL, "rollout.server.model_dir=/no/such/dir"], "is not a directory here"),
    (["rollout.server.kind=vllm", URL, "model.lora.enabled=true"], "needs rollout.server.weight_dir"),
    (["rollout.server.kind=sglang", URL], "needs rollout.server.weight_dir"),
    (["rollout.server.kind=sglang", URL, "rollout.server.weight_sync=disk",
      "rollout.server.weight_dir=/x"], "weight_sync=disk is for kind=rlctl"),
])
def test_bad_server_settings_are_one_line(overrides, match):
    with pytest.raises(ConfigError, match=match):
        validate(compose(BASE + ["rollout.engine=server"] + overrides).cfg)


def test_an_unknown_engine_is_refused_with_the_valid_ones():
    with pytest.raises(ConfigError, match="torch, server"):
        validate(compose(BASE + ["rollout.engine=vllm"]).cfg)


def test_an_episodic_task_is_refused_with_the_server_engine():
    """Refused before a run directory is made (rlctl.train.preflight, called by run_training)."""
    cfg = _cfg(["task=guess_number", "rollout.engine=server", "rollout.server.urls=[http://127.0.0.1:9]"])
    task = prepare_task(cfg, None, None).task    # no model: no budget
    with pytest.raises(UserError, match="episodes"):
        check_episodes(cfg.rollout, task)
    check_episodes(_cfg(["task=guess_number"]).rollout, task)          # the torch engine: fine


RESUME = ["trainer.prompts_per_step=4", "algo.group_size=4", "trainer.lr=1e-2", "trainer.eval_every=2",
          "task.num_eval=8", "trainer.checkpoint_every=2", "logger=jsonl", "logger.console=false",
          "run.save_model=false", "task.reward_timeout_s=0", "rollout.engine=server",
          "rollout.server.chunk_size=4"]


def _step_rows(run):
    rows = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "step" in row:              # the resumed run's rows replace those it redoes
            rows[row["step"]] = {k: v for k, v in row.items()
                                 if not k.startswith(("time/", "perf/", "engine/"))}
    return rows


def test_a_run_stopped_at_its_checkpoint_and_resumed_matches_an_uninterrupted_one(tiny, tmp_path, rlctl_app):
    """max_staleness=0 against one server that outlives the runs: 4 steps at once, and 2
    steps (checkpoint at 2) resumed to 4. The resumed learner loads step 2's weights
    after its source was built, so the server must be sent those, not the ones the
    learner was built with. Exact equality (see the module docstring)."""
    _, _, servers = tiny
    args = RESUME + [f"rollout.server.urls=[{servers[0].url}]"]
    runs = {}
    for name, steps in (("full", 4), ("part", 2)):
        out = rlctl_app("train", *args, f"trainer.steps={steps}", f"run.output_dir={tmp_path / name}")
        assert out.returncode == 0, out.stderr[-2000:]
        runs[name] = next((tmp_path / name).iterdir())
    out = rlctl_app("train", "--resume", str(runs["part"]), "trainer.steps=4")
    assert out.returncode == 0, out.stderr[-2000:]
    full, resumed = _step_rows(runs["full"]), _step_rows(runs["part"])
    assert sorted(full) == sorted(resumed) == [0, 1, 2, 3, 4]
    assert full[3] != full[4]                                   # the steps do differ (can fail)
    for step in full:
        assert resumed[step] == full[step], step
