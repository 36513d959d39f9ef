"""Every network the front doors build, in one place, and the plain-PyTorch twin of one.

Two families, with names that say which:

- **problems** (`PROBLEMS`: "peaks", "digits", "mnist1d"): the bundled learning problems
  that ``layerpar train``, the examples and the accuracy study train, each with a
  `Recipe` (network size and a training budget that works, `layerpar.apps.recipes`);
  `problem_net` builds them.
- **synthetic models** (`SYNTHETIC_MODELS`: "dense", "conv"): the scaling studies'
  networks of any depth, width and batch on random data (`layerpar.apps.studies.runs`
  picks their sizes from a study's settings); `synthetic_net` builds them.

`sequential_twin` turns an `ODENet` into plain PyTorch (an ``nn.Sequential`` of
``u + h F(u)`` modules sharing its blocks): the serial baseline of the studies and
the benchmarks.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from .._checks import positive_int
from ..ode import blocks
from ..ode.net import ODENet, Segment
from . import data
from .recipes import ARCHITECTURES, PROBLEMS, RECIPES, Recipe, recipe_for

__all__ = ["ARCHITECTURES", "PROBLEMS", "RECIPES", "Recipe", "SYNTHETIC_MODELS",
           "mnist1d_prenorm", "mnist1d_resnet", "problem_net", "recipe_for", "sequential_twin",
           "synthetic_input_shape", "synthetic_net"]


# ------------------------------------------------------------------------------------------
# problems: peaks, digits, mnist1d (their recipes: layerpar.apps.recipes)
# ------------------------------------------------------------------------------------------
def problem_name(name: Any) -> str:
    """`name` if it is one of `PROBLEMS`, else ValueError naming ``model_name``."""
    if name not in RECIPES:
        raise ValueError(f"`model_name` must be one of {list(PROBLEMS)}, got {name!r}")
    return name


def problem_net(model_name: str, n_layers: Optional[int] = None,
                width: Optional[int] = None, *, arch: Optional[str] = None,
                t_final: Optional[float] = None) -> ODENet:
    """The `ODENet` of a problem, with fresh parameters from the global torch generator.

    peaks: Linear(2, w) -> n residual layers u <- u + h tanh(K u + b) on [0, 5] ->
    Linear(w, 5) (the literature's Peaks net: w = 8, n = 32).
    digits: Conv2d(1, c, 3) -> n residual layers u <- u + h relu(conv3x3(u)) on [0, 2]
    -> 2x2 average pooling -> Linear(16 c, 10) (c = 8, n = 8).
    mnist1d, arch "dense": Linear(40, w) -> n layers u <- u + h tanh(K u + b) on
    [0, 1] -> Linear(w, 10) (w = 32, n = 256); arch "conv": the signal as one channel
    -> Conv1d(1, c, 5) -> n layers u <- u + h relu(conv1d_3(u)) on [0, 1] ->
    Linear(40 c, 10); arch "resnet": `mnist1d_resnet`; arch "prenorm": `mnist1d_prenorm`.
    `arch` (default: the problem's first in `ARCHITECTURES`) chooses the recipe
    (`layerpar.apps.recipes.recipe_for`) whose n, w and T apply where `n_layers`, `width`
    and `t_final` are None.
    Seed the global generator first (``torch.manual_seed``) to build the same network
    on every rank.
    """
    arch = ARCHITECTURES[problem_name(model_name)][0] if arch is None else arch
    r = recipe_for(model_name, arch)
    n = r.n_layers if n_layers is None else positive_int("n_layers", n_layers)
    w = r.width if width is None else positive_int("width", width)
    t = r.t_final if t_final is None else t_final
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not (
            math.isfinite(t) and t > 0):
        raise ValueError(f"`t_final` must be a positive finite number, got {t!r}")
    t = float(t)
    if model_name == "mnist1d" and arch == "resnet":
        return mnist1d_resnet(n, w, t)
    if model_name == "mnist1d" and arch == "prenorm":
        return mnist1d_prenorm(n, w, t)
    if model_name == "mnist1d" and arch == "dense":
        return ODENet(open=nn.Linear(data.MNIST1D_LENGTH, w),
                      steps=lambda k: blocks.Dense(w, activation="tanh"),
                      n_steps=n, t_final=t, close=nn.Linear(w, data.MNIST1D_CLASSES))
    if model_name == "mnist1d":
        return ODENet(layers=[
            nn.Unflatten(1, (1, data.MNIST1D_LENGTH)),
            nn.Conv1d(1, w, 5, padding=2),
            Segment(lambda k: blocks.Conv1d(w, activation="relu"), n, t),
            nn.Flatten(),
            nn.Linear(w * data.MNIST1D_LENGTH, data.MNIST1D_CLASSES),
        ])
    if model_name == "peaks":
        return ODENet(open=nn.Linear(2, w),
                      steps=lambda k: blocks.Dense(w, activation="tanh"),
                      n_steps=n, t_final=t,
                      close=nn.Linear(w, data.PEAKS_CLASSES))
    return ODENet(layers=[
        nn.Conv2d(1, w, 3, padding=1),
        Segment(lambda k: blocks.Conv(w, activation="relu"), n, t),
        nn.AvgPool2d(2),
        nn.Flatten(),
        nn.Linear(w * 4 * 4, 10),
    ])


#: segments of the MNIST-1D ResNet: each halves the signal's length and doubles the
#: channels of the one before
RESNET_SEGMENTS = 3


def mnist1d_resnet(n_layers: int, width: int, t_final: float) -> ODENet:
    """The convolutional ODE-ResNet of MNIST-1D: `n_layers` residual layers in three
    segments (as even as they divide: 128 -> 43, 43, 42).

    The signal as one channel -> Conv1d(1, c, 5) -> BN -> ReLU -> segment of
    u <- u + h relu(BN(conv1d_3(u))) at c channels, length 40 -> Conv1d(c, 2c, 3,
    stride 2) -> BN -> ReLU -> segment at 2c, length 20 -> the same to 4c, length 10
    -> segment -> global average pooling -> Linear(4c, 10); c = `width`, every segment
    on [0, `t_final`].  The downsampling convolutions are plain layers between the
    segments, so each segment keeps one state shape, as an ODE needs.
    """
    n = positive_int("n_layers", n_layers)
    c = positive_int("width", width)
    if n < RESNET_SEGMENTS:
        raise ValueError(f"`n_layers` must be >= {RESNET_SEGMENTS} for the resnet (one "
                         f"layer per segment at least), got {n}")
    sizes = [n // RESNET_SEGMENTS + (k < n % RESNET_SEGMENTS) for k in range(RESNET_SEGMENTS)]
    layers: list[nn.Module] = [nn.Unflatten(1, (1, data.MNIST1D_LENGTH)),
                               nn.Conv1d(1, c, 5, padding=2, bias=False),
                               nn.BatchNorm1d(c), nn.ReLU()]
    ch = c
    for k, size in enumerate(sizes):
        if k:
            layers += [nn.Conv1d(ch, 2 * ch, 3, stride=2, padding=1, bias=False),
                       nn.BatchNorm1d(2 * ch), nn.ReLU()]
            ch *= 2

        def block(i: int, ch: int = ch) -> nn.Module:
            return blocks.Conv1d(ch, activation="relu", batch_norm=True)

        layers.append(Segment(block, size, t_final))
    layers += [nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(ch, data.MNIST1D_CLASSES)]
    return ODENet(layers=layers)


def mnist1d_prenorm(n_layers: int, width: int, t_final: float) -> ODENet:
    """The dense pre-norm ODE-ResNet of MNIST-1D: Linear(40, w) -> `n_layers` layers
    u <- u + h W2 gelu(W1 LayerNorm(u)) on [0, `t_final`] (`blocks.PreNorm`, hidden
    width w) -> LayerNorm(w) -> Linear(w, 10)."""
    n = positive_int("n_layers", n_layers)
    w = positive_int("width", width)
    return ODENet(open=nn.Linear(data.MNIST1D_LENGTH, w),
                  steps=lambda k: blocks.PreNorm(w), n_steps=n, t_final=t_final,
                  close=nn.Sequential(nn.LayerNorm(w),
                                      nn.Linear(w, data.MNIST1D_CLASSES)))


# ------------------------------------------------------------------------------------------
# synthetic models: dense, conv (the scaling studies)
# ------------------------------------------------------------------------------------------
SYNTHETIC_MODELS = ("dense", "conv")


def synthetic_net(model: str, layers: int, width: int, classes: int,
                  t_final: float) -> ODENet:
    """A study network, with fresh parameters from the global torch generator.

    dense: `layers` steps u <- u + h tanh(K u + b) on [0, t_final] of `width`
    features -> Linear(width, classes).  conv: the same with 3x3 convolutions of
    `width` channels (tanh) -> global average pooling -> Linear(width, classes).
    No opening layer: the input is the ODE state (`synthetic_input_shape`).
    """
    if model not in SYNTHETIC_MODELS:
        raise ValueError(f"`model` must be one of {SYNTHETIC_MODELS}, got {model!r}")
    steps: Callable[[int], nn.Module]
    if model == "dense":
        def steps(n: int) -> nn.Module:
            return blocks.Dense(width, activation="tanh")
        close: nn.Module = nn.Linear(width, classes)
    else:
        def steps(n: int) -> nn.Module:
            return blocks.Conv(width, activation="tanh")
        close = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, classes))
    return ODENet(steps=steps, n_steps=layers, t_final=t_final, close=close)


def synthetic_input_shape(model: str, batch: int, width: int,
                          image: int) -> tuple[int, ...]:
    """Shape of one input batch of a `synthetic_net` (= the ODE state): (batch, width),
    or (batch, width, image, image) for conv."""
    return (batch, width) if model == "dense" else (batch, width, image, image)


# ------------------------------------------------------------------------------------------
# the plain-PyTorch twin
# ------------------------------------------------------------------------------------------
class _Residual(nn.Module):
    """u + dt * F(u) with the block F of one layer (forward Euler, as the ODENet's)."""

    def __init__(self, block: nn.Module, dt: float) -> None:
        super().__init__()
        self.block = block
        self.dt = dt

    def forward(self, u: Tensor) -> Tensor:
        return torch.add(u, self.block(u), alpha=self.dt)


def sequential_twin(net: ODENet) -> nn.Sequential:
    """`net` as a plain ``nn.Sequential`` of residual modules u + h F(u) that share its
    blocks and plain layers (same weights, the same step sizes as the ODENet takes);
    forward Euler segments only.  Pass ``copy.deepcopy(net)`` for a twin with weights
    of its own."""
    mods: list[nn.Module] = []
    for layer in net.layers:
        if isinstance(layer, Segment):
            if layer.scheme.name != "euler":
                raise ValueError("sequential_twin needs forward Euler segments")
            mods += [_Residual(layer.blocks[n], layer.time(n + 1) - layer.time(n))
                     for n in range(layer.n_steps)]
        else:
            mods.append(layer)
    return nn.Sequential(*mods)
