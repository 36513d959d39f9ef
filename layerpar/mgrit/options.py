"""`MGRITOptions`: validated, immutable MGRIT settings (identical on every rank)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, Union

from .._checks import boolean, finite_in, integer
from ..defaults import MGRIT_NRELAX, MGRIT_TOL

IntOrSeq = Union[int, Sequence[int]]

MAX_LEVELS = 30  # the engine's LPM_MAX_LEVELS
# The engine holds counts and factors in C ints: a larger Python int would fail later as
# a bare OverflowError in the Cython call, without saying which field it was.
ENGINE_INT_MAX = 2**31 - 1
# fine points 0..n_steps are indexed by C ints, and n_steps + 1 of them must be countable
MAX_STEPS = ENGINE_INT_MAX - 1


def _int(name: str, value: Any, lo: int, hi: int = ENGINE_INT_MAX) -> int:
    """`value` as an int in [lo, hi]; the engine's C-int bound is named as such."""
    if hi != ENGINE_INT_MAX:
        return integer(name, value, lo, hi)
    return integer(name, integer(name, value, lo), lo, hi,
                   why=" (the engine holds it in a C int)")


def _levels(value: IntOrSeq) -> tuple[int, ...]:
    """A per-level setting as the tuple `MGRITOptions` normalises it to."""
    return (value,) if isinstance(value, int) else tuple(value)


def _per_level(name: str, value: Any, lo: int) -> tuple[int, ...]:
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"`{name}` must not be empty")
        if len(value) > MAX_LEVELS:
            raise ValueError(f"`{name}` has more than {MAX_LEVELS} entries")
        return tuple(_int(f"{name}[{k}]", v, lo) for k, v in enumerate(value))
    return (_int(name, value, lo),)


@dataclass(frozen=True)
class MGRITOptions:
    """Settings of one MGRIT solve, with XBraid's names and semantics (the
    reference C library the native engine matches run for run).

    max_levels: number of grid levels at most (1 = plain sequential stepping, exact).
    cfactor: coarsening factor, int or per-level sequence (the last value repeats).
    nrelax: FC sweeps before the final F-sweep, per level like cfactor (0 = F, 1 = FCF).
    tol / rtol: halt when r_k < tol, or r_k < rtol * r_first.
    max_iter: halt after this many iterations (converged or not).
    skip: iteration 0 does no fine-level work (coarse solve of the injected guess).
    min_coarse: a level is added only if it keeps at least this many intervals.
    fmg: F-cycles instead of V-cycles.
    cweight: C-relaxation weight (1 = plain C-relaxation).
    final_fc_relax: one more F- then C-sweep on the fine grid after the last iteration.
    strict: raise `ConvergenceError` when not converged (default: report it).
    """

    max_levels: int = MAX_LEVELS
    cfactor: IntOrSeq = 2
    nrelax: IntOrSeq = MGRIT_NRELAX
    tol: float = MGRIT_TOL
    rtol: float = 0.0
    max_iter: int = 100
    skip: bool = True
    min_coarse: int = 2
    fmg: bool = False
    cweight: float = 1.0
    final_fc_relax: bool = False
    strict: bool = False

    def __post_init__(self) -> None:
        s = object.__setattr__
        s(self, "max_levels", _int("max_levels", self.max_levels, 1, MAX_LEVELS))
        s(self, "cfactor", _per_level("cfactor", self.cfactor, 2))
        s(self, "nrelax", _per_level("nrelax", self.nrelax, 0))
        s(self, "tol", finite_in("tol", self.tol, 0.0, 1e300))
        s(self, "rtol", finite_in("rtol", self.rtol, 0.0, 1.0))
        s(self, "max_iter", _int("max_iter", self.max_iter, 1))
        boolean("skip", self.skip)
        s(self, "min_coarse", _int("min_coarse", self.min_coarse, 1))
        boolean("fmg", self.fmg)
        s(self, "cweight", finite_in("cweight", self.cweight, 0.0, 2.0, lo_open=True))
        boolean("final_fc_relax", self.final_fc_relax)
        boolean("strict", self.strict)

    def cfactor_at(self, level: int) -> int:
        """Coarsening factor from `level` to `level + 1`."""
        cf = _levels(self.cfactor)
        return cf[min(level, len(cf) - 1)]

    def nrelax_at(self, level: int) -> int:
        """FC sweeps on `level` before its final F-sweep."""
        nr = _levels(self.nrelax)
        return nr[min(level, len(nr) - 1)]

    def replace(self, **changes: Any) -> MGRITOptions:
        """A copy with some fields changed (validated again)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        unknown = set(changes) - set(values)
        if unknown:
            raise TypeError(f"unknown MGRITOptions field(s): {sorted(unknown)}")
        values.update(changes)
        return MGRITOptions(**values)

    def key(self) -> dict[str, Any]:
        """Field name -> value; equal on two ranks iff their options are equal (the
        cross-rank check names the fields that differ)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `Core.set_options`."""
        return dict(
            max_levels=self.max_levels, cfactor=list(_levels(self.cfactor)),
            nrelax=list(_levels(self.nrelax)), min_coarse=self.min_coarse,
            tol=self.tol, rtol=self.rtol, max_iter=self.max_iter, skip=self.skip,
            fmg=self.fmg, cweight=self.cweight, final_fc_relax=self.final_fc_relax,
        )
