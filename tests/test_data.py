"""Tests of layerpar.apps.data: Peaks and digits are balanced/ranged/deterministic as documented."""

from __future__ import annotations

import pytest
import torch

from layerpar.apps.data import digits, peaks, peaks_function


def test_peaks_shapes_balance_and_range():
    xt, yt, xv, yv = peaks(n_train=500, n_val=50, seed=3)
    assert xt.shape == (500, 2) and yt.shape == (500,) and xv.shape == (50, 2)
    assert xt.dtype == torch.float32 and yt.dtype == torch.int64
    assert yt.bincount().tolist() == [100] * 5 and yv.bincount().tolist() == [10] * 5
    assert xt.abs().max() <= 3 and xv.abs().max() <= 3
    assert not torch.equal(yt[:100], yt[:100].sort().values)  # shuffled


def test_peaks_labels_follow_the_formula():
    xt, yt, _, _ = peaks(n_train=500, n_val=0, seed=1, dtype=torch.float64)
    g = torch.linspace(-3, 3, 256, dtype=torch.float64)
    z = peaks_function(*torch.meshgrid(g, g, indexing="ij"))
    edges = torch.linspace(z.min().item(), z.max().item(), 6, dtype=torch.float64)
    zt = peaks_function(xt[:, 0], xt[:, 1])
    expected = (torch.bucketize(zt, edges[1:-1], right=True)).clamp(0, 4)
    # a bin edge computed two ways may differ by one ulp; no sample lies that close
    assert (expected == yt).all()


def test_peaks_function_value():
    # z(0, 0) = 3e^{-1} - 0 - (1/3)e^{-1}
    torch.testing.assert_close(
        peaks_function(0.0, 0.0), torch.tensor(3 / torch.e - 1 / (3 * torch.e)).float()
    )


def test_peaks_deterministic_per_seed():
    a = peaks(n_train=100, n_val=20, seed=5)
    b = peaks(n_train=100, n_val=20, seed=5)
    c = peaks(n_train=100, n_val=20, seed=6)
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert not torch.equal(a[0], c[0])


@pytest.mark.parametrize("kw, arg", [({"n_train": 12}, "`n_train`"), ({"n_val": 7}, "`n_val`")])
def test_peaks_sizes_must_divide_by_five(kw, arg):
    with pytest.raises(ValueError, match=arg):
        peaks(**kw)


def test_digits():
    pytest.importorskip("sklearn")
    xt, yt, xv, yv = digits(n_val=297, seed=0)
    assert xt.shape == (1500, 1, 8, 8) and xv.shape == (297, 1, 8, 8)
    assert yt.dtype == torch.int64 and set(yt.tolist()) == set(range(10))
    assert xt.min() == 0 and xt.max() == 1
    again = digits(n_val=297, seed=0)
    assert all(torch.equal(u, v) for u, v in zip((xt, yt, xv, yv), again))
    assert not torch.equal(digits(seed=1)[1], yt)
    with pytest.raises(ValueError, match="`n_val`"):
        digits(n_val=1797)
