"""`solve()` reliability (issue 10): the same outcome for a non-finite state at every
level count, engine integer limits named as the field, and unusable `u0` tensors
refused before any step.

Each test here failed on the code before the fix it guards.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from mpi_util import WORKERS, describe, rank_lines, run_mpi

from layerpar.mgrit import DivergenceError, MGRITOptions, solve
from layerpar.mgrit import options as mgrit_options

INT_MAX = 2**31 - 1  # the engine's C int


def _decay(u: torch.Tensor, ts: float, te: float, level: int) -> torch.Tensor:
    return u / (1.0 + (te - ts))


def _bad_last_interval(value: float):
    """A propagator that multiplies by `value` (NaN or Inf) in the last fine interval
    only: with one level no residual is ever computed, so only the final state shows it."""
    def step(u: torch.Tensor, ts: float, te: float, level: int) -> torch.Tensor:
        out = _decay(u, ts, te, level)
        return out * value if te == 1.0 else out
    return step


# --- item 9: a non-finite final state is a DivergenceError at every level count ----------


@pytest.mark.parametrize("levels", [1, 2, 3])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_final_state_raises_at_every_level_count(value: float, levels: int) -> None:
    with pytest.raises(DivergenceError, match="non-finite"):
        solve(_bad_last_interval(value), torch.ones(3, dtype=torch.float64), 16, 1.0,
              MGRITOptions(max_levels=levels, cfactor=2))


def test_non_finite_final_state_raises_without_any_residual() -> None:
    # one iteration with `skip` measures no residual at all: the final state still counts
    with pytest.raises(DivergenceError, match="final state"):
        solve(_bad_last_interval(math.inf), torch.ones(3, dtype=torch.float64), 16, 1.0,
              MGRITOptions(max_levels=3, cfactor=2, max_iter=1))


def test_finite_one_level_solve_still_converges() -> None:
    res = solve(_decay, torch.ones(3, dtype=torch.float64), 16, 1.0, MGRITOptions(max_levels=1))
    assert res.converged and bool(torch.isfinite(res.final_state).all())


@pytest.mark.mpi
def test_non_finite_final_state_raises_on_every_rank_under_mpi() -> None:
    proc = run_mpi(WORKERS / "solve_nonfinite.py", 2, timeout=120)
    assert proc.returncode == 0, describe(proc)
    lines = rank_lines(proc.stdout)
    assert sorted(lines) == [0, 1], describe(proc)
    for rank, reports in lines.items():
        assert len(reports) == 6, (rank, reports)
        for text in reports:
            assert " DivergenceError: " in text and "non-finite" in text, (rank, text)


# --- item 10: values the engine's C ints cannot hold ----------------------------------------


# the integer fields the engine holds in a C int (max_levels has its own bound, 30)
ENGINE_INT_FIELDS = ["max_iter", "cfactor", "nrelax", "min_coarse"]


def test_engine_limits_match_a_c_int() -> None:
    assert mgrit_options.ENGINE_INT_MAX == INT_MAX
    assert mgrit_options.MAX_STEPS == INT_MAX - 1  # points 0..n_steps have int indices


def test_every_int_option_has_an_engine_overflow_test() -> None:
    ints = {f.name for f in dataclasses.fields(MGRITOptions) if f.type in ("int", "IntOrSeq")}
    assert ints - {"max_levels"} == set(ENGINE_INT_FIELDS)


@pytest.mark.parametrize("value", [INT_MAX + 1, 2**63, 2**64 + 1])
@pytest.mark.parametrize("field", ENGINE_INT_FIELDS)
def test_option_beyond_the_engine_int_names_the_field(field: str, value: int) -> None:
    with pytest.raises(ValueError, match=rf"`{field}` must be in \[\d+, 2147483647\]"):
        MGRITOptions(**{field: value})
    with pytest.raises(ValueError, match=rf"`{field}`"):
        MGRITOptions().replace(**{field: value})


@pytest.mark.parametrize("field", ["cfactor", "nrelax"])
def test_per_level_entry_beyond_the_engine_int_names_the_entry(field: str) -> None:
    with pytest.raises(ValueError, match=rf"`{field}\[1\]` must be in"):
        MGRITOptions(**{field: [2, 2**40]})


def test_largest_engine_int_reaches_the_engine() -> None:
    # the bound is the engine's: its largest value passes set_options without overflow
    res = solve(_decay, torch.ones(1, dtype=torch.float64), 8, 1.0,
                MGRITOptions(max_levels=2, max_iter=INT_MAX, min_coarse=INT_MAX,
                             cfactor=INT_MAX, nrelax=INT_MAX))
    assert res.n_levels == 1 and res.converged


@pytest.mark.parametrize("n_steps", [INT_MAX, 2**31, 2**63, 2**64 + 5])
def test_n_steps_beyond_the_engine_names_n_steps(n_steps: int) -> None:
    with pytest.raises(ValueError, match=r"`n_steps` must be <= 2147483646"):
        solve(_decay, torch.ones(1, dtype=torch.float64), n_steps, 1.0)


# --- item 12: u0 tensors MGRIT cannot work with ---------------------------------------------


@pytest.mark.parametrize("u0,exc,pattern", [
    (torch.ones(3, dtype=torch.int64), TypeError, r"`u0` must be a floating-point .*int64"),
    (torch.ones(3, dtype=torch.int32), TypeError, r"`u0` must be a floating-point .*int32"),
    (torch.ones(3, dtype=torch.bool), TypeError, r"`u0` must be a floating-point .*bool"),
    (torch.ones(3, dtype=torch.complex128), TypeError,
     r"`u0` must be a floating-point .*complex128"),
    (torch.ones(3, dtype=torch.float64, device="meta"), ValueError, r"`u0` is on the meta"),
])
@pytest.mark.parametrize("levels", [1, 3])
def test_unusable_u0_is_refused_naming_u0(u0: torch.Tensor, exc: type, pattern: str,
                                          levels: int) -> None:
    calls = [0]

    def step(u: torch.Tensor, ts: float, te: float, level: int) -> torch.Tensor:
        calls[0] += 1
        return u / (1.0 + (te - ts))

    with pytest.raises(exc, match=pattern):
        solve(step, u0, 8, 1.0, MGRITOptions(max_levels=levels))
    assert calls[0] == 0  # refused before the engine stepped anything
