"""layerpar: layer-parallel training of deep residual networks with MGRIT.

The library: `layerpar.mgrit` (MGRIT options, `solve`, transports), `layerpar.ode` (the
serial `ODENet` oracle, blocks, refinement), `layerpar.parallel` (`LayerParallel`;
`Auto`, the policy above it; `ProcessGrid`) and `layerpar._native` (the C engine).  The
applications built on it, everything a user runs (the ``layerpar`` command, training,
the benchmarks of ``python -m layerpar.bench``, the studies, the job launcher), live in
`layerpar.apps`; the library never imports them.

The public names are imported lazily, so ``import layerpar.ode`` (the serial
oracle) never loads the native engine or MPI.
"""
from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Auto", "ConvergenceError", "DivergenceError", "EngineError", "LayerParallel",
           "MGRITError", "MGRITOptions", "MGRITResult", "ODENet", "ProcessGrid", "RankLostError",
           "RankMismatchError", "RemoteError", "choose_method", "mgrit", "ode", "parallel",
           "solve"]
__version__ = "0.1.0"

_WHERE = {
    "Auto": "layerpar.parallel",
    "LayerParallel": "layerpar.parallel",
    "ProcessGrid": "layerpar.parallel",
    "choose_method": "layerpar.parallel",
    "MGRITOptions": "layerpar.mgrit.options",
    "MGRITResult": "layerpar.mgrit.result",
    "solve": "layerpar.mgrit.solve",
    "ODENet": "layerpar.ode.net",
    # the errors a failure on any rank raises (on every rank), to catch by name
    **{name: "layerpar.mgrit.errors" for name in (
        "ConvergenceError", "DivergenceError", "EngineError", "MGRITError", "RankLostError",
        "RankMismatchError", "RemoteError")},
    # the subpackages, so that ``import layerpar`` then ``layerpar.parallel.X`` works
    "mgrit": "layerpar.mgrit",
    "ode": "layerpar.ode",
    "parallel": "layerpar.parallel",
}
_MODULES = ("mgrit", "ode", "parallel")


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        mod = importlib.import_module(_WHERE[name])
        value = mod if name in _MODULES else getattr(mod, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'layerpar' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
