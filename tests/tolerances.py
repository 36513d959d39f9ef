"""The test suite's tolerances, per dtype, in one place.

Every comparison of floating-point results in the tests uses one of these, named for
what is compared; `conftest.py` hands the table to tests as the `tol` fixture, and the
worker scripts that run under mpiexec (they do not see conftest) import this module.

All are relative errors ``||got - want|| / ||want||`` unless a test says otherwise.

ops       a few operations regrouped (one step, one optimizer update)
step      a short chain of steps, or parameters interpolated in another order
exact     what is equal in exact arithmetic, by another algorithm: a vectorised kernel
          against the loop it replaces; two-level MGRIT after N/cf iterations
roundoff  the same computation in another order: other rank counts, batched against
          per-step cycles, the native engine against XBraid, norm reductions
converged a solve converged to `SOLVER_TOL` against the serial oracle: the residual
          tolerance, amplified by conditioning over some hundred steps, stays far below

Float32 has ~7 digits: its tolerances are set by its epsilon (1.2e-7) times the
length of the chains compared, not by the algorithm.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["F32", "F64", "SOLVER_TOL", "TOL", "Tolerances"]


@dataclass(frozen=True)
class Tolerances:
    """The tolerances of one dtype (see the module docstring)."""

    ops: float
    step: float
    exact: float
    roundoff: float
    converged: float


#: the absolute residual tolerance (`MGRITOptions.tol`) of solves the tests converge
SOLVER_TOL = 1e-13

F64 = Tolerances(ops=1e-15, step=1e-14, exact=1e-13, roundoff=1e-12, converged=1e-10)
F32 = Tolerances(ops=1e-6, step=1e-6, exact=1e-5, roundoff=1e-5, converged=1e-5)

TOL: dict[torch.dtype, Tolerances] = {torch.float64: F64, torch.float32: F32}
