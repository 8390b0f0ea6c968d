"""Log-probs, entropy, masked statistics and completion masks."""
import math

import pytest
import torch

from rlctl.core import (completion_mask, entropy_from_logits, masked_mean, masked_whiten,
                        token_logprobs)


def _logits(dtype=torch.float32, n=3, t=5, v=11, scale=3.0):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(n, t, v, generator=g) * scale
    tokens = torch.randint(0, v, (n, t), generator=g)
    return logits.to(dtype), tokens


def test_token_logprobs_matches_log_softmax_gather_float32():
    logits, tokens = _logits()
    logits.requires_grad_(True)
    out = token_logprobs(logits, tokens)
    ref = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    assert out.shape == (3, 5) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    (g1,) = torch.autograd.grad(out.sum(), logits)
    (g2,) = torch.autograd.grad(ref.sum(), logits)
    torch.testing.assert_close(g1, g2, atol=1e-6, rtol=1e-5)


def test_token_logprobs_bf16_and_large_logits():
    logits, tokens = _logits(torch.bfloat16)
    out = token_logprobs(logits, tokens)
    ref = torch.log_softmax(logits.double(), -1).gather(-1, tokens[..., None]).squeeze(-1)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)  # upcast before lse
    big, _ = _logits(scale=1e4)
    assert torch.isfinite(token_logprobs(big, tokens)).all()
    assert token_logprobs(big[:0], tokens[:0]).shape == (0, 5)


def test_entropy_against_direct_formula():
    logits, _ = _logits()
    p = torch.softmax(logits.double(), -1)
    direct = -(p * p.log()).sum(-1)
    torch.testing.assert_close(entropy_from_logits(logits).double(), direct, atol=1e-5,
                               rtol=1e-5)
    uniform = entropy_from_logits(torch.zeros(2, 3, 7, dtype=torch.bfloat16))
    torch.testing.assert_close(uniform, torch.full((2, 3), math.log(7)))
    peaked = torch.tensor([[[1e4, 0.0, 0.0]]])
    assert entropy_from_logits(peaked).abs().item() < 1e-6


def test_masked_mean_safe_denominators():
    x = torch.tensor([[1.0, 2.0, float("nan")], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    assert masked_mean(x, mask).item() == pytest.approx(1.5)
    torch.testing.assert_close(masked_mean(x, mask, dim=-1), torch.tensor([1.5, 0.0]))
    assert masked_mean(x, torch.zeros(2, 3)).item() == 0.0
    assert masked_mean(x.bfloat16(), mask).dtype == torch.float32


def test_masked_whiten():
    torch.manual_seed(0)
    x = torch.randn(4, 6) * 3 + 2
    mask = (torch.rand(4, 6) > 0.3).float()
    w = masked_whiten(x, mask)
    sel = w[mask.bool()].double()
    assert sel.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert sel.var().item() == pytest.approx(1.0, abs=1e-5)  # unbiased
    assert (w[~mask.bool()] == 0).all()
    ws = masked_whiten(x, mask, shift_mean=False)[mask.bool()]
    assert ws.mean().item() == pytest.approx(x[mask.bool()].mean().item(), abs=1e-5)
    assert (masked_whiten(x, torch.zeros(4, 6)) == 0).all()
    assert masked_whiten(x.bfloat16(), mask).dtype == torch.bfloat16


EOS, PAD = 2, 0


@pytest.mark.parametrize("row,pad_id,mask,truncated", [
    ([5, 7, EOS, PAD, PAD], PAD, [1, 1, 1, 0, 0], False),   # EOS mid-row
    ([5, 7, 8, 9, EOS], PAD, [1, 1, 1, 1, 1], False),       # EOS at the last position
    ([5, 7, 8, 9, 3], PAD, [1, 1, 1, 1, 1], True),          # no EOS: truncated, all count
    ([5, EOS, EOS, EOS, EOS], EOS, [1, 1, 0, 0, 0], False),  # pad == eos
    ([EOS, 4, EOS, PAD, PAD], None, [1, 0, 0, 0, 0], False),  # first EOS wins
    ([5, PAD, 7, 9, 3], PAD, [1, 1, 1, 1, 1], True),        # a sampled pad mid-row counts
    ([5, 7, 9, PAD, PAD], PAD, [1, 1, 1, 1, 1], True),      # sampled trailing pads count
])
def test_completion_mask_cases(row, pad_id, mask, truncated):
    m, tr = completion_mask(torch.tensor([row]), EOS, pad_id)
    assert m.dtype == torch.float32
    assert m[0].tolist() == mask and tr.tolist() == [truncated]


def test_completion_mask_batch_and_multiple_eos_ids():
    ids = torch.tensor([[1, 9, 3, 3], [1, 1, 1, 1], [8, 1, 1, 1]])
    m, tr = completion_mask(ids, (8, 9), pad_id=3)
    assert m.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    m2, _ = completion_mask(ids, torch.tensor(9), pad_id=None)  # a tensor scalar id
    assert m2.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]]
    assert tr.tolist() == [False, True, False]
