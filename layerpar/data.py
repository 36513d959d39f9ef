"""Small bundled data sets for tests and examples (never downloads anything).

- ``peaks``: the Peaks classification problem of Günther et al. (SIMODS 2020).
- ``digits``: scikit-learn's bundled 8×8 handwritten digits.

Both are deterministic given ``seed``.
"""

from __future__ import annotations

import functools
import numbers

import torch
from torch import Tensor

__all__ = ["peaks_function", "peaks_labels", "peaks", "digits"]

PEAKS_CLASSES = 5
_PEAKS_GRID = 256


def peaks_function(x: Tensor | float, y: Tensor | float) -> Tensor:
    """z = 3(1-x)² e^{-x²-(y+1)²} - 10(x/5 - x³ - y⁵) e^{-x²-y²} - (1/3) e^{-(x+1)²-y²}."""
    x = torch.as_tensor(x)
    y = torch.as_tensor(y)
    return (
        3 * (1 - x) ** 2 * torch.exp(-(x**2) - (y + 1) ** 2)
        - 10 * (x / 5 - x**3 - y**5) * torch.exp(-(x**2) - y**2)
        - (1 / 3) * torch.exp(-((x + 1) ** 2) - y**2)
    )


@functools.cache
def _peaks_range() -> tuple[float, float]:
    g = torch.linspace(-3.0, 3.0, _PEAKS_GRID, dtype=torch.float64)
    gx, gy = torch.meshgrid(g, g, indexing="ij")
    z = peaks_function(gx, gy)
    return z.min().item(), z.max().item()


def peaks_labels(points: Tensor) -> Tensor:
    """Class (0..4, int64) of points [n, 2]: the equal-width bin of z over the 256² grid range.

    z is computed in float64 from the given coordinates; values outside the grid's
    [min, max] fall into the first or last class.
    """
    zmin, zmax = _peaks_range()
    p = points.to(torch.float64)
    z = peaks_function(p[:, 0], p[:, 1])
    bins = torch.floor((z - zmin) / (zmax - zmin) * PEAKS_CLASSES)
    return bins.clamp(0, PEAKS_CLASSES - 1).to(torch.int64)


def _count(value: object, name: str, *, positive: bool) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"`{name}` must be an int, got {type(value).__name__}")
    if value < (1 if positive else 0):
        raise ValueError(f"`{name}` must be {'positive' if positive else '>= 0'}, got {value}")
    return int(value)


def peaks(
    n_train: int = 5000, n_val: int = 200, seed: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Balanced Peaks data: (x_train [n_train, 2], y_train [n_train], x_val, y_val).

    Points are drawn uniformly from [-3, 3]² and kept by rejection until each of
    the five classes has n/5 points in each split; each split is then shuffled.
    Labels are computed from the returned (``dtype``) coordinates.  ``n_train``
    and ``n_val`` must be divisible by 5.
    """
    n_train = _count(n_train, "n_train", positive=True)
    n_val = _count(n_val, "n_val", positive=False)
    for name, n in (("n_train", n_train), ("n_val", n_val)):
        if n % PEAKS_CLASSES:
            raise ValueError(f"`{name}` must be divisible by {PEAKS_CLASSES}, got {n}")
    gen = torch.Generator().manual_seed(seed)
    per_train, per_val = n_train // PEAKS_CLASSES, n_val // PEAKS_CLASSES
    need = per_train + per_val
    kept: list[list[Tensor]] = [[] for _ in range(PEAKS_CLASSES)]
    have = [0] * PEAKS_CLASSES
    while min(have) < need:
        cand = (torch.rand(65536, 2, generator=gen, dtype=torch.float64) * 6 - 3).to(dtype)
        labels = peaks_labels(cand)
        for c in range(PEAKS_CLASSES):
            take = cand[labels == c][: need - have[c]]
            kept[c].append(take)
            have[c] += len(take)
    per_class = [torch.cat(k) for k in kept]

    def split(lo: int, hi: int) -> tuple[Tensor, Tensor]:
        x = torch.cat([p[lo:hi] for p in per_class])
        y = torch.arange(PEAKS_CLASSES).repeat_interleave(hi - lo)
        perm = torch.randperm(len(x), generator=gen)
        return x[perm], y[perm]

    x_train, y_train = split(0, per_train)
    x_val, y_val = split(per_train, need)
    return x_train, y_train, x_val, y_val


def digits(
    n_val: int = 297, seed: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """scikit-learn's 8×8 digits: (x_train [n, 1, 8, 8] in [0, 1], y_train int64, x_val, y_val).

    The 1797 images are split at random (fixed by ``seed``) into ``n_val``
    validation images and the rest for training.
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:
        raise ImportError(
            "layerpar.data.digits needs scikit-learn: pip install scikit-learn"
        ) from err
    data = load_digits()
    x = torch.as_tensor(data.images, dtype=torch.float64).unsqueeze(1) / 16.0
    y = torch.as_tensor(data.target, dtype=torch.int64)
    n_val = _count(n_val, "n_val", positive=False)
    if n_val >= len(x):
        raise ValueError(f"`n_val` must be smaller than {len(x)}, got {n_val}")
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[perm].to(dtype), y[perm]
    return x[n_val:], y[n_val:], x[:n_val], y[:n_val]
