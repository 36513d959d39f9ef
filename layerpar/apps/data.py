"""The bundled data sets, in one place (never downloads anything).

- ``peaks``: the Peaks classification problem of Günther et al. (SIMODS 2020).
- ``digits``: scikit-learn's bundled 8×8 handwritten digits.
- ``mnist1d``: MNIST-1D (Greydanus 2020; the ``mnist1d`` package), 1-D signals of
  length 40 in 10 classes, *generated locally* with ``mnist1d.data.make_dataset``
  (never ``get_dataset``, which downloads); generated arrays are cached on disk
  (`MNIST1D_CACHE`), keyed by the generation arguments.

All are deterministic given ``seed``.  `splits` returns any of them as tensors,
`datasets` as ordinary ``torch.utils.data.Dataset``s and `loaders` as ``DataLoader``s.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from .._checks import nonneg_int, positive_int

__all__ = ["DATASETS", "MNIST1D_CACHE", "datasets", "digits", "loaders", "mnist1d",
           "peaks", "peaks_function", "peaks_labels", "splits"]

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


def peaks(
    n_train: int = 5000, n_val: int = 200, seed: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Balanced Peaks data: (x_train [n_train, 2], y_train [n_train], x_val, y_val).

    Points are drawn uniformly from [-3, 3]² and kept by rejection until each of
    the five classes has n/5 points in each split; each split is then shuffled.
    Labels are computed from the returned (``dtype``) coordinates.  ``n_train``
    and ``n_val`` must be divisible by 5.
    """
    n_train = positive_int("n_train", n_train)
    n_val = nonneg_int("n_val", n_val)
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
            "layerpar.apps.data.digits needs scikit-learn: pip install scikit-learn"
        ) from err
    data = load_digits()
    x = torch.as_tensor(data.images, dtype=torch.float64).unsqueeze(1) / 16.0
    y = torch.as_tensor(data.target, dtype=torch.int64)
    n_val = nonneg_int("n_val", n_val)
    if n_val >= len(x):
        raise ValueError(f"`n_val` must be smaller than {len(x)}, got {n_val}")
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[perm].to(dtype), y[perm]
    return x[n_val:], y[n_val:], x[:n_val], y[:n_val]


# ------------------------------------------------------------------------------------------
# MNIST-1D, generated locally
# ------------------------------------------------------------------------------------------
#: where generated MNIST-1D arrays are kept (``LAYERPAR_CACHE`` overrides the folder)
MNIST1D_CACHE = Path(os.environ.get("LAYERPAR_CACHE",
                                    Path.home() / ".cache" / "layerpar")) / "mnist1d"
MNIST1D_LENGTH = 40  # samples per signal (get_dataset_args' final_seq_length)
MNIST1D_CLASSES = 10


def _mnist1d_arrays(num_samples: int, seed: int, cache: Optional[Path]) -> dict[str, Any]:
    """x, y, x_test, y_test of MNIST-1D with `num_samples` samples in all (80 % train),
    generated by ``mnist1d.data.make_dataset`` and cached as .npz under `cache`."""
    import numpy as np

    try:
        from mnist1d.data import get_dataset_args, make_dataset
    except ImportError as err:
        raise ImportError("layerpar.apps.data.mnist1d needs the mnist1d package: pip install "
                          "mnist1d (or `make setup`)") from err
    args = get_dataset_args()
    args.num_samples, args.seed = num_samples, seed
    key = hashlib.sha256(repr(sorted(vars(args).items())).encode()).hexdigest()[:16]
    path = None if cache is None else Path(cache) / f"mnist1d-{key}.npz"
    if path is not None and path.is_file():
        with np.load(path) as z:
            return {k: z[k] for k in ("x", "y", "x_test", "y_test")}
    import random

    states = random.getstate(), np.random.get_state()
    try:  # local generation (templates, transforms, noise); it reseeds numpy's and
        got = make_dataset(args)  # Python's global generators: put them back after
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
    out = {k: np.asarray(got[k]) for k in ("x", "y", "x_test", "y_test")}
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp.npz")
            np.savez(tmp, **out)
            os.replace(tmp, path)  # atomic: several ranks may write at once
        except OSError:  # a read-only home: generate again next time
            pass
    return out


def mnist1d(num_samples: int = 20000, seed: int = 0, dtype: torch.dtype = torch.float32,
            cache: Optional[Path] = MNIST1D_CACHE) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """MNIST-1D: (x_train [0.8 n, 40], y_train int64, x_val [0.2 n, 40], y_val).

    Generated locally from ``mnist1d.data.get_dataset_args()`` with `num_samples`
    samples and `seed` (no network); the package's own train/test split (80/20) is
    kept.  Generating 20,000 samples takes a few seconds; the arrays are cached under
    `cache` (None: no cache) keyed by all generation arguments.
    """
    num_samples = positive_int("num_samples", num_samples)
    if num_samples < 10:
        raise ValueError(f"`num_samples` must be >= 10, got {num_samples}")
    a = _mnist1d_arrays(num_samples, seed, cache)
    x = torch.as_tensor(a["x"], dtype=dtype)
    xv = torch.as_tensor(a["x_test"], dtype=dtype)
    return (x, torch.as_tensor(a["y"], dtype=torch.int64), xv,
            torch.as_tensor(a["y_test"], dtype=torch.int64))


# ------------------------------------------------------------------------------------------
# one front door for all of them
# ------------------------------------------------------------------------------------------
#: the bundled data sets and how many classes each has
DATASETS: dict[str, int] = {"peaks": PEAKS_CLASSES, "digits": 10, "mnist1d": MNIST1D_CLASSES}

_PEAKS_TRAIN, _PEAKS_VAL, _DIGITS_VAL = 5000, 200, 297


def splits(name: str, seed: int = 0, dtype: torch.dtype = torch.float32,
           **kwargs: Any) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(x_train, y_train, x_val, y_val) of a bundled data set at its standard size:
    peaks 5000/200 points, digits 1500/297 images, mnist1d 16,000/4,000 signals
    (`kwargs` go to `peaks`, `digits` or `mnist1d`)."""
    if name == "peaks":
        kw = {"n_train": _PEAKS_TRAIN, "n_val": _PEAKS_VAL, **kwargs}
        return peaks(seed=seed, dtype=dtype, **kw)
    if name == "digits":
        return digits(**{"n_val": _DIGITS_VAL, **kwargs}, seed=seed, dtype=dtype)
    if name == "mnist1d":
        return mnist1d(seed=seed, dtype=dtype, **kwargs)
    raise ValueError(f"`name` must be one of {sorted(DATASETS)}, got {name!r}")


def datasets(name: str, seed: int = 0, dtype: torch.dtype = torch.float32,
             **kwargs: Any) -> tuple[TensorDataset, TensorDataset]:
    """(train, validation) of a bundled data set as ordinary torch Datasets."""
    xt, yt, xv, yv = splits(name, seed, dtype, **kwargs)
    return TensorDataset(xt, yt), TensorDataset(xv, yv)


def loaders(name: str, batch_size: int, seed: int = 0, dtype: torch.dtype = torch.float32,
            **kwargs: Any) -> tuple[DataLoader, DataLoader]:
    """(train, validation) DataLoaders of a bundled data set: the training one shuffles
    with its own generator seeded by `seed` (the same batch order on every rank and in
    every run), the validation one does not."""
    batch_size = positive_int("batch_size", batch_size)
    train, val = datasets(name, seed, dtype, **kwargs)
    return (DataLoader(train, batch_size=batch_size, shuffle=True,
                       generator=torch.Generator().manual_seed(seed)),
            DataLoader(val, batch_size=batch_size))
