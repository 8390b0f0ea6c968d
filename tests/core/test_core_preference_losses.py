"""The direct preference losses (DPO / cDPO, IPO, SimPO) in float64 against closed forms:
hand values, gradients w.r.t. the policy log-probs, beta -> 0, equal chosen and rejected,
label smoothing, SimPO's margin and length normalisation, micro-batch accumulation, the
registry's needs_reference attribute (user entries too) and the one-line errors."""
import math

import pytest
import torch

from rlctl.core import PREFERENCE_LOSSES, dpo_sigmoid_loss, ipo_loss, simpo_loss

F64 = torch.float64
EPS64 = torch.finfo(F64).eps


def t(*values):
    return torch.tensor(values, dtype=F64)


def sig(z):
    return 1.0 / (1.0 + math.exp(-z))


def softplus(z):
    return max(z, 0.0) + math.log1p(math.exp(-abs(z)))


def grads(fn, chosen, rejected, ref_c, ref_r, len_c, len_r, **kw):
    """(loss [P], d sum(loss) / d chosen [P], d sum(loss) / d rejected [P])."""
    c, r = chosen.clone().requires_grad_(), rejected.clone().requires_grad_()
    loss = fn(c, r, ref_c, ref_r, len_c, len_r, **kw)[0]
    gc, gr = torch.autograd.grad(loss.sum(), (c, r))
    return loss.detach(), gc, gr


def random_pairs(P=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = lambda: -torch.rand(P, generator=g, dtype=F64) * 30         # summed log-probs [P]
    lengths = lambda: torch.randint(1, 40, (P,), generator=g).to(F64)  # [P]
    return logp(), logp(), logp(), logp(), lengths(), lengths()


def test_hand_values():
    # DPO: log-ratios +1 and -1, beta 0.5 -> z = 1
    loss, rc, rr = dpo_sigmoid_loss(t(-3.0), t(-5.0), t(-4.0), t(-4.0), t(2.0), t(2.0), beta=0.5)
    assert loss.item() == pytest.approx(math.log1p(math.exp(-1.0)), abs=1e-15)
    assert (rc.item(), rr.item()) == (0.5, -0.5)
    # IPO: per-token log-ratios 2/2 = 1 and -3/3 = -1, h = 2; target 1 / (2 beta)
    for beta, want in ((0.25, 0.0), (0.5, 1.0), (1.0, 2.25)):
        loss, rc, rr = ipo_loss(t(-6.0), t(-9.0), t(-8.0), t(-6.0), t(2.0), t(3.0), beta=beta)
        assert loss.item() == pytest.approx(want, abs=1e-15)
        assert (rc.item(), rr.item()) == (beta, -beta)
    # SimPO: beta logp / len = 2 * -4/4 = -2 and 2 * -9/3 = -6; margin 3 -> z = 1
    loss, rc, rr = simpo_loss(t(-4.0), t(-9.0), None, None, t(4.0), t(3.0), beta=2.0, gamma=3.0)
    assert loss.item() == pytest.approx(math.log1p(math.exp(-1.0)), abs=1e-15)
    assert (rc.item(), rr.item()) == (-2.0, -6.0)


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_dpo_loss_and_gradient_closed_form(eps):
    # loss = (1-eps) softplus(-z) + eps softplus(z), z = beta (dc - dr); d/dc = beta (-(1-eps) s(-z) + eps s(z))
    chosen, rejected, ref_c, ref_r, len_c, len_r = random_pairs()
    beta = 0.2
    loss, gc, gr = grads(dpo_sigmoid_loss, chosen, rejected, ref_c, ref_r, len_c, len_r,
                         beta=beta, label_smoothing=eps)
    for i in range(len(chosen)):
        z = beta * ((chosen[i] - ref_c[i]) - (rejected[i] - ref_r[i])).item()
        assert loss[i].item() == pytest.approx((1 - eps) * softplus(-z) + eps * softplus(z), abs=1e-12)
        g = beta * (-(1 - eps) * sig(-z) + eps * sig(z))
        assert gc[i].item() == pytest.approx(g, abs=1e-12)
        assert gr[i].item() == pytest.approx(-g, abs=1e-12)


def test_ipo_loss_and_gradient_closed_form():
    # loss = (h - 1/(2 beta))^2, h = dc/|c| - dr/|r|; d/dc = 2 (h - 1/(2 beta)) / |c|
    chosen, rejected, ref_c, ref_r, len_c, len_r = random_pairs(seed=1)
    beta = 0.1
    loss, gc, gr = grads(ipo_loss, chosen, rejected, ref_c, ref_r, len_c, len_r, beta=beta)
    for i in range(len(chosen)):
        h = ((chosen[i] - ref_c[i]) / len_c[i] - (rejected[i] - ref_r[i]) / len_r[i]).item()
        d = h - 1 / (2 * beta)
        assert loss[i].item() == pytest.approx(d * d, abs=1e-12)
        assert gc[i].item() == pytest.approx(2 * d / len_c[i].item(), abs=1e-12)
        assert gr[i].item() == pytest.approx(-2 * d / len_r[i].item(), abs=1e-12)


@pytest.mark.parametrize("eps,gamma", [(0.0, 0.0), (0.0, 1.5), (0.2, 0.7)])
def test_simpo_loss_and_gradient_closed_form(eps, gamma):
    # z = beta c/|c| - beta r/|r| - gamma; d/dc = beta/|c| (-(1-eps) s(-z) + eps s(z)); no reference
    chosen, rejected, _, _, len_c, len_r = random_pairs(seed=2)
    beta = 2.0
    loss, gc, gr = grads(simpo_loss, chosen, rejected, None, None, len_c, len_r, beta=beta,
                         label_smoothing=eps, gamma=gamma)
    for i in range(len(chosen)):
        lc, lr = len_c[i].item(), len_r[i].item()
        z = beta * chosen[i].item() / lc - beta * rejected[i].item() / lr - gamma
        assert loss[i].item() == pytest.approx((1 - eps) * softplus(-z) + eps * softplus(z), abs=1e-12)
        g = -(1 - eps) * sig(-z) + eps * sig(z)
        assert gc[i].item() == pytest.approx(beta / lc * g, abs=1e-12)
        assert gr[i].item() == pytest.approx(-beta / lr * g, abs=1e-12)
    # the reference is ignored when given; doubling a completion's length halves its reward
    same = simpo_loss(chosen, rejected, chosen * 0 - 7, rejected * 0 + 3, len_c, len_r, beta=beta,
                      label_smoothing=eps, gamma=gamma)[0]
    assert torch.equal(same, loss)
    r1 = simpo_loss(chosen, rejected, None, None, len_c, len_r, beta=beta)[1]
    r2 = simpo_loss(chosen, rejected, None, None, 2 * len_c, len_r, beta=beta)[1]
    assert torch.allclose(r2, r1 / 2, rtol=0, atol=1e-15)


@pytest.mark.parametrize("eps", [0.0, 0.25])
def test_equal_chosen_and_rejected(eps):
    # z = 0: loss log 2 whatever eps; gradient -beta (1 - 2 eps) / 2 per pair, +that on rejected
    x, ref = t(-3.0, -11.0, -0.5), t(-2.0, -12.0, -4.0)
    n = t(3.0, 7.0, 1.0)
    beta = 0.3
    loss, gc, gr = grads(dpo_sigmoid_loss, x, x.clone(), ref, ref.clone(), n, n, beta=beta,
                         label_smoothing=eps)
    assert torch.allclose(loss, torch.full_like(loss, math.log(2)), rtol=0, atol=2 * EPS64)
    want = torch.full_like(gc, -beta * (1 - 2 * eps) / 2)
    assert torch.allclose(gc, want, rtol=0, atol=2 * EPS64) and torch.equal(gr, -gc)
    # SimPO without a margin: log 2 and -beta / (2 |c|); IPO: (1/(2 beta))^2, gradient -1/(beta |c|)
    loss, gc, _ = grads(simpo_loss, x, x.clone(), None, None, n, n, beta=beta)
    assert torch.allclose(loss, torch.full_like(loss, math.log(2)), rtol=0, atol=2 * EPS64)
    assert torch.allclose(gc, -beta / (2 * n), rtol=0, atol=2 * EPS64)
    loss, gc, _ = grads(ipo_loss, x, x.clone(), ref, ref.clone(), n, n, beta=beta)
    assert torch.allclose(loss, torch.full_like(loss, 1 / (2 * beta) ** 2), rtol=1e-15, atol=0)
    assert torch.allclose(gc, -1 / (beta * n), rtol=1e-15, atol=0)


def test_beta_to_zero_limits():
    # DPO: loss = log 2 - z/2 + O(z^2), d/dc -> -beta/2; SimPO likewise with beta/|c|;
    # IPO: beta^2 loss -> 1/4 and beta d/dc -> -1/|c|. Error: O(beta) + float64 rounding / beta.
    chosen, rejected, ref_c, ref_r, len_c, len_r = random_pairs(seed=3)
    beta = 1e-9
    tol = 1e-6
    dc, dr = chosen - ref_c, rejected - ref_r
    loss, gc, gr = grads(dpo_sigmoid_loss, chosen, rejected, ref_c, ref_r, len_c, len_r, beta=beta)
    assert torch.allclose((loss - math.log(2)) / beta, -(dc - dr) / 2, rtol=0, atol=tol)
    assert torch.allclose(gc / beta, torch.full_like(gc, -0.5), rtol=0, atol=tol)
    assert torch.allclose(gr / beta, torch.full_like(gr, 0.5), rtol=0, atol=tol)
    loss, gc, _ = grads(simpo_loss, chosen, rejected, None, None, len_c, len_r, beta=beta)
    z = chosen / len_c - rejected / len_r
    assert torch.allclose((loss - math.log(2)) / beta, -z / 2, rtol=0, atol=tol)
    assert torch.allclose(gc * len_c / beta, torch.full_like(gc, -0.5), rtol=0, atol=tol)
    loss, gc, gr = grads(ipo_loss, chosen, rejected, ref_c, ref_r, len_c, len_r, beta=beta)
    assert torch.allclose(beta ** 2 * loss, torch.full_like(loss, 0.25), rtol=0, atol=tol)
    assert torch.allclose(beta * gc, -1 / len_c, rtol=0, atol=tol)
    assert torch.allclose(beta * gr, 1 / len_r, rtol=0, atol=tol)


def test_label_smoothing_moves_the_optimum():
    # cDPO's gradient vanishes where sigmoid(z) = 1 - eps: z* = log((1 - eps) / eps); plain DPO's never
    eps, beta = 0.1, 0.5
    z_star = math.log((1 - eps) / eps)
    rejected = t(-4.0)
    chosen = rejected + z_star / beta
    zero = t(0.0)
    _, gc, _ = grads(dpo_sigmoid_loss, chosen, rejected, zero, zero, t(1.0), t(1.0), beta=beta,
                     label_smoothing=eps)
    assert abs(gc.item()) < 1e-15
    _, gc, _ = grads(dpo_sigmoid_loss, chosen, rejected, zero, zero, t(1.0), t(1.0), beta=beta)
    assert gc.item() == pytest.approx(-beta * eps, abs=1e-15)


def _case(name, P, seed, beta, eps, gamma):
    """(loss fn, P random pairs, its keywords): no label smoothing for ipo, gamma for simpo only."""
    kw = dict(beta=beta, label_smoothing=eps if name != "ipo" else 0.0,
              gamma=gamma if name == "simpo" else 0.0)
    return PREFERENCE_LOSSES.get(name), random_pairs(P=P, seed=seed), kw


@pytest.mark.parametrize("name", ["sigmoid", "ipo", "simpo"])
def test_micro_batches_sum_to_the_one_batch_mean(name):
    # the caller's contract: sum of per-pair losses over chunks / P == the batch mean, gradients too
    fn, (chosen, rejected, ref_c, ref_r, len_c, len_r), kw = _case(name, 13, 4, 0.3, 0.1, 0.5)
    c1, r1 = chosen.clone().requires_grad_(), rejected.clone().requires_grad_()
    whole = fn(c1, r1, ref_c, ref_r, len_c, len_r, **kw)[0].mean()
    whole.backward()
    c2, r2 = chosen.clone().requires_grad_(), rejected.clone().requires_grad_()
    total = torch.zeros((), dtype=F64)
    for idx in (slice(0, 4), slice(4, 5), slice(5, 13)):
        part = fn(c2[idx], r2[idx], ref_c[idx], ref_r[idx], len_c[idx], len_r[idx], **kw)[0]
        (part.sum() / 13).backward()
        total += part.detach().sum() / 13
    assert abs(total.item() - whole.item()) <= 1e-12
    assert torch.allclose(c2.grad, c1.grad, rtol=0, atol=1e-12)
    assert torch.allclose(r2.grad, r1.grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ["sigmoid", "ipo", "simpo"])
def test_gradcheck_all_inputs(name):
    fn, (chosen, rejected, ref_c, ref_r, len_c, len_r), kw = _case(name, 4, 5, 0.4, 0.05, 0.3)
    inputs = tuple(x.clone().requires_grad_() for x in (chosen, rejected, ref_c, ref_r))
    assert torch.autograd.gradcheck(lambda c, r, a, b: fn(c, r, a, b, len_c, len_r, **kw)[0], inputs)


def test_rewards_detached_dtypes_and_needs_reference():
    assert [PREFERENCE_LOSSES.entry(n).needs_reference for n in ("sigmoid", "ipo", "simpo")] == \
        [True, True, False]
    x = torch.tensor([-2.0, -3.0], dtype=torch.bfloat16, requires_grad=True)
    n = torch.tensor([2, 3])                                     # integer lengths are fine
    for name in PREFERENCE_LOSSES:
        loss, rc, rr = PREFERENCE_LOSSES.get(name)(x, x * 2, x * 0, x * 0, n, n, beta=0.1)
        assert loss.dtype == rc.dtype == torch.float32 and loss.requires_grad
        assert not rc.requires_grad and not rr.requires_grad


def test_user_entry_by_path_reads_needs_reference(tmp_path):
    path = tmp_path / "mypref.py"
    path.write_text("def free(*a, **k):\n    return a[0], a[0], a[1]\nfree.needs_reference = False\n"
                    "def ref(*a, **k):\n    return a[0], a[0], a[1]\n")
    assert PREFERENCE_LOSSES.entry(f"{path}:free").needs_reference is False
    assert PREFERENCE_LOSSES.entry(f"{path}:ref").needs_reference is True   # the safe default


@pytest.mark.parametrize("name,kw,match", [
    ("sigmoid", dict(beta=0.1, gamma=1.0), "'sigmoid' does not use gamma"),
    ("ipo", dict(beta=0.1, label_smoothing=0.1), "'ipo' does not use label_smoothing"),
    ("simpo", dict(beta=0.0), "beta must be > 0"),
    ("sigmoid", dict(beta=0.1, label_smoothing=0.5), r"label_smoothing must be in \[0, 0.5\)"),
])
def test_bad_options_one_line(name, kw, match):
    x = t(-1.0, -2.0)
    with pytest.raises(ValueError, match=match) as err:
        PREFERENCE_LOSSES.get(name)(x, x, x, x, x, x, **kw)
    assert "\n" not in str(err.value)


def test_missing_reference_and_shape_errors():
    x = t(-1.0, -2.0)
    with pytest.raises(ValueError, match="'ipo' needs the reference log-probs"):
        ipo_loss(x, x, None, None, x, x, beta=0.1)
    with pytest.raises(ValueError, match=r"every input must be \[P\] of one size"):
        dpo_sigmoid_loss(x, t(-1.0), x, x, x, x, beta=0.1)
