"""The torch side of MGRIT: options, grid and partition, transport, `solve()`."""
from .errors import (
    ConvergenceError,
    DivergenceError,
    EngineError,
    MGRITError,
    RankLostError,
    RankMismatchError,
    RemoteError,
)
from .grid import Partition, block_bounds, build_levels, grid_time, reversed_bounds
from .options import MGRITOptions
from .result import MGRITResult
from .solve import solve

__all__ = [
    "ConvergenceError", "DivergenceError", "EngineError", "MGRITError", "MGRITOptions",
    "MGRITResult", "Partition", "RankLostError", "RankMismatchError", "RemoteError", "block_bounds",
    "build_levels", "grid_time", "reversed_bounds", "solve",
]
