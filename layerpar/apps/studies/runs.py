"""What one study run is: its settings, and the network and data they build.

A run is a dict of the settings in `DEFAULTS` (`config` completes and checks one).
`build_study_net` builds its network (a `layerpar.apps.nets.synthetic_net`, seeded by the
run), `make_batches` its data, `input_shape` the shape of one batch; `app_flags`
says which batched steps a layer-parallel run's engine apps offer (the performance
model replays them, the worker records them).

The runner (which plans runs), the worker and the serial baseline (which measure
them) and the performance model (which predicts them) all import this module; it
imports none of them.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ...defaults import TRAINING
from ...ode.net import ODENet
from ..nets import SYNTHETIC_MODELS, synthetic_input_shape, synthetic_net

__all__ = ["DEFAULTS", "SYNTHETIC_MODELS", "app_flags", "build_study_net", "config",
           "input_shape", "layer_parallel_flags", "make_batches"]

DEFAULTS: dict[str, Any] = {
    "model": "dense",   # "dense": Dense(width, tanh) steps; "conv": Conv(width) on images
    "layers": 1024,     # residual steps (the ODE segment's N)
    "width": 32,        # features (dense) or channels (conv)
    "batch": 64,
    "image": 8,         # conv: image side
    "classes": 10,
    "t_final": 1.0,
    "levels": TRAINING.levels,  # MGRIT max_levels (forward and adjoint)
    "cfactor": TRAINING.cfactor,
    "nrelax": 1,        # FCF relaxation
    "fwd_iters": TRAINING.fwd_iters,  # MGRIT iterations per forward solve
    "bwd_iters": TRAINING.bwd_iters,  # ... per adjoint solve
    "threads": 1,       # torch intra-op threads per rank
    "steps": 4,         # timed SGD batches
    "warmup": 1,        # untimed SGD batches before them
    "lr": 0.05,
    "seed": 0,
    "diag_iters": 6,    # iterations of the diagnostic solve (0: none)
}


def config(run: dict[str, Any], strict: bool = True) -> dict[str, Any]:
    """`run` completed with `DEFAULTS`; unknown keys are an error when `strict`, else
    dropped (a CSV row carries many more columns than settings)."""
    if not strict:
        run = {k: v for k, v in run.items() if k in DEFAULTS}
    unknown = set(run) - set(DEFAULTS) - {"ranks", "scaling", "out"}
    if unknown:
        raise ValueError(f"unknown study setting(s) {sorted(unknown)}; valid: "
                         f"{sorted(DEFAULTS)}")
    cfg = {**DEFAULTS, **run}
    if cfg["model"] not in SYNTHETIC_MODELS:
        raise ValueError(f"`model` must be one of {SYNTHETIC_MODELS}, got {cfg['model']!r}")
    return cfg


def build_study_net(cfg: dict[str, Any]) -> ODENet:
    """The run's network, with parameters drawn from ``torch.manual_seed(cfg["seed"])``
    (identical on every rank, in the serial baseline and in the cost measurements)."""
    cfg = config(cfg, strict=False)
    torch.manual_seed(int(cfg["seed"]))
    return synthetic_net(cfg["model"], int(cfg["layers"]), int(cfg["width"]),
                         int(cfg["classes"]), float(cfg["t_final"]))


def input_shape(cfg: dict[str, Any]) -> tuple[int, ...]:
    """Shape of one input batch (= the ODE state)."""
    cfg = config(cfg, strict=False)
    return synthetic_input_shape(cfg["model"], int(cfg["batch"]), int(cfg["width"]),
                                 int(cfg["image"]))


def make_batches(cfg: dict[str, Any], count: int) -> list[tuple[Tensor, Tensor]]:
    """`count` (input, label) batches from a fixed generator: Gaussian inputs labelled
    by a fixed random linear teacher (learnable, so the loss moves)."""
    cfg = config(cfg, strict=False)
    g = torch.Generator().manual_seed((int(cfg["seed"]) + 1) % 2**64)  # seed <= 2**64 - 1
    shape = input_shape(cfg)
    feats = math.prod(shape[1:])
    teacher = torch.randn(feats, int(cfg["classes"]), generator=g)
    out = []
    for _ in range(count):
        x = torch.randn(shape, generator=g)
        out.append((x, (x.reshape(shape[0], -1) @ teacher).argmax(1)))
    return out


def app_flags(app: Any) -> tuple[bool, bool]:
    """(batched, seq) for an engine app, as the engine decides: whether it has a
    ``step_batch`` / ``step_seq`` that is not None."""
    return (getattr(app, "step_batch", None) is not None,
            getattr(app, "step_seq", None) is not None)


def layer_parallel_flags(lp: Any) -> dict[str, bool]:
    """Whether the forward / adjoint apps of the `LayerParallel` `lp` give the engine a
    batched step (``step_batch``) and a sequential-stretch step (``step_seq``): the
    CSV columns fwd_batched, bwd_batched, fwd_seq, bwd_seq."""
    out = {"fwd_batched": False, "bwd_batched": False, "fwd_seq": False, "bwd_seq": False}
    for runner in getattr(lp, "_runners", {}).values():
        for side, app in (("fwd", getattr(runner, "fapp", None)),
                          ("bwd", getattr(runner, "bapp", None))):
            batched, seq = app_flags(app)
            out[f"{side}_batched"] |= batched
            out[f"{side}_seq"] |= seq
    return out
