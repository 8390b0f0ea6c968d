"""GSPO and CISPO against hand numbers and independent objectives."""
import math

import pytest
import torch

from rlctl.core import (aggregate, broadcast_to_tokens, cispo_per_token, get_policy_loss,
                        gspo_per_token, ppo_clip_per_token, token_logprobs,
                        vanilla_pg_per_token)

F64 = torch.float64


def _from_ratios(rhos, lengths, t_len, seed=0):
    """old random; logp = old + log(rho) on counted tokens; NaN old on padding."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(len(rhos), t_len, generator=g, dtype=F64) * 2
    logp = old.clone()
    mask = torch.zeros(len(rhos), t_len, dtype=F64)
    for i, (row, length) in enumerate(zip(rhos, lengths)):
        for t in range(length):
            logp[i, t] = old[i, t] + math.log(row[t])
            mask[i, t] = 1.0
        old[i, length:] = float("nan")
    return logp.requires_grad_(True), old, mask


def _ragged(lengths, t_len, seed):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(len(lengths), t_len, generator=g, dtype=F64) * 3
    mask = (torch.arange(t_len)[None] < torch.tensor(lengths)[:, None]).to(F64)
    return logp, mask, g


# --- GSPO --------------------------------------------------------------------------

def test_gspo_sequence_ratio_is_geometric_mean_of_token_ratios():
    # row 0: ratios 2, 0.5, 4 -> s = (2 * 0.5 * 4) ** (1/3) = 4 ** (1/3); A = +1
    # row 1: ratios 1.1, 1.1 (+ padding) -> s = 1.1; A = -1.  row 2: no counted token.
    logp, old, mask = _from_ratios([[2.0, 0.5, 4.0], [1.1, 1.1], []], [3, 2, 0], 3)
    adv = torch.tensor([1.0, -1.0, 5.0], dtype=F64)
    # wide clip range: the unclipped branch, whose value is -A * s_i on every token
    loss_mat, m = gspo_per_token(logp, old, adv, mask, 0.99, 10.0)
    s0 = 4 ** (1 / 3)
    expect = torch.tensor([[-s0, -s0, -s0], [1.1, 1.1, 0.0], [0.0, 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(loss_mat.detach(), expect)
    kl = sum(r - 1 - math.log(r) for r in (2.0, 0.5, 4.0, 1.1, 1.1)) / 5  # token-level k3
    assert m["policy/approx_kl"].item() == pytest.approx(kl)
    assert m["policy/clip_frac"].item() == 0.0 and m["policy/clip_frac_dual"].item() == 0.0


@pytest.mark.parametrize("adv_as_tokens", [False, True])
def test_gspo_on_policy_gradient_is_sequence_mean_logp_gradient(adv_as_tokens):
    # At old == new, s_i = 1 and d loss_{i,t} / d logp_{i,t} = -A_i. seq-mean-token-mean
    # divides by |y_i| and by the number of non-empty rows R, so
    #   d L / d logp_{i,t} = -A_i / (|y_i| * R),
    # the gradient of  1/R sum_i -A_i * mean_t logp_{i,t}  (REINFORCE on the mean logp).
    lengths = [5, 1, 0, 3]
    logp, mask, _ = _ragged(lengths, 5, seed=0)
    logp.requires_grad_(True)
    adv = torch.tensor([0.7, -1.3, 2.0, 0.4], dtype=F64)
    adv_in = broadcast_to_tokens(adv, mask) if adv_as_tokens else adv
    loss_mat, m = gspo_per_token(logp, logp.detach(), adv_in, mask, 0.2, 0.2)
    (grad,) = torch.autograd.grad(aggregate(loss_mat, mask, "seq-mean-token-mean"), logp)
    rows = [i for i, n in enumerate(lengths) if n]
    ref = sum(-adv[i] * logp[i, :lengths[i]].mean() for i in rows) / len(rows)
    (grad_ref,) = torch.autograd.grad(ref, logp)
    torch.testing.assert_close(grad, grad_ref)
    hand = torch.zeros(4, 5, dtype=F64)
    for i in rows:
        hand[i, :lengths[i]] = -adv[i].item() / (lengths[i] * len(rows))
    torch.testing.assert_close(grad, hand)
    assert all(v.item() == 0.0 for v in m.values())


def test_gspo_off_policy_gradient_matches_sequence_level_objective():
    lengths = [4, 2, 3]
    logp, mask, g = _ragged(lengths, 4, seed=1)
    old = logp + 0.3 * torch.randn(3, 4, generator=g, dtype=F64)
    logp.requires_grad_(True)
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=F64)
    loss_mat, _ = gspo_per_token(logp, old, adv, mask, 0.99, 10.0)  # nothing clipped
    (grad,) = torch.autograd.grad(aggregate(loss_mat, mask, "seq-mean-token-mean"), logp)
    # independent: the sequence-level GSPO objective -A_i * s_i(theta), mean over rows
    seq = [-adv[i] * torch.exp((logp[i, :n] - old[i, :n]).mean()) for i, n in enumerate(lengths)]
    (grad_ref,) = torch.autograd.grad(sum(seq) / 3, logp)
    torch.testing.assert_close(grad, grad_ref)
    for i, n in enumerate(lengths):  # hand: -A_i * s_i / (|y_i| * R), s_i by a slow loop
        s_i = math.exp(sum(logp[i, t].item() - old[i, t].item() for t in range(n)) / n)
        for t in range(n):
            assert grad[i, t].item() == pytest.approx(-adv[i].item() * s_i / (n * 3))


def test_gspo_clip_zeroes_whole_sequences_in_the_advantage_direction():
    # eps 0.2. row 0: A>0, ratios (2, 0.9) -> s = sqrt(1.8) = 1.342 > 1.2: clipped
    # row 1: A<0, ratios (0.5, 1.1) -> s = sqrt(0.55) = 0.742 < 0.8: clipped
    # row 2: A<0, s = 1.5 > 1.2: not clipped (A's direction is down). row 3: A>0, s = 0.7
    rhos = [[2.0, 0.9], [0.5, 1.1], [1.5, 1.5], [0.7, 0.7]]
    logp, old, mask = _from_ratios(rhos, [2, 2, 2, 2], 2)
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0], dtype=F64)
    loss_mat, m = gspo_per_token(logp, old, adv, mask, 0.2, 0.2)
    (grad,) = torch.autograd.grad(aggregate(loss_mat, mask, "seq-mean-token-mean"), logp)
    hand = torch.tensor([[0.0, 0.0], [0.0, 0.0], [1.5 / 8] * 2, [-0.7 / 8] * 2], dtype=F64)
    torch.testing.assert_close(grad, hand)  # -A s / (|y| R), R = 4, |y| = 2
    torch.testing.assert_close(loss_mat[:2].detach(), torch.tensor(
        [[-1.2, -1.2], [0.8, 0.8]], dtype=F64))  # clipped values -A * (1 +- eps)
    assert m["policy/clip_frac_high"].item() == pytest.approx(2 / 8)  # per token of clipped rows
    assert m["policy/clip_frac_low"].item() == pytest.approx(2 / 8)
    # token-level PPO on row 0 would still push token 1 (ratio 0.9 < 1.2) up
    ppo_mat, _ = ppo_clip_per_token(logp, old, adv, mask, 0.2, 0.2)
    (g_ppo,) = torch.autograd.grad(ppo_mat.sum(), logp)
    assert g_ppo[0, 1].item() == pytest.approx(-0.9) and g_ppo[0, 0].item() == 0.0


def test_gspo_dual_clip_on_the_sequence_ratio():
    logp, old, mask = _from_ratios([[4.0, 4.0], [2.0, 2.0]], [2, 2], 2)
    adv = torch.tensor([-1.0, -1.0], dtype=F64)
    loss_mat, m = get_policy_loss("gspo")(logp, old, adv, mask, 0.2, 0.2, 3.0)
    (grad,) = torch.autograd.grad(loss_mat.sum(), logp)
    torch.testing.assert_close(loss_mat.detach(), torch.tensor([[3.0, 3.0], [2.0, 2.0]],
                                                               dtype=F64))
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0], [2.0, 2.0]], dtype=F64))
    assert m["policy/clip_frac_dual"].item() == pytest.approx(0.5)


# --- CISPO -------------------------------------------------------------------------

# eps 0.2: (A, rho, clipped weight w); d loss / d logp = -w * A, nonzero for every token
CISPO_TABLE = [(+1.0, 1.5, 1.2), (-1.0, 0.5, 0.8), (+1.0, 1.1, 1.1), (-1.0, 1.5, 1.2),
               (+2.0, 0.5, 0.8)]


def test_cispo_hand_table_gradient_never_zero():
    rhos = [[r for _, r, _ in CISPO_TABLE]]
    logp, old, mask = _from_ratios(rhos, [5], 5)
    adv = torch.tensor([[a for a, _, _ in CISPO_TABLE]], dtype=F64)
    loss_mat, m = cispo_per_token(logp, old, adv, mask, 0.2, 0.2)
    w = torch.tensor([[w for _, _, w in CISPO_TABLE]], dtype=F64)
    torch.testing.assert_close(loss_mat.detach(), -w * adv * logp.detach())
    (grad,) = torch.autograd.grad(loss_mat.sum(), logp)
    torch.testing.assert_close(grad, -w * adv)
    assert (grad != 0).all()
    # clipped weights whatever the sign of A: rho 1.5 twice (high), rho 0.5 twice (low)
    assert m["policy/clip_frac_high"].item() == pytest.approx(2 / 5)
    assert m["policy/clip_frac_low"].item() == pytest.approx(2 / 5)
    assert m["policy/clip_frac_dual"].item() == 0.0
    # PPO gives tokens 0 (A>0, rho>1.2) and 1 (A<0, rho<0.8) no gradient at all
    ppo_mat, _ = ppo_clip_per_token(logp, old, adv, mask, 0.2, 0.2)
    (g_ppo,) = torch.autograd.grad(ppo_mat.sum(), logp)
    assert g_ppo[0, 0].item() == 0.0 and g_ppo[0, 1].item() == 0.0


def test_cispo_gradient_through_logits_vs_hand_formula():
    # d(-w A log softmax(z)_k) / dz = -w A (e_k - softmax(z)), w = clip(rho), no grad on w
    g = torch.Generator().manual_seed(2)
    n, t_len, v = 3, 4, 6
    logits = torch.randn(n, t_len, v, generator=g, dtype=F64, requires_grad=True)
    tokens = torch.randint(0, v, (n, t_len), generator=g)
    logp = token_logprobs(logits, tokens)  # [N, T]
    old = logp.detach() + 0.4 * torch.randn(n, t_len, generator=g, dtype=F64)
    adv = torch.randn(n, generator=g, dtype=F64)
    mask = (torch.arange(t_len)[None] < torch.tensor([[4], [2], [3]])).to(F64)
    loss_mat, _ = cispo_per_token(logp, old, adv, mask, 0.1, 0.1)
    (grad,) = torch.autograd.grad(loss_mat.sum(), logits)
    p = torch.softmax(logits.detach(), -1)
    hand = torch.zeros_like(p)
    for i in range(n):
        for t in range(t_len):
            if mask[i, t]:
                rho = math.exp(logp[i, t].item() - old[i, t].item())
                w = min(max(rho, 0.9), 1.1)
                onehot = torch.nn.functional.one_hot(tokens[i, t], v).to(F64)
                hand[i, t] = -w * adv[i].item() * (onehot - p[i, t])
    torch.testing.assert_close(grad, hand)


def test_cispo_on_policy_equals_vanilla_pg():
    logp, mask, g = _ragged([3, 1, 4], 4, seed=4)
    logp.requires_grad_(True)
    adv = torch.randn(3, 4, generator=g, dtype=F64)
    a, m = cispo_per_token(logp, logp.detach(), adv, mask, 0.2, 0.2)
    b, _ = vanilla_pg_per_token(logp, logp.detach(), adv, mask)
    torch.testing.assert_close(a, b)
    assert all(v.item() == 0.0 for v in m.values())
