"""Advantage whitening over 2 gloo ranks equals whitening of the whole batch, also when the
mean is large against the spread (mean 1000, std 1: the float32 one-pass variance
``(sum x^2 - n mean^2) / (n - 1)`` cancelled there, a whitened std of 0.915 instead of 1).

The inputs are float32 numbers x with |x| < 1010. The float64 reference (numpy, two
passes) and the two ranks' float64 two-pass sums differ only in the order of ~100
float64 additions: below 100 * 1.1e-16 * 1010 = 1.1e-11 in the mean and relatively
below 1e-13 in the std, so below 1e-10 in a whitened value; the result is then rounded
to float32: |z| < 8, half an ulp < 8 * 6e-8 = 4.8e-7. atol 1e-6 covers both, while the
old formula was off by ~8 % of |z| (0.08 for a typical token).

One process (``masked_whiten``, float32 two passes) is compared with its own bound: a
float32 sum of 28 numbers near 1000 (partial sums < 3e4, half an ulp 1e-3 each) is off
by < 28 * 1e-3 = 0.03, its mean by < 1e-3, so each whitened value by < 2e-3.
"""
import json
import os
from pathlib import Path

import numpy as np
import pytest
from gloo_ranks import run_two_ranks
import torch

ROWS, T = 8, 7


def _data(poison: bool = False):
    """x [N, T], mask [N, T]; ``poison``: NaN and inf where the mask is 0 (garbage a padded
    position may hold), which must not change the whitened values."""
    g = torch.Generator().manual_seed(3)
    x = (1000.0 + torch.randn(ROWS, T, generator=g, dtype=torch.float64)).float()   # [N, T]
    lengths = torch.tensor([7, 3, 0, 5, 1, 6, 2, 4])
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()                     # [N, T]
    if poison:
        junk = torch.where(torch.arange(T)[None, :] % 2 == 0, float("nan"), float("inf"))
        x = torch.where(mask > 0, x, junk.expand(ROWS, T))                           # [N, T]
    return x, mask


def _rank_worker(out_dir: str) -> None:
    """One of 2 ranks (a subprocess of the test): whitens its half of the rows, clean then
    poisoned (one pair of processes for both cases: each start-up imports torch)."""
    from rlctl.dist.backends import build_backend
    from rlctl.train.trainer import whiten_over_ranks

    rank = int(os.environ["RANK"])
    backend = build_backend("torch", "cpu")
    for poison in (False, True):
        x, mask = _data(poison)
        half = slice(rank * ROWS // 2, (rank + 1) * ROWS // 2)
        z = whiten_over_ranks(x[half], mask[half], backend)
        (Path(out_dir) / f"rank{rank}-{poison}.json").write_text(json.dumps(z.double().tolist()))
    backend.close()


@pytest.fixture(scope="module")
def whitened(tmp_path_factory):
    """The directory of rank<r>-<poison>.json for both cases, from one run of 2 ranks."""
    out = tmp_path_factory.mktemp("whiten-ranks")
    run_two_ranks("test_whiten_ranks", f"_rank_worker({str(out)!r})", out, 300)
    return out


@pytest.mark.parametrize("poison", [False, True], ids=["clean", "nan-inf-not-counted"])
def test_two_ranks_whiten_like_one_process_at_mean_1000_std_1(whitened, poison):
    x, mask = _data(poison)
    keep = mask.numpy() > 0
    v = x.double().numpy()[keep]                                             # all finite
    want = np.zeros((ROWS, T))
    want[keep] = (v - v.mean()) / np.sqrt(v.var(ddof=1) + 1e-8)              # float64, two passes
    got = np.concatenate([np.array(json.loads((whitened / f"rank{r}-{poison}.json").read_text()))
                          for r in range(2)])
    assert abs(want[keep].std(ddof=1) - 1) < 1e-6
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    from rlctl.train.trainer import whiten_over_ranks
    one = whiten_over_ranks(x, mask, None).double().numpy()                  # one process
    np.testing.assert_allclose(one, want, rtol=0, atol=2e-3)
    np.testing.assert_allclose(got, one, rtol=0, atol=2e-3 + 1e-6)
