"""The bundled problems' defaults: network size and a training budget that works.

`RECIPES` holds each problem's default architecture's recipe; `ARCH_RECIPES` those of
architectures that train with their own; `recipe_for` picks one.

``layerpar train``, the examples and the accuracy study train these problems
(`layerpar.apps.nets.problem_net` builds them); ``layerpar train --help`` prints this
table.  This module imports nothing beyond the standard library, so the command line
reads it without loading torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["ARCHITECTURES", "ARCH_RECIPES", "PROBLEMS", "RECIPES", "Recipe", "recipe_for",
           "recipe_groups"]


@dataclass(frozen=True)
class Recipe:
    """Defaults of one problem (and architecture): network size and a training budget
    that works.

    Every problem uses Adam with cosine decay of the learning rate to zero over the
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
    # MNIST-1D: a deep narrow ODE-net, dense (width = features) or conv (channels); the
    # latency-bound case (tiny layers), not an accurate one
    "mnist1d": Recipe(epochs=10, batch_size=128, lr=3e-3, n_layers=256, width=32,
                      t_final=1.0),
}
#: the architectures each problem can be built with (the first is its default)
ARCHITECTURES: dict[str, tuple[str, ...]] = {
    "peaks": ("dense",), "digits": ("conv",),
    "mnist1d": ("dense", "conv", "resnet", "prenorm")}
#: the recipes of architectures that train with their own (the others: `RECIPES`)
ARCH_RECIPES: dict[tuple[str, str], Recipe] = {
    # convolutional ResNet: three segments of width/2width/4width channels (lengths 40,
    # 20, 10), batch norm in every block; n_layers in all, t_final per segment (99 %
    # serially: docs/results/mnist1d-recipes)
    ("mnist1d", "resnet"): Recipe(epochs=6, batch_size=128, lr=3e-3, n_layers=128, width=16,
                                  t_final=2.0),
    # dense pre-norm ResNet: u <- u + h W2 gelu(W1 LayerNorm(u)); with h = T/N small
    # the 256 layers train like a 32-layer ResNet of step 0.5 (85 % serially)
    ("mnist1d", "prenorm"): Recipe(epochs=10, batch_size=128, lr=1e-3, n_layers=256,
                                   width=128, t_final=16.0),
}
PROBLEMS = tuple(RECIPES)


def recipe_for(problem: str, arch: Optional[str] = None) -> Recipe:
    """The `Recipe` of `problem` built as `arch` (None: the problem's default
    architecture, the first of `ARCHITECTURES`)."""
    if problem not in RECIPES:
        raise ValueError(f"`model_name` must be one of {list(PROBLEMS)}, got {problem!r}")
    archs = ARCHITECTURES[problem]
    if arch is not None and arch not in archs:
        raise ValueError(f"`arch` must be one of {list(archs)} for {problem}, got {arch!r}")
    return ARCH_RECIPES.get((problem, arch or archs[0]), RECIPES[problem])


def recipe_groups(problem: str) -> list[tuple[tuple[str, ...], Recipe]]:
    """`problem`'s architectures grouped by the recipe they train with, the default's
    group first: what one row of ``layerpar train --help``'s table shows."""
    groups: dict[Recipe, list[str]] = {}
    for arch in ARCHITECTURES[problem]:
        groups.setdefault(recipe_for(problem, arch), []).append(arch)
    return [(tuple(archs), r) for r, archs in groups.items()]
