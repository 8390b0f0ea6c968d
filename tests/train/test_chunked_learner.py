"""The learner's memory-bounded log-probs (rlctl/models/forward.py, fused=True: hidden
states + chunked LM head) against the full-logits path (fused=False), in float64:
log-probs, entropy and every parameter's gradient, on the tiny Llama, Qwen2 (GQA, tied
embeddings), GPT-2 (Conv1D, absolute positions, tied head) and Gemma, with LoRA, the
shared value head and prompt sharing; and the cases that must keep the full logits.

Both paths run the same transformer body; they differ only in how the LM head and the
log-softmax are computed (one [N*T, V] matmul vs chunks of rows), so in float64 they
agree to summation-order rounding, ~1e-13 relative; a wrong position shift, a missing
temperature or a wrong hidden state differs by O(1e-2) or more. Models run in eval mode
(GPT-2's dropout would make two forwards differ); gradients flow all the same."""
import copy
import os
import sys

import pytest
import torch

from rlctl.models.forward import fused_head, learner_forward
from rlctl.models.value import PolicyValueModel

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
from real_arch import build_model, build_tokenizer  # noqa: E402

TOL = dict(atol=1e-10, rtol=1e-10)


def _batch(vocab: int, N: int = 6, P: int = 5, T: int = 7, groups: int = 2, seed: int = 0):
    """Left-padded prompts (``groups`` distinct, repeated), ragged right-padded completions."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, vocab, (groups, P), generator=g)
    p_mask = torch.ones(groups, P, dtype=torch.long)
    p_mask[0, :2] = 0                                               # a left-padded prompt
    rows = torch.arange(N) % groups
    comp = torch.randint(3, vocab, (N, T), generator=g)             # [N, T]
    lengths = torch.tensor([T, 3, 5, 1, T, 2])[:N]
    c_mask = (torch.arange(T)[None] < lengths[:, None]).long()      # [N, T]
    seqs = torch.cat([prompts[rows], comp], 1)                      # [N, P+T]
    attn = torch.cat([p_mask[rows], c_mask], 1)
    return seqs, attn, c_mask.double(), P


def _run(model, batch, fused, share=False):
    seqs, attn, mask, P = batch
    model.zero_grad(set_to_none=True)
    f = learner_forward(model, seqs, attn, P, temperature=0.7, with_entropy=True,
                        share_prompts=share, entropy_grad=True, fused=fused)
    w = torch.linspace(-1, 1, mask.shape[1], dtype=torch.float64)
    loss = (f.logp * mask * w).sum() + 0.3 * (f.entropy * mask).sum()
    if f.values is not None:
        loss = loss + (f.values * mask).square().sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return f, grads


def _assert_same(model, batch, share=False):
    assert fused_head(model) is not None                            # the chunked path is taken
    (fa, ga), (fb, gb) = _run(model, batch, True, share), _run(model, batch, False, share)
    keep = batch[2] > 0
    assert fa.logp.dtype == torch.float64
    torch.testing.assert_close(fa.logp[keep], fb.logp[keep], **TOL)
    torch.testing.assert_close(fa.entropy[keep], fb.entropy[keep], **TOL)
    assert fa.entropy.requires_grad
    if fb.values is not None:
        torch.testing.assert_close(fa.values[keep], fb.values[keep], **TOL)
    assert ga.keys() == gb.keys() and len(ga) > 0
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], **TOL, msg=lambda m: f"{name}: {m}")


@pytest.fixture(scope="module")
def tiny64():
    """The shipped tiny model (config as composed by rlctl train), in float64."""
    from rlctl.config.compose import compose
    from rlctl.models.loading import load_model_and_tokenizer

    cfg = compose([]).cfg
    model, _ = load_model_and_tokenizer("tiny", **{k: v for k, v in dict(cfg.model).items() if k != "name"})
    return model.double().eval()


@pytest.mark.parametrize("share", [False, True])
def test_tiny_llama_matches_full_logits(tiny64, share):
    _assert_same(tiny64, _batch(tiny64.config.vocab_size), share)


@pytest.mark.parametrize("family", ["qwen2", "gpt2", "gemma"])
def test_real_families_match_full_logits(family):
    tok = build_tokenizer(family)
    model = build_model(family, tok).double().eval()
    _assert_same(model, _batch(model.config.vocab_size), share=family != "gpt2")


def test_value_head_and_prompt_sharing(tiny64):
    model = PolicyValueModel(copy.deepcopy(tiny64), init_std=0.1).double().eval()
    for share in (False, True):
        _assert_same(model, _batch(model.config.vocab_size), share)


def test_lora(tiny64):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(copy.deepcopy(tiny64), LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                             target_modules="all-linear"))
    model.double().eval()
    _assert_same(model, _batch(tiny64.config.vocab_size), share=True)
    seqs, attn, mask, P = _batch(tiny64.config.vocab_size)
    with model.disable_adapter(), torch.no_grad():                  # the reference forward
        ref = learner_forward(model, seqs, attn, P, with_entropy=True)
        want = learner_forward(model, seqs, attn, P, with_entropy=True, fused=False)
        base = learner_forward(tiny64, seqs, attn, P, fused=False).logp
    torch.testing.assert_close(ref.logp, want.logp, **TOL)
    torch.testing.assert_close(ref.entropy, want.entropy, **TOL)
    torch.testing.assert_close(ref.logp, base, **TOL)               # adapter really off


@pytest.mark.parametrize("share", [False, True])
def test_the_fused_forward_projects_no_position_through_the_head_module(tiny64, share):
    """With the chunked head the model's own LM head is given no position (an empty
    ``logits_to_keep``): its logits would be thrown away. (The first forward checks the head
    once, on one position: run before the hook.)"""
    model, batch = tiny64, _batch(tiny64.config.vocab_size)
    _run(model, batch, True, share)
    seen = []
    hook = model.get_output_embeddings().register_forward_hook(
        lambda m, args, out: seen.append(tuple(args[0].shape[:-1])))
    try:
        _run(model, batch, True, share)
    finally:
        hook.remove()
    assert seen and all(s[-1] == 0 for s in seen), seen


def test_full_logits_kept_where_the_head_is_not_linear(tiny64):
    """A LoRA on the head itself: no fused path (structural); and the fallback still gives
    log-probs. (Logit transforms after the head: tests/train/test_fused_head_check.py.)"""
    from peft import LoraConfig, get_peft_model

    head_lora = get_peft_model(copy.deepcopy(tiny64), LoraConfig(r=2, target_modules=["lm_head"]))
    assert fused_head(head_lora) is None
    batch = _batch(tiny64.config.vocab_size)
    f = learner_forward(head_lora, batch[0], batch[1], batch[3])
    torch.testing.assert_close(f.logp, learner_forward(head_lora, batch[0], batch[1], batch[3],
                                                       fused=False).logp, atol=0, rtol=0)
