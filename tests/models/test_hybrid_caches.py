"""Hybrid caches: linear-attention and state-space layers beside attention layers.

Qwen3-Next and Qwen3.5 (gated DeltaNet), LFM2 (short convolutions), Falcon-H1 (Mamba-2
heads beside attention heads) keep a convolution window and a recurrent state per row in
their cache; RecurrentGemma keeps its RG-LRU state inside its modules and returns no
cache. Each is rebuilt tiny (tests/models/arch_zoo.py's configurations) in float64 with
every weight perturbed (N(0, 0.5^2) added), so that biases and the pad embedding are not
zero as in a trained checkpoint (random init zeroes them, which would hide left padding
leaking into a recurrent layer) and greedy decoding depends on the context (at random
init it repeats one token). References are independent of rlctl: ``model.generate`` greedy, and a
plain transformers forward of each row alone, unpadded, with our own log-softmax.

Tolerances: the models run in float64, but not every op does: transformers' RMSNorms
compute in float32 and cast back, so a value carries float32 rounding (unit 6e-8)
through a few hundred accumulated terms of size O(1): 1e-5 bounds log-prob differences,
and gradients, whose sums over the rows sharing a prompt run in another order, differ by
at most 1e-5 of the largest gradient (measured: 1e-7). The gated-DeltaNet kernels
(Qwen3-Next, Qwen3.5) cast all their inputs to float32 and accumulate the recurrent state
over the sequence (some 30 steps of 16x16 outer products of O(1) entries, logits up to
20): 1e-3 there (measured 2e-4). A wrong state (a pad or another row leaking in, a state
not carried or not differentiated) moves them by 1e-2 or more.
"""
import copy

import pytest
import torch

from arch_zoo import TOKENIZERS, build_config, ARCHS
from real_arch import build_tokenizer
from rlctl.models.forward import learner_forward
from rlctl.rollout.generate import generate

HYBRIDS = ("qwen3_next", "qwen3_5", "lfm2", "falcon_h1", "recurrent_gemma")
# attention caches that must keep working: sliding windows (16 tokens, shorter than the long
# prompt: Mistral, Gemma-3's sliding layers) and mixture-of-experts blocks. (Gemma-2 is left
# out: its eager attention in float64 turns left-padded rows into NaN, in transformers
# itself; Gemma-3's greedy output here repeats one token per prompt, so it is checked in
# the learner only.)
SAMPLED = HYBRIDS + ("mistral", "qwen3_moe")
LEARNED = HYBRIDS + ("mistral", "gemma3", "qwen3_moe")
PROMPTS = ["sort 3 1 2", "sort the digits 9 8 7 6 5 4 in ascending order", "answer 7",
           "You are a helpful assistant. sort the digits 9 8 7 6 5 4 3 2 1 0 in ascending order"]
F32_KERNEL = ("qwen3_next", "qwen3_5")


def _tol(name):
    return 1e-3 if name in F32_KERNEL else 1e-5


@pytest.fixture(scope="module")
def hybrid():
    """``hybrid(name)`` -> (float64 model, left-padding tokenizer), built once."""
    from transformers import AutoModelForCausalLM

    built = {}

    def get(name):
        if name not in built:
            family = ARCHS[name][0]
            tok = build_tokenizer(family, TOKENIZERS[family])
            tok.padding_side = "left"
            if tok.pad_token is None:           # Mistral ships none; pad with EOS
                tok.pad_token = tok.eos_token
            config = build_config(name, tok)
            if name in ("qwen3_next", "qwen3_moe"):    # their fused MoE kernel has no float64
                config._experts_implementation = "eager"
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                model = AutoModelForCausalLM.from_config(config).to(torch.float64).eval()
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(0.5 * torch.randn_like(p))
            built[name] = (model, tok)
        return built[name]
    return get


def _alone_logits(model, tok, prompt):
    enc = tok([prompt], return_tensors="pt")
    with torch.no_grad():
        return model(**enc, use_cache=False).logits[0]                            # [L, V]


@pytest.mark.parametrize("name", HYBRIDS)
def test_left_padding_reaches_only_recurrent_gemma(hybrid, name):
    """The premise of the fallbacks: a prompt inside a left-padded batch gives the logits
    it gives alone for every hybrid that masks pads before its recurrent layers, and not
    for RecurrentGemma (its convolution reads the pads' activations)."""
    model, tok = hybrid(name)
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    mask = enc["attention_mask"]
    with torch.no_grad():
        batch = model(input_ids=enc["input_ids"], attention_mask=mask,
                      position_ids=(mask.cumsum(-1) - 1).clamp(min=0), use_cache=False).logits
    gap = max((_alone_logits(model, tok, p) - batch[i, -int(mask[i].sum()):]).abs().max().item()
              for i, p in enumerate(PROMPTS))
    if name == "recurrent_gemma":
        assert gap > 1e-3
    else:
        assert gap < _tol(name)


def _stops(model, tok):
    from rlctl.models.stop_ids import stop_ids
    return stop_ids(model, tok)


def _reference_greedy(model, tok, prompts, new, stops, alone):
    """``model.generate`` greedy: on the left-padded batch, or (``alone``) on each prompt
    by itself, left-padded afterwards to the batch's width; rows right-padded with the pad
    id after their stop, as generate pads finished rows."""
    from rlctl.rollout.generate import library_generation_defaults

    kw = dict(do_sample=False, max_new_tokens=new, pad_token_id=tok.pad_token_id,
              eos_token_id=list(stops))
    enc = tok(prompts, return_tensors="pt", padding=True)
    with torch.no_grad(), library_generation_defaults(model):
        if not alone:
            return model.generate(**enc, **kw)
        rows = [model.generate(**tok([p], return_tensors="pt"), **kw)[0] for p in prompts]
    P, T = enc["input_ids"].shape[1], max(len(r) - len(tok(p)["input_ids"]) for r, p in zip(rows, prompts))
    out = torch.full((len(prompts), P + T), tok.pad_token_id)
    for i, (r, p) in enumerate(zip(rows, prompts)):
        lp = len(tok(p)["input_ids"])
        out[i, P - lp:P - lp + len(r)] = r
    return out


@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("name", SAMPLED)
def test_sampler_greedy_equals_generate(hybrid, name, share):
    """rlctl's lean sampling loop at top-k 1 (greedy), prompt sharing on and off, gives
    the tokens of transformers' greedy ``generate``: on the same left-padded batch, and
    on each prompt alone (RecurrentGemma: alone only, where its answer is defined; rlctl
    samples it per prompt length, unpadded)."""
    model, tok = hybrid(name)
    prompts = [p for p in PROMPTS for _ in range(2)]             # groups of 2 share a prompt
    stops = _stops(model, tok)
    torch.manual_seed(0)
    seqs, mask, P = generate(model, tok, prompts, 6, do_sample=True, temperature=1.0, top_k=1,
                             share_prompts=share, stops=stops)
    alone = _reference_greedy(model, tok, prompts, 6, stops, alone=True)
    padded = _reference_greedy(model, tok, prompts, 6, stops, alone=False)
    assert len(set(alone[:, P:].flatten().tolist())) > 6                        # not one token
    assert torch.equal(seqs, alone)
    assert torch.equal(seqs, padded) == (name != "recurrent_gemma")


def _batch(tok, T, seed=0):
    """Rows of PROMPTS (2 each, left-padded) + T random completion tokens, right-padded:
    row r keeps T - (r % 2) of them (input_ids [N, P+T], attention_mask, completion mask)."""
    prompts = [p for p in PROMPTS for _ in range(2)]
    enc = tok(prompts, return_tensors="pt", padding=True)
    g = torch.Generator().manual_seed(seed)
    comp = torch.randint(10, len(tok) - 10, (len(prompts), T), generator=g)       # [N, T]
    mask = torch.ones(len(prompts), T, dtype=torch.long)
    mask[1::2, T - 1:] = 0
    comp = comp.masked_fill(mask == 0, tok.pad_token_id)
    ids = torch.cat([enc["input_ids"], comp], 1)                                   # [N, P+T]
    return ids, torch.cat([enc["attention_mask"], mask], 1), mask, prompts


def _reference_logp(model, tok, prompts, ids, mask):
    """Each row alone: its prompt unpadded + its completion, a plain transformers forward,
    log-softmax in float64 here -> [N, T] (0 where the completion mask is 0)."""
    T = mask.shape[1]
    out = torch.zeros(len(prompts), T, dtype=torch.float64)
    for i, p in enumerate(prompts):
        prompt = torch.tensor(tok(p)["input_ids"])
        n = int(mask[i].sum())
        row = torch.cat([prompt, ids[i, -T:][:n]])
        logits = model(input_ids=row[None, :-1]).logits[0, len(prompt) - 1:]       # [n, V]
        out[i, :n] = torch.log_softmax(logits.double(), -1).gather(-1, row[len(prompt):, None])[:, 0]
    return out


@pytest.mark.parametrize("T", [2, 4])
@pytest.mark.parametrize("name", LEARNED)
def test_learner_shared_forward_and_gradients(hybrid, name, T):
    """The learner's prompt-shared forward gives the log-probs of its full forward and of
    a plain transformers forward of each row alone, and the same parameter gradients
    (T = 2: its prompt forward stops a token short, so no one-token completion forward)."""
    model, tok = hybrid(name)
    ids, attn, mask, prompts = _batch(tok, T)
    P = ids.shape[1] - T
    calls, grads = [], {}
    hook = model.register_forward_pre_hook(
        lambda m, a, kw: calls.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    try:
        learner_forward(model, ids, attn, P, share_prompts=True, fused=False)
    finally:
        hook.remove()
    cut = P - 1 if T == 2 else P
    if name == "recurrent_gemma":     # unpadded, one forward per prompt length, no sharing
        assert sorted(calls) == sorted((2, len(tok(p)["input_ids"]) + T - 1) for p in PROMPTS)
    else:                             # the distinct prompts once, then every row's rest
        assert calls == [(len(PROMPTS), cut), (2 * len(PROMPTS), P + T - 1 - cut)]
    for how in ("shared", "full", "alone"):
        model.zero_grad(set_to_none=True)
        if how == "alone":
            logp = _reference_logp(model, tok, prompts, ids, mask)
        else:
            logp = learner_forward(model, ids, attn, P, share_prompts=how == "shared",
                                   fused=False).logp
        (logp * mask).sum().backward()
        grads[how] = (logp.detach() * mask, torch.cat([p.grad.flatten() for p in model.parameters()
                                                       if p.grad is not None]))
    for how in ("shared", "full"):
        assert (grads[how][0] - grads["alone"][0]).abs().max() < _tol(name)
        scale = grads["alone"][1].abs().max()
        assert scale > 0 and (grads[how][1] - grads["alone"][1]).abs().max() < _tol(name) * scale


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5", "lfm2", "falcon_h1"])
def test_shared_gradients_in_float32(hybrid, name):
    """In float32 (checkpoints' own precision) the recurrent states are not copied on
    update (the delta rule's and Mamba-2's scans use the state tensor itself, which
    transformers' in-place cache update would overwrite before backward): the shared
    forward's gradients are the full forward's. Bound: both run the same float32 ops up
    to summation order and the delta rule's chunking, 1e-3 of the largest gradient
    (measured 1e-4 with the delta rule, 1e-6 without)."""
    model = copy.deepcopy(hybrid(name)[0]).float()
    tok = hybrid(name)[1]
    ids, attn, mask, _ = _batch(tok, 4)
    P = ids.shape[1] - 4
    grads = []
    for share in (True, False):
        model.zero_grad(set_to_none=True)
        logp = learner_forward(model, ids, attn, P, share_prompts=share, fused=False).logp
        (logp * mask).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert (grads[0] - grads[1]).abs().max() < 1e-3 * grads[1].abs().max()


@pytest.mark.parametrize("name", HYBRIDS)
def test_rollout_behaviour_logprobs_equal_the_learners(hybrid, name):
    """A sampled rollout (temperature 0.8, prompt sharing on, a stop id that ends some
    rows early) records behaviour log-probs equal to the learner's prompt-shared forward
    on the batch it returns, at every completion token: the rows, their padding and the
    cache the sampler carried agree (RecurrentGemma: sampled per prompt length and merged
    back into one left-padded batch). The sampler keeps float32 log-probs of float32
    logits (|logit| <= 30 here): 1e-5 more than the float64 bound covers that rounding."""
    from rlctl.models.forward import PromptGroups
    from rlctl.rollout.generate import rollout
    from rlctl.types import Example

    model, tok = hybrid(name)
    examples = [Example(p) for p in PROMPTS]
    torch.manual_seed(1)
    ends = list(range(20, len(tok), 7))            # many stop ids: rows of several lengths
    batch = rollout(model, tok, examples, 3, 8, 0.8, 0, lambda ex, c: [0.0] * len(c),
                    behaviour_logprobs=True, share_prompts=True, stops=_stops(model, tok) + tuple(ends))
    lengths = batch.mask.sum(-1)
    assert len(set(lengths.tolist())) > 1                                          # ragged
    groups = PromptGroups.of(batch.input_ids, batch.attention_mask, batch.prompt_len)
    f = learner_forward(model, batch.input_ids, batch.attention_mask, batch.prompt_len,
                        temperature=0.8, share_prompts=groups, fused=False)
    keep = batch.mask > 0
    assert (f.logp[keep] - batch.logprobs.old[keep].double()).abs().max() < _tol(name) + 1e-5


def test_recurrent_gemma_fallback_is_said_once_and_zero3_is_refused(hybrid, monkeypatch, caplog):
    """RecurrentGemma's fallback is one log line, once, naming the architecture, whether
    the sampler, the learner or a separate critic (a copy of the backbone, a
    RecurrentGemmaModel inside rlctl's SeparateCritic) meets it first; the cache hybrids
    say nothing (they share). Under ZeRO-3 on several ranks (``synced_gpus``) per-length
    sampling would run different calls on each rank: refused in one line naming the
    architecture."""
    import logging

    from rlctl.errors import UserError
    from rlctl.models import kv_share
    from rlctl.models.value import SeparateCritic

    monkeypatch.setattr(kv_share, "_said", set())
    with caplog.at_level(logging.WARNING, logger="rlctl.models.kv_share"):
        for name in ("qwen3_5", "recurrent_gemma"):
            model, tok = hybrid(name)
            critic = SeparateCritic(policy=model).double()
            ids, attn, _, _ = _batch(tok, 3)
            for _ in range(2):
                generate(model, tok, PROMPTS, 2, do_sample=True, share_prompts=True)
                with torch.no_grad():
                    learner_forward(model, ids, attn, ids.shape[1] - 3, share_prompts=True,
                                    fused=False, critic=critic)
    lines = [r.getMessage() for r in caplog.records if r.name == "rlctl.models.kv_share"]
    assert len(lines) == 1 and lines[0].startswith("RecurrentGemma keeps its recurrent"), lines
    with pytest.raises(UserError, match="RecurrentGemmaForCausalLM cannot sample under ZeRO-3"):
        generate(*hybrid("recurrent_gemma"), PROMPTS, 2, do_sample=True, synced_gpus=True)


def test_recurrent_gemma_training_forward_leaves_no_graph_on_its_modules(hybrid):
    """RecurrentGemma's blocks keep the last forward's conv window and RG-LRU state as
    module attributes (transformers does so even with ``use_cache=False``). After the
    learner's training forward and backward none of them is tied to a graph, so the model
    can be copied (``copy.deepcopy``: a LoRA run's merged save deep-copies the trained
    model; it raised 'Only Tensors created explicitly by the user ... deepcopy') and the
    copy gives the original's logits exactly (same weights, same float64 ops)."""
    model, tok = hybrid("recurrent_gemma")
    ids, attn, mask, _ = _batch(tok, 3)
    logp = learner_forward(model, ids, attn, ids.shape[1] - 3, share_prompts=True, fused=False).logp
    (logp * mask).sum().backward()
    model.zero_grad(set_to_none=True)
    held = [name for m in model.modules() for name, v in vars(m).items()
            if isinstance(v, torch.Tensor) and v.grad_fn is not None]
    assert held == []
    twin = copy.deepcopy(model)
    enc = tok([PROMPTS[1]], return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(twin(**enc, use_cache=False).logits, model(**enc, use_cache=False).logits)
