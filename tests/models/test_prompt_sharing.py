"""Prompt sharing in the learner's forward (rlctl/models/forward.py): one prompt forward
per distinct prompt plus a completion forward over the indexed KV cache must give the
full forward's log-probs, entropies, values and gradients, on left-padded prompts of
different lengths, ragged completions and rows in any order."""
import copy

import pytest
import torch

from rlctl.core.logprobs import completion_mask
from rlctl.models.forward import learner_forward
from rlctl.models.kv_share import cache_keyword
from rlctl.models.value import PolicyValueModel
from rlctl.rollout.generate import generate

PROMPTS = ["3 1 2 =", "9 =", "5 4 8 7 =", "0 6 6 1 2 ="]
G = 3


@pytest.fixture(scope="module")
def batch(tiny):
    """Each prompt G times, sampled completions (ragged: EOS at different steps), rows
    shuffled so that a group's rows are not adjacent."""
    model, tok = tiny
    torch.manual_seed(1)
    prompts = [p for p in PROMPTS for _ in range(G)]
    seqs, prompt_mask, P = generate(model, tok, prompts, max_new_tokens=7, do_sample=True,
                                    temperature=1.5)
    mask, _ = completion_mask(seqs[:, P:], tok.eos_token_id, tok.pad_token_id)   # [N, T]
    lengths = mask.sum(-1)
    assert len(set(lengths.tolist())) > 1 and (prompt_mask == 0).any()           # ragged, padded
    attn = torch.cat([prompt_mask, mask.long()], 1)                              # [N, P+T]
    perm = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(0))
    return seqs[perm], attn[perm], mask[perm], P


def _run(model, batch, share, critic_loss=False):
    seqs, attn, mask, P = batch
    model.zero_grad(set_to_none=True)
    f = learner_forward(model, seqs, attn, P, temperature=0.7, with_entropy=True,
                        share_prompts=share)
    loss = (f.logp * mask * torch.linspace(-1, 1, mask.shape[1])).sum()
    if critic_loss:
        loss = loss + (f.values * mask).square().sum()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return f, grads


def _assert_same(a, b, mask):
    """Float64 models still run Llama's RMSNorm in float32 (transformers upcasts to
    float32 and casts back), so sums taken in a different order differ at float32's
    precision: measured 2.5e-6 on gradients of magnitude 33. A wrong sharing (a row
    reading another prompt's cache) differs by O(1e-1)."""
    (fa, ga), (fb, gb) = a, b
    keep = mask > 0
    torch.testing.assert_close(fa.logp[keep], fb.logp[keep], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(fa.entropy[keep], fb.entropy[keep], atol=1e-6, rtol=1e-6)
    if fa.values is not None:
        torch.testing.assert_close(fa.values[keep], fb.values[keep], atol=1e-6, rtol=1e-6)
    assert len(ga) == len(gb) and len(ga) > 0
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, atol=2e-5, rtol=1e-5)
    assert max(g.abs().max() for g in ga) > 0


def test_shared_prompt_forward_equals_full_forward_in_float64(tiny, batch):
    model = copy.deepcopy(tiny[0]).double().train()
    _run(model, batch, share=False)       # a model's first forward also checks its LM head, once
    calls = []
    model.register_forward_pre_hook(lambda m, a, kw: calls.append(tuple(kw["input_ids"].shape)),
                                    with_kwargs=True)
    full = _run(model, batch, share=False)
    n_full = len(calls)
    shared = _run(model, batch, share=True)
    seqs, _, mask, P = batch
    # one forward over all rows, vs one over the distinct prompts + one over the completions
    assert calls[:n_full] == [(len(seqs), seqs.shape[1] - 1)]
    assert calls[n_full:] == [(len(PROMPTS), P), (len(seqs), seqs.shape[1] - 1 - P)]
    _assert_same(full, shared, mask)


def test_shared_prompt_forward_with_a_value_head(tiny, batch):
    model = PolicyValueModel(copy.deepcopy(tiny[0]), init_std=0.1).double().train()
    full = _run(model, batch, share=False, critic_loss=True)
    shared = _run(model, batch, share=True, critic_loss=True)
    assert shared[0].values is not None
    _assert_same(full, shared, batch[2])


def test_shared_prompt_forward_with_lora(tiny, batch):
    pytest.importorskip("peft")
    from rlctl.models.lora import apply_lora

    model = apply_lora(copy.deepcopy(tiny[0]), r=4, alpha=8, dropout=0.0,
                       target_modules=["q_proj", "v_proj"]).double().train()
    for name, p in model.named_parameters():             # B = 0 at init: move it
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    assert cache_keyword(model) is not None
    _assert_same(_run(model, batch, share=False), _run(model, batch, share=True), batch[2])


def test_one_token_completions_need_only_the_prompt_forward(tiny):
    model, tok = tiny
    enc = tok(["3 1 2 =", "3 1 2 =", "9 ="], return_tensors="pt", padding=True)
    eos = torch.full((3, 1), tok.eos_token_id)
    seqs = torch.cat([enc["input_ids"], eos], 1)                                  # [3, P+1]
    attn = torch.cat([enc["attention_mask"], torch.ones(3, 1, dtype=torch.long)], 1)
    P = enc["input_ids"].shape[1]
    with torch.no_grad():                 # a model's first forward also checks its LM head, once
        learner_forward(model, seqs, attn, P)
    calls = []
    h = model.register_forward_pre_hook(lambda m, a, kw: calls.append(kw["input_ids"].shape[0]),
                                        with_kwargs=True)
    try:
        with torch.no_grad():
            shared = learner_forward(model, seqs, attn, P, share_prompts=True).logp
            full = learner_forward(model, seqs, attn, P, share_prompts=False).logp
    finally:
        h.remove()
    assert calls == [2, 3]          # 2 distinct prompts, then the full forward's 3 rows
    torch.testing.assert_close(shared, full, atol=1e-5, rtol=1e-5)


def test_cache_keyword_is_none_without_a_cache_argument():
    """(learner_forward and shared_prefill take the plain path when it is None.)"""
    class NoCache(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
            pass

    assert cache_keyword(NoCache()) is None
    assert cache_keyword(torch.nn.Linear(2, 2)) is None


def test_generation_with_a_shared_prefill_samples_the_same_tokens(tiny):
    """The rollout's prefill runs once per distinct prompt: with the same seed the same
    completions are drawn, and their behaviour log-probs agree to float rounding."""
    model, tok = tiny
    prompts = [p for p in PROMPTS for _ in range(G)]
    runs = {}
    for share in (False, True):
        torch.manual_seed(3)
        runs[share] = generate(model, tok, prompts, max_new_tokens=6, do_sample=True,
                               return_logprobs=True, share_prompts=share)
    (s0, m0, p0, l0), (s1, m1, p1, l1) = runs[False], runs[True]
    assert torch.equal(s0, s1) and torch.equal(m0, m1) and p0 == p1
    torch.testing.assert_close(l0, l1, atol=1e-5, rtol=1e-5)
    assert l0.shape == (len(prompts), s0.shape[1] - p0)          # [N, T]: no vocabulary axis


def test_the_shared_prefill_runs_once_per_distinct_prompt(tiny):
    from rlctl.models.kv_share import shared_prefill

    model, tok = tiny
    enc = tok([p for p in PROMPTS for _ in range(G)], return_tensors="pt", padding=True)
    calls = []
    h = model.register_forward_pre_hook(lambda m, a, kw: calls.append(tuple(kw["input_ids"].shape)),
                                        with_kwargs=True)
    try:
        cache = shared_prefill(model, enc["input_ids"], enc["attention_mask"])
        single = shared_prefill(model, enc["input_ids"][::G], enc["attention_mask"][::G])
    finally:
        h.remove()
    P = enc["input_ids"].shape[1]
    assert calls == [(len(PROMPTS), P - 1)]          # nothing repeats in `single`: no prefill
    assert single is None and cache.get_seq_length() == P - 1


@pytest.mark.parametrize("temperature,top_k,shared", [(1.0, 0, True), (0.7, 3, False), (1.3, 0, False),
                                                     (1.0, 1, True)])
def test_the_lean_sampler_draws_what_hf_generate_draws(tiny, monkeypatch, temperature, top_k, shared):
    """rollout/generate.py:sample against ``model.generate`` with rlctl's settings, same seed:
    the same tokens (left-padded prompts of different lengths, rows ending early), and
    the same behaviour log-probs (HF's raw logits, log-softmaxed at the temperature). HF's
    token choice goes through rlctl's ``draw`` (the same uniforms: a token differs only if a
    uniform falls within rounding of an interval's end); top_k=1 against HF's own greedy."""
    from rlctl.models.kv_share import shared_prefill
    from rlctl.rollout.generate import draw, sample

    model, tok = tiny
    enc = tok([p for p in PROMPTS for _ in range(G)], return_tensors="pt", padding=True)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    key = cache_keyword(model)
    greedy = top_k == 1
    monkeypatch.setattr(torch, "multinomial", lambda probs, num_samples: draw(probs.log())[:, None])
    torch.manual_seed(5)
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=7,
                         do_sample=not greedy, temperature=temperature, top_k=top_k or None,
                         top_p=1.0, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                         output_logits=True, return_dict_in_generate=True)
    torch.manual_seed(5)
    cache = shared_prefill(model, ids, mask) if shared else None
    assert (cache is not None) == shared
    seqs, logp = sample(model, ids, mask, 7, temperature, top_k, [tok.eos_token_id],
                        tok.pad_token_id, key, cache, keep_logprobs=True)
    assert torch.equal(seqs, ref.sequences)
    new = seqs[:, ids.shape[1]:]                                              # [N, T]
    want = torch.log_softmax(torch.stack(ref.logits, 1).double() / temperature, -1)
    want = want.gather(-1, new[..., None])[..., 0]                            # [N, T]
    torch.testing.assert_close(logp.double(), want, atol=1e-5, rtol=1e-5)
    ended = (seqs[:, ids.shape[1]:] == tok.eos_token_id).any(-1)
    assert ended.any()                            # some rows stop before the limit
    assert greedy or len({tuple(r) for r in new.tolist()}) > len(PROMPTS)     # sampled, not all alike


@pytest.mark.parametrize("shared, room", [(True, 256), (False, 256), (True, 2)])
def test_the_sampler_writes_its_kv_cache_in_place_with_the_same_samples(tiny, monkeypatch, shared,
                                                                        room):
    """The lean loop's cache has room for new tokens (rlctl.models.kv_share.preallocated; room
    2 < 6: doubled as it fills): the same tokens and bitwise the same log-probs as the growing
    (concatenated) cache; with room for all, the keys end as a view of the first buffer; and
    the cache leaves as plain DynamicLayers (a caller's next forward concatenates)."""
    from transformers.cache_utils import DynamicLayer

    from rlctl.models.kv_share import shared_prefill
    from rlctl.rollout import generate as gen

    model, tok = tiny
    enc = tok([p for p in PROMPTS for _ in range(G)], return_tensors="pt", padding=True)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    kept, runs, real = [], {}, gen.preallocated
    monkeypatch.setattr(gen, "ROOM", room)

    def spy(cache, n, most=None):
        real(cache, n, most)
        kept.append((cache, cache.layers[0].room_k.data_ptr()))
        return cache
    for inplace in (False, True):
        monkeypatch.setattr(gen, "preallocated", spy if inplace else (lambda c, n, m=None: c))
        torch.manual_seed(5)
        cache = shared_prefill(model, ids, mask) if shared else None
        runs[inplace] = gen.sample(model, ids, mask, 7, 1.0, 0, [-1], tok.pad_token_id,
                                   cache_keyword(model), cache, keep_logprobs=True)
    (s0, l0), (s1, l1) = runs[False], runs[True]
    assert torch.equal(s0, s1) and torch.equal(l0, l1)
    assert s1.shape[1] == ids.shape[1] + 7                        # no stop id: every token drawn
    cache, first_room = kept[0]
    layer = cache.layers[0]
    assert type(layer) is DynamicLayer and not hasattr(layer, "room_k")       # settled
    assert layer.keys.shape[-2] == ids.shape[1] + 7 - 1
    assert (layer.keys.data_ptr() == first_room) == (room >= 6)  # in place; grown: a new buffer


def test_a_layer_whose_keys_were_replaced_stops_writing_through_its_room(tiny):
    """A row gather between forwards (multi-turn turns do one) replaces the keys: the next
    forward must extend the gathered keys, not the old room; growth stops at ``most``."""
    from transformers.cache_utils import DynamicLayer

    from rlctl.models.kv_share import index_rows, preallocated

    model, tok = tiny
    enc = tok(PROMPTS[:2], return_tensors="pt", padding=True)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    runs = []
    for room in (None, 4):
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, use_cache=True)
            cache = out.past_key_values
            if room:
                preallocated(cache, room, most=6)
            cache = index_rows(cache, torch.tensor([1, 0]))                  # rows swapped
            step = model(input_ids=ids[[1, 0], -1:], attention_mask=torch.cat(
                [mask[[1, 0]], mask.new_ones(2, 1)], 1), past_key_values=cache, use_cache=True)
        runs.append((step.logits, cache.layers[0].keys.clone()))
        if room:
            assert type(cache.layers[0]) is DynamicLayer                         # settled
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    with torch.no_grad():                # room 2, at most 3 more: never a buffer past L + 3
        cache = model(input_ids=ids, attention_mask=mask, use_cache=True).past_key_values
        L = cache.layers[0].keys.shape[-2]
        preallocated(cache, 2, most=3)
        for t in range(3):
            model(input_ids=ids[:, -1:], attention_mask=torch.cat([mask, mask.new_ones(2, t + 1)], 1),
                  past_key_values=cache, use_cache=True)
        assert cache.layers[0].room_k.shape[-2] == L + 3 == cache.layers[0].keys.shape[-2]
