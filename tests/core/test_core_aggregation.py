"""Loss aggregation modes against explicit loops, and exact micro-batch accumulation."""
import pytest
import torch

from rlctl.core import AGG_MODES, agg_denominator, aggregate, aggregate_sum

LENGTHS = [5, 2, 0, 4]  # row 2 has no counted token


def _batch(dtype=torch.float64, t=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(len(LENGTHS), t, generator=g, dtype=dtype)
    mask = (torch.arange(t)[None, :] < torch.tensor(LENGTHS)[:, None]).to(dtype)
    return loss, mask


def _loop(loss, mask, mode, norm_len=None):
    rows = [(sum(loss[i, t].item() for t in range(loss.shape[1]) if mask[i, t]),
             int(mask[i].sum().item())) for i in range(loss.shape[0])]
    rows = [(s, n) for s, n in rows if n > 0]
    if mode == "token-mean":
        return sum(s for s, _ in rows) / sum(n for _, n in rows)
    if mode == "seq-mean-token-mean":
        return sum(s / n for s, n in rows) / len(rows)
    seq_sum = sum(s for s, _ in rows) / len(rows)
    return seq_sum if mode == "seq-mean-token-sum" else seq_sum / (norm_len or loss.shape[1])


@pytest.mark.parametrize("mode", AGG_MODES)
def test_modes_match_loops(mode):
    loss, mask = _batch()
    assert aggregate(loss, mask, mode).item() == pytest.approx(_loop(loss, mask, mode))
    assert aggregate(loss, mask, mode, norm_len=16).item() == pytest.approx(
        _loop(loss, mask, mode, norm_len=16))
    # aggregate == aggregate_sum / agg_denominator
    ratio = aggregate_sum(loss, mask, mode) / agg_denominator(mask, mode)
    assert ratio.item() == pytest.approx(aggregate(loss, mask, mode).item())


@pytest.mark.parametrize("mode", AGG_MODES[1:])
def test_empty_row_ignored_by_seq_modes(mode):
    loss, mask = _batch()
    keep = torch.tensor([0, 1, 3])
    torch.testing.assert_close(aggregate(loss, mask, mode),
                               aggregate(loss[keep], mask[keep], mode))


@pytest.mark.parametrize("mode", AGG_MODES)
def test_all_zero_mask_gives_zero(mode):
    loss = torch.randn(3, 4, requires_grad=True)
    out = aggregate(loss, torch.zeros(3, 4), mode)
    out.backward()
    assert out.item() == 0.0 and torch.equal(loss.grad, torch.zeros(3, 4))
    nan_loss = torch.full((2, 3), float("nan"))
    assert aggregate(nan_loss, torch.zeros(2, 3), mode).item() == 0.0


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_constant_loss_aggregates_to_constant(mode):
    _, mask = _batch(torch.float32)
    assert aggregate(torch.full(mask.shape, 0.37), mask, mode).item() == pytest.approx(0.37)


def test_aliases_unknown_and_bf16():
    loss, mask = _batch(torch.float32)
    for mode in AGG_MODES:
        torch.testing.assert_close(aggregate(loss, mask, mode.replace("-", "_")),
                                   aggregate(loss, mask, mode))
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm"):
        aggregate(loss, mask, "sequence-mean")
    out = aggregate(loss.bfloat16(), mask.bfloat16(), "seq-mean-token-mean")
    assert out.dtype == torch.float32 and torch.isfinite(out)


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_micro_batch_accumulation_matches_full_batch(mode, k):
    torch.manual_seed(0)
    n, t = 8, 6
    lengths = torch.tensor([6, 1, 0, 3, 6, 2, 5, 4])
    mask = (torch.arange(t)[None, :] < lengths[:, None]).double()
    x = torch.randn(n, t, dtype=torch.float64)
    w = torch.randn(t, dtype=torch.float64, requires_grad=True)

    def loss_mat(rows):
        return (x[rows] * w) ** 2  # [n_k, T], depends on the shared parameter w

    all_rows = torch.arange(n)
    (g_full,) = torch.autograd.grad(aggregate(loss_mat(all_rows), mask, mode), w)
    den = agg_denominator(mask, mode)  # global, computed once
    g_acc = torch.zeros_like(w)
    for rows in all_rows.chunk(k):
        (g,) = torch.autograd.grad(aggregate_sum(loss_mat(rows), mask[rows], mode) / den, w)
        g_acc += g
    torch.testing.assert_close(g_acc, g_full, rtol=0, atol=1e-6)


def test_naive_micro_batch_mean_is_not_exact():
    """Sanity: averaging per-micro-batch token-means differs when lengths differ."""
    loss, mask = _batch()
    naive = (aggregate(loss[:2], mask[:2]) + aggregate(loss[2:], mask[2:])) / 2
    assert abs(naive.item() - aggregate(loss, mask).item()) > 1e-3
