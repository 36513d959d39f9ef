"""Defaults that several parts share, written once.

The accuracy bound: how far an inexact (MGRIT) parameter gradient may be from the
exact one before adaptive accuracy and ``options="auto"`` (`AccuracyPolicy`), the
``--adaptive`` / ``--auto`` flags and the accuracy study call it too inexact.

The MGRIT settings training starts from (`TRAINING`): inexact solves, as in the
layer-parallel training literature (1-2 forward and 1 backward iterations).  `train()`,
``layerpar train``, the benchmarks and the scaling studies read them; `MGRIT_NRELAX`
and `MGRIT_TOL` are `MGRITOptions`' own defaults, and `DEFAULT_TIMEOUT` the transports'.
Per-problem settings (epochs, batch size, learning rate) live in
`layerpar.apps.recipes.RECIPES`.

This module imports nothing at load time, so front doors may read it before torch
(``layerpar --help`` shows these values without importing torch).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .mgrit.options import MGRITOptions

__all__ = ["DEFAULT_TIMEOUT", "MAX_REL_ERROR", "MGRIT_NRELAX", "MGRIT_TOL", "MIN_COSINE",
           "TRAINING", "TrainingDefaults"]

#: smallest acceptable cosine between the inexact and the exact parameter gradient
MIN_COSINE = 0.99
#: largest acceptable relative error of the inexact parameter gradient
MAX_REL_ERROR = 0.05

#: `MGRITOptions.nrelax`: FC sweeps before the final F-sweep (1: FCF relaxation)
MGRIT_NRELAX = 1
#: `MGRITOptions.tol`: absolute residual tolerance of a solve
MGRIT_TOL = 1e-9
#: seconds any one wait for another rank may take (`LayerParallel`, `solve`)
DEFAULT_TIMEOUT = 600.0


@dataclass(frozen=True)
class TrainingDefaults:
    """MGRIT levels, coarsening factor and forward/adjoint iterations of training."""

    levels: int = 3
    cfactor: int = 4
    fwd_iters: int = 2
    bwd_iters: int = 1

    def fwd_options(self, **changes: Any) -> MGRITOptions:
        """The forward solve's options (`changes` override any field)."""
        from .mgrit.options import MGRITOptions

        return MGRITOptions(**{"max_levels": self.levels, "cfactor": self.cfactor,
                               "max_iter": self.fwd_iters, **changes})

    def bwd_options(self, **changes: Any) -> MGRITOptions:
        """The adjoint solve's options (`changes` override any field)."""
        from .mgrit.options import MGRITOptions

        return MGRITOptions(**{"max_levels": self.levels, "cfactor": self.cfactor,
                               "max_iter": self.bwd_iters, **changes})


TRAINING = TrainingDefaults()
