"""Weights pushed in parts (``hardware.gather_bucket_mb``): every engine (the torch engine in
this process, a local engine process, a real `rlctl serve`) keeps sampling from the old
weights until a version's last part arrives, then from exactly the learner's; a push holds
a bounded number of buckets on the learner, not the model.

The tiny model's 20 tensors take 1.26 MiB; buckets of 0.125 MiB make 13 parts. Equality is
exact: the parts are bit-exact copies (safetensors) and the sampler the same code."""
import copy
import multiprocessing
import weakref

import pytest
import torch
from omegaconf import OmegaConf

from rlctl.config.compose import compose
from rlctl.demo.tiny import build_model, build_tokenizer
from rlctl.rollout.engines.engine_source import EngineSource, LocalEngine, policy_weights, serve_engine
from rlctl.rollout.engines.protocol import Sampling, TorchEngine
from rlctl.rollout.engines.server import ServerEngine
from rlctl.train.build import prepare_task
from rlctl.train.sources import weight_buckets

from serving import ServeThread, tiny_app

BUCKET_MB = 0.125


def _models():
    tok = build_tokenizer()
    served = build_model(tok, hidden_size=128, num_layers=2, num_heads=4, seed=0).eval()
    learner = copy.deepcopy(served)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in learner.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return tok, served, learner


def _cfg(overrides=()):
    cfg = compose(["trainer.prompts_per_step=2", "algo.group_size=2",
                   f"hardware.gather_bucket_mb={BUCKET_MB}", *overrides]).cfg
    OmegaConf.resolve(cfg)
    return cfg


def _fingerprint(outs):
    return [(c.token_ids, c.logprobs, c.weights_version) for c in outs]


@pytest.mark.parametrize("where", ["torch", "local", "server"])
def test_an_engine_switches_to_a_version_at_its_last_part_never_before(where):
    """Every part but the last is held: the engine samples as before (a version loaded part
    by part would sample from a mix); after the last, as the learner's weights do."""
    tok, served, learner = _models()
    prompts = [tok(t)["input_ids"] for t in ["3 1 2 :", "9 4 :"]]
    sampling = Sampling(8, 1.0, 0, (tok.eos_token_id,))
    parts = list(policy_weights(learner, weight_buckets(_cfg().hardware)))
    assert len(parts) == 13 and all(kind == "full" for _, kind in parts)
    stop = None
    if where == "torch":
        engine = TorchEngine(copy.deepcopy(served), tok.pad_token_id)
    elif where == "local":
        mine, theirs = multiprocessing.get_context("fork").Pipe()
        proc = multiprocessing.get_context("fork").Process(
            target=serve_engine, args=(TorchEngine(copy.deepcopy(served), tok.pad_token_id), theirs), daemon=True)
        proc.start()
        engine, stop = LocalEngine(proc, mine, "rollout engine process 1", timeout_s=30.0), proc.kill
    else:
        server = ServeThread(tiny_app(served, tok.pad_token_id)[0])
        engine, stop = ServerEngine([server.url], timeout_s=30.0), server.stop
    try:
        old = _fingerprint(engine.generate(prompts, sampling, seed=5))
        new = _fingerprint(TorchEngine(learner, tok.pad_token_id, version=1).generate(prompts, sampling, seed=5))
        assert [o[:2] for o in old] != [n[:2] for n in new]       # the weights do differ (can fail)
        for tensors, kind in parts[:-1]:
            engine.update_weights(1, tensors, kind, last=False)
        assert _fingerprint(engine.generate(prompts, sampling, seed=5)) == old
        engine.update_weights(1, *parts[-1], last=True)
        assert _fingerprint(engine.generate(prompts, sampling, seed=5)) == new
    finally:
        if stop is not None:
            stop()


def test_a_push_holds_two_buckets_at_most_and_the_server_gets_the_learners_weights_bitwise():
    """A real `rlctl serve` behind an EngineSource. A counting hook on the gather records each
    bucket's CPU tensors (weak references) and, when the next bucket is gathered, the bytes
    still alive: the push holds the bucket being sent and the next (which says whether it is
    the last), so at most 2 x 0.125 MiB, whatever the model's size (1.26 MiB here). A push of
    the whole model at once holds all 1.26 MiB and fails the bound."""
    tok, served, learner = _models()
    cfg = _cfg()
    task = prepare_task(cfg, tok, learner, quiet=True)
    app, served_engine = tiny_app(served, tok.pad_token_id, (tok.eos_token_id,))
    server = ServeThread(app)
    gather, alive, peak, sizes = weight_buckets(cfg.hardware), [], [0], []

    def counting(module, names=None):
        for part in gather(module, names=names):
            alive.extend(weakref.ref(t) for t in part.values())
            sizes.append(sum(t.numel() * t.element_size() for t in part.values()))
            peak[0] = max(peak[0], sum(r().numel() * r().element_size() for r in alive if r() is not None))
            yield part
    source = EngineSource(ServerEngine([server.url], chunk_size=4, timeout_s=30.0), learner, tok,
                          list(task.train), task.scorer(), cfg.rollout, cfg.algo.group_size,
                          cfg.trainer.async_rollout, seed=0, gather=counting)
    try:
        batch = source.sample(2)
        assert bool((batch.logprobs.staleness == 0).all())
    finally:
        source.close()
        server.stop()
    bucket, total = int(BUCKET_MB * 2**20), sum(p.numel() * p.element_size() for p in learner.parameters())
    assert len(sizes) == 13 and max(sizes) <= bucket and sum(sizes) == total
    assert peak[0] <= 2 * bucket < total
    mine = dict(learner.named_parameters())
    for name, p in served_engine.model.named_parameters():
        assert torch.equal(p, mine[name]), name
