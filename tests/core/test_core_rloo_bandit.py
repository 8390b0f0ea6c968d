"""RLOO is unbiased on a 3-token bandit; a baseline that includes the sample
itself shrinks the gradient by (G-1)/G.

Bandit: one-token answers from {A, B, C}, logits z = 0 (p = 1/3 each), R = 1 iff A.
Exact gradient of E[R]: sum_k p_k R_k (e_k - p) = 1/3 (2/3, -1/3, -1/3) = (2/9, -1/9, -1/9).
"""
import math

import pytest
import torch

from rlctl.core import aggregate, get_advantage_estimator, token_logprobs, vanilla_pg_per_token

F64 = torch.float64
TRUE_GRAD = torch.tensor([2 / 9, -1 / 9, -1 / 9], dtype=F64)
GROUPS = 100_000


def _hoeffding_tol(groups: int, delta: float = 1e-6) -> float:
    # Per group the estimate g_s = 1/G sum_j A_j (e_{a_j} - p): with 0/1 rewards every
    # advantage below lies in [-1, 1] and every component of e_a - p in [-1/3, 2/3], so a
    # component of g_s lies in [-2/3, 2/3] (width 4/3). The groups are i.i.d., so by
    # Hoeffding P(|mean - E| > tol) <= 2 exp(-2 S tol^2 / (4/3)^2) = delta:
    return 4 / 3 * math.sqrt(math.log(2 / delta) / (2 * groups))  # ~0.011 for S = 1e5


def _estimated_grad(estimator: str, group_size: int, seed: int) -> torch.Tensor:
    """Average over GROUPS * G samples of A_j * grad_z log p(a_j), via the library's
    estimator, REINFORCE loss and autograd. Returns the objective's gradient [3]."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.zeros(3, dtype=F64, requires_grad=True)
    n = GROUPS * group_size
    actions = torch.multinomial(torch.softmax(logits.detach(), -1), n, replacement=True,
                                generator=gen)  # [S*G]
    rewards = (actions == 0).to(F64).view(GROUPS, group_size)  # [S, G]
    adv = get_advantage_estimator(estimator)(rewards, 1e-6)  # [S, G]
    logp = token_logprobs(logits.expand(1, n, 3), actions.view(1, n))  # [1, S*G]
    loss_mat, _ = vanilla_pg_per_token(logp, None, adv.view(1, n), torch.ones(1, n))
    (grad,) = torch.autograd.grad(aggregate(loss_mat, torch.ones(1, n), "token-mean"), logits)
    return -grad  # the loss is -objective


def test_exact_gradient_by_enumeration():
    p = torch.full((3,), 1 / 3, dtype=F64)
    exact = sum(p[k] * (1.0 if k == 0 else 0.0) * (torch.eye(3, dtype=F64)[k] - p)
                for k in range(3))
    torch.testing.assert_close(exact, TRUE_GRAD)


def test_rloo_is_unbiased_g4():
    tol = _hoeffding_tol(GROUPS)
    est = _estimated_grad("rloo", 4, seed=0)
    assert (est - TRUE_GRAD).abs().max().item() < tol, (est, tol)


@pytest.mark.parametrize("group_size", [2, 4])
def test_baseline_including_self_scales_gradient_by_g_minus_1_over_g(group_size):
    # Mean including self (dr_grpo = r - group mean):
    #   r_j - 1/G sum_k r_k = (G-1)/G * (r_j - 1/(G-1) sum_{k != j} r_k)
    # i.e. (G-1)/G times the RLOO advantage, sample by sample. The RLOO term has
    # expectation grad J (its baseline is independent of a_j), so the expected gradient
    # is (G-1)/G * grad J: for G = 2, half the true gradient (a biased estimator).
    factor = (group_size - 1) / group_size
    tol = factor * _hoeffding_tol(GROUPS)  # advantages scaled by factor: range too
    est = _estimated_grad("dr_grpo", group_size, seed=1)
    assert (est - factor * TRUE_GRAD).abs().max().item() < tol, (est, tol)
    # and the bias is far larger than the sampling error: the estimate is not grad J
    assert (est - TRUE_GRAD).abs().max().item() > 3 * tol
