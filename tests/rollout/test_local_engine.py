"""A local engine (rlctl/rollout/engines/engine_source.py): the torch engine in a child process,
reached through a pipe, gives the tokens the torch engine gives in this process; a push
it cannot load is the answer to the next request (one line), and stop ends the child."""
import multiprocessing

import pytest
import torch

from rlctl.errors import UserError
from rlctl.demo.tiny import build_model, build_tokenizer
from rlctl.rollout.engines.protocol import Sampling, TorchEngine
from rlctl.rollout.engines.engine_source import LocalEngine, serve_engine


def test_a_child_engine_samples_as_this_process_does_and_reports_a_bad_push():
    tok = build_tokenizer()
    model = build_model(tok, hidden_size=32, num_layers=2, num_heads=4, seed=0).eval()
    ctx = multiprocessing.get_context("fork")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=serve_engine, args=(TorchEngine(model, tok.pad_token_id), theirs), daemon=True)
    proc.start()
    try:
        engine = LocalEngine(proc, mine, "rollout engine process 1")
        prompts = [tok(t)["input_ids"] for t in ["3 1 2 :", "9 :"]]
        sampling = Sampling(8, 1.0, 0, (tok.eos_token_id,))
        here = TorchEngine(model, tok.pad_token_id).generate(prompts, sampling, seed=4)
        assert [c.token_ids for c in engine.generate(prompts, sampling, seed=4)] == [c.token_ids for c in here]
        zeros = {k: torch.zeros_like(v) for k, v in model.named_parameters()}
        engine.update_weights(3, zeros)
        assert engine.health() == {"status": "ok", "weights_version": 3}
        assert engine.generate(prompts, sampling, seed=4)[0].weights_version == 3
        engine.update_weights(4, {"nope": torch.zeros(2)})
        with pytest.raises(UserError, match="full weights must name every parameter of the served model"):
            engine.health()
        assert engine.health()["weights_version"] == 3          # the bad push changed nothing
        engine.stop(learner_failed=False)
        proc.join(10)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
