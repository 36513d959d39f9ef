"""The bundled problems' defaults: network size and a training budget that works.

``layerpar train``, the examples and the accuracy study train these problems
(`layerpar.apps.nets.problem_net` builds them); ``layerpar train --help`` prints this
table.  This module imports nothing beyond the standard library, so the command line
reads it without loading torch.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ARCHITECTURES", "PROBLEMS", "RECIPES", "Recipe"]


@dataclass(frozen=True)
class Recipe:
    """Defaults of one problem: network size and a training budget that works.

    Both problems use Adam with cosine decay of the learning rate to zero over the
    run: the decay makes the final accuracy settle instead of jumping from epoch to
    epoch, so serial and layer-parallel runs can be compared at the end.
    """

    epochs: int
    batch_size: int
    lr: float
    n_layers: int
    width: int
    t_final: float


RECIPES: dict[str, Recipe] = {
    # the Peaks benchmark of the layer-parallel literature: width 8, 32 layers
    # u <- u + h tanh(K u + b), T = 5
    "peaks": Recipe(epochs=20, batch_size=100, lr=0.02, n_layers=32, width=8, t_final=5.0),
    # a small convolutional ODE-net on 1x8x8 images; width = channels
    "digits": Recipe(epochs=8, batch_size=50, lr=0.01, n_layers=8, width=8, t_final=2.0),
    # MNIST-1D (issue 20): a deep ODE-net, dense (width = features) or conv (channels)
    "mnist1d": Recipe(epochs=10, batch_size=128, lr=3e-3, n_layers=256, width=32,
                      t_final=1.0),
}
#: the architectures each problem can be built with (the first is its default)
ARCHITECTURES: dict[str, tuple[str, ...]] = {
    "peaks": ("dense",), "digits": ("conv",), "mnist1d": ("dense", "conv")}
PROBLEMS = tuple(RECIPES)
