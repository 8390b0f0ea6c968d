"""The torch engine (rlctl/rollout/engines/protocol.py) against rollout.generate's path on a tiny
random-init Llama: the same seed gives the same tokens and log-probs (the same sampler on
the same tensors: exact), greedy equals Hugging Face's greedy generate, finish reasons and
cuts follow the stop set, and weight updates (full, adapter) serve the new weights."""
import copy

import pytest
import torch

from rlctl.errors import UserError
from rlctl.demo.tiny import build_model, build_tokenizer
from rlctl.rollout.engines.protocol import LENGTH, STOP, Sampling, TorchEngine
from rlctl.rollout.generate import generate

TEXTS = ["3 1 2 :", "3 1 2 :", "9 :", "9 :", "4 4 1 2 :", "4 4 1 2 :"]   # groups of 2, 3 lengths


@pytest.fixture(scope="module")
def tiny():
    tok = build_tokenizer()
    model = build_model(tok, hidden_size=32, num_layers=2, num_heads=4, seed=0).eval()
    return model, tok


def ids_of(tok, texts):
    return [tok(t)["input_ids"] for t in texts]


def cut(row, stops):
    """A generated row up to and including its first stop id (by hand)."""
    for t, tok in enumerate(row):
        if tok in stops:
            return row[:t + 1]
    return row


def test_same_seed_same_tokens_and_logprobs_as_generate(tiny):
    model, tok = tiny
    stops = (tok.eos_token_id,)
    torch.manual_seed(7)
    seqs, _, P, logp = generate(model, tok, TEXTS, 12, do_sample=True, temperature=1.3,
                                return_logprobs=True, stops=stops)
    outs = TorchEngine(model, tok.pad_token_id).generate(
        ids_of(tok, TEXTS), Sampling(12, 1.3, 0, stops), seed=7)
    for i, c in enumerate(outs):
        want = cut(seqs[i, P:].tolist(), stops)
        assert c.token_ids == want
        assert c.logprobs == logp[i, :len(want)].double().tolist()    # the same float32 values
        assert c.finish_reason == (STOP if want[-1] in stops else LENGTH)
    assert len({tuple(c.token_ids) for c in outs}) > 2               # sampled, not all alike


def test_an_rng_state_seed_draws_from_that_stream_and_hands_it_back_advanced(tiny):
    """A seed that is a torch RNG state (a local engine at max_staleness=0): the tokens
    ``generate`` draws from that state, and ``rng_state`` is where that stream ends; the
    caller's own state is left as it was."""
    model, tok = tiny
    stops = (tok.eos_token_id,)
    torch.manual_seed(5)
    start = torch.get_rng_state()
    seqs, _, P, _ = generate(model, tok, TEXTS, 12, do_sample=True, temperature=1.3,
                             return_logprobs=True, stops=stops)
    after, mine = torch.get_rng_state(), torch.manual_seed(9).get_state()
    engine = TorchEngine(model, tok.pad_token_id)
    outs = engine.generate(ids_of(tok, TEXTS), Sampling(12, 1.3, 0, stops), seed=start)
    assert [c.token_ids for c in outs] == [cut(seqs[i, P:].tolist(), stops) for i in range(len(TEXTS))]
    assert torch.equal(engine.rng_state, after) and not torch.equal(after, start)
    assert torch.equal(torch.get_rng_state(), mine)


def test_seed_leaves_the_callers_rng_alone(tiny):
    model, tok = tiny
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    TorchEngine(model, tok.pad_token_id).generate(ids_of(tok, TEXTS[:2]), Sampling(4), seed=11)
    assert torch.equal(torch.rand(4), expected)


def test_greedy_is_hf_greedy_and_logprobs_are_a_plain_forward(tiny):
    model, tok = tiny
    m64 = copy.deepcopy(model).double()
    stops = (tok.eos_token_id,)
    seqs, _, P = generate(m64, tok, TEXTS, 8, do_sample=False, stops=stops)
    outs = TorchEngine(m64, tok.pad_token_id).generate(ids_of(tok, TEXTS), Sampling(8, 0.0, 0, stops))
    for i, (prompt, c) in enumerate(zip(ids_of(tok, TEXTS), outs)):
        assert c.token_ids == cut(seqs[i, P:].tolist(), stops)
        full = torch.tensor([prompt + c.token_ids])                   # unpadded, no cache
        lp = torch.log_softmax(m64(input_ids=full).logits[0, len(prompt) - 1:-1], -1)
        want = lp.gather(-1, full[0, len(prompt):, None])[:, 0]
        # float64 throughout; cache vs no cache and padding differ by rounding (~1e-15)
        assert torch.allclose(torch.tensor(c.logprobs, dtype=torch.float64), want, atol=1e-10)


def test_finish_reasons_follow_the_stop_set(tiny):
    model, tok = tiny
    engine = TorchEngine(model, tok.pad_token_id)
    every = tuple(range(len(tok)))                   # any token stops: one token each
    for c in engine.generate(ids_of(tok, TEXTS), Sampling(5, 1.0, 0, every), seed=0):
        assert len(c.token_ids) == 1 and c.finish_reason == STOP
    for c in engine.generate(ids_of(tok, TEXTS), Sampling(5, 1.0, 0, ()), seed=0):
        assert len(c.token_ids) == 5 and c.finish_reason == LENGTH


def test_full_weights_update_serves_the_new_weights(tiny):
    model, tok = tiny
    other = build_model(tok, hidden_size=32, num_layers=2, num_heads=4, seed=1).eval()
    engine = TorchEngine(copy.deepcopy(model), tok.pad_token_id)
    prompts, s = ids_of(tok, TEXTS), Sampling(6, 1.0, 0, ())
    old = engine.generate(prompts, s, seed=5)
    engine.update_weights(3, dict(other.named_parameters()))
    new = engine.generate(prompts, s, seed=5)
    want = TorchEngine(other, tok.pad_token_id).generate(prompts, s, seed=5)
    assert [c.logprobs for c in new] == [c.logprobs for c in want]
    assert [c.logprobs for c in new] != [c.logprobs for c in old]
    assert engine.version == 3 and new[0].weights_version == 3
    with pytest.raises(UserError, match="missing"):
        engine.update_weights(4, {"lm_head.weight": other.lm_head.weight})
    assert engine.version == 3


def test_adapter_is_merged_onto_the_base_and_replaces_the_last(tiny):
    model, tok = tiny
    engine = TorchEngine(copy.deepcopy(model), tok.pad_token_id)
    name = "model.layers.0.self_attn.q_proj"
    w0 = dict(model.named_modules())[name].weight.detach().clone()     # [32, 32]
    g = torch.Generator().manual_seed(0)
    A, B = torch.randn(2, 32, generator=g), torch.randn(32, 2, generator=g)
    prompts, s = ids_of(tok, TEXTS), Sampling(6, 1.0, 0, ())
    for scale in (1.0, 0.5):                         # the second replaces the first
        engine.update_weights(1, {f"{name}.lora_A": A, f"{name}.lora_B": scale * B}, "adapter")
        merged = copy.deepcopy(model)
        dict(merged.named_modules())[name].weight.data = w0 + scale * (B @ A)
        want = TorchEngine(merged, tok.pad_token_id).generate(prompts, s, seed=2)
        got = engine.generate(prompts, s, seed=2)
        assert [c.token_ids for c in got] == [c.token_ids for c in want]
        # the merge is rounded once from float64, the hand merge in float32: ~1e-6 apart
        assert max(abs(a - b) for g_, w in zip(got, want) for a, b in zip(g_.logprobs, w.logprobs)) < 1e-4
    with pytest.raises(UserError, match="lora_A|lora_B"):
        engine.update_weights(2, {"model.norm.weight.lora_A": A}, "adapter")


@pytest.mark.parametrize("prompts, settings, message", [
    ([[1, 99]], Sampling(4), r"token ids are integers in \[0, 19\)"),
    ([], Sampling(4), "non-empty"),
    ([[1, 2]], Sampling(0), "max_tokens must be an integer >= 1"),
    ([[1, 2]], Sampling(4, -1.0), "temperature must be >= 0"),
    ([[1] * 60], Sampling(5), "a prompt of 60 tokens \\+ max_tokens 5 exceeds the model's context of 64"),
])
def test_bad_input_is_one_line(tiny, prompts, settings, message):
    model, tok = tiny
    with pytest.raises(UserError, match=message):
        TorchEngine(model, tok.pad_token_id).generate(prompts, settings)
