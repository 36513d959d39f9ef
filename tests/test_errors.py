"""Bad input to `MGRITOptions` and `solve()`: clear errors, never a hang.

In process (one rank): every option field, every `solve()` argument, callbacks that
return the wrong thing, NaN, exceptions from callbacks, `strict`.
Under MPI (2 and 4 ranks, one job each running every case of
workers/solve_errors.py under a timeout): the error is checked on every rank.
"""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch
from mpi_util import WORKERS, describe, rank_lines, run_mpi
from problems import Dahlquist

from layerpar.mgrit import (
    ConvergenceError,
    DivergenceError,
    MGRITOptions,
    RankMismatchError,
    RemoteError,
    solve,
)

DAHL = Dahlquist("backward")

# --- options: every field, with the option named in backticks --------------------------------

BAD_OPTIONS = [
    ("max_levels", 0, ValueError), ("max_levels", 31, ValueError),
    ("max_levels", 2.0, TypeError), ("max_levels", True, TypeError),
    ("cfactor", 1, ValueError), ("cfactor", [2, 1], ValueError), ("cfactor", [], ValueError),
    ("cfactor", "2", TypeError), ("cfactor", [2, 2.5], TypeError),
    ("cfactor", [2] * 31, ValueError),
    ("nrelax", -1, ValueError), ("nrelax", [1, -2], ValueError), ("nrelax", 1.0, TypeError),
    ("tol", -1e-9, ValueError), ("tol", math.nan, ValueError), ("tol", math.inf, ValueError),
    ("tol", "1e-9", TypeError), ("tol", None, TypeError),
    ("rtol", -0.1, ValueError), ("rtol", 1.5, ValueError), ("rtol", math.nan, ValueError),
    ("rtol", False, TypeError),
    ("max_iter", 0, ValueError), ("max_iter", 10.0, TypeError),
    # beyond the engine's C int: named, not a bare OverflowError later (issue 10)
    ("max_iter", 2**31, ValueError), ("cfactor", 2**31, ValueError),
    ("cfactor", [2, 2**63], ValueError), ("nrelax", 2**31, ValueError),
    ("min_coarse", 2**31, ValueError),
    ("skip", 1, TypeError), ("skip", "yes", TypeError),
    ("min_coarse", 0, ValueError), ("min_coarse", None, TypeError),
    ("fmg", 0, TypeError), ("fmg", None, TypeError),
    ("cweight", 0.0, ValueError), ("cweight", 2.5, ValueError), ("cweight", -1.0, ValueError),
    ("cweight", math.nan, ValueError), ("cweight", "1", TypeError),
    ("final_fc_relax", 1, TypeError), ("final_fc_relax", None, TypeError),
    ("strict", "no", TypeError), ("strict", 0, TypeError),
]


@pytest.mark.parametrize("field,value,exc", BAD_OPTIONS,
                         ids=[f"{f}={v!r}" for f, v, _ in BAD_OPTIONS])
def test_invalid_option_names_the_option(field: str, value: object, exc: type) -> None:
    with pytest.raises(exc, match=rf"`{field}(\[\d+\])?`"):
        MGRITOptions(**{field: value})
    with pytest.raises(exc, match=rf"`{field}(\[\d+\])?`"):
        MGRITOptions().replace(**{field: value})


def test_every_option_field_has_bad_values_tested() -> None:
    names = {f.name for f in dataclasses.fields(MGRITOptions)}
    assert names == {f for f, _, _ in BAD_OPTIONS}


def test_every_engine_int_option_has_an_overflow_value_tested() -> None:
    # the engine holds these in C ints: a value >= 2**31 must be tested for each
    # (max_levels has its own, smaller bound)
    ints = {f.name for f in dataclasses.fields(MGRITOptions)
            if f.type in ("int", "IntOrSeq") and f.name != "max_levels"}
    big = {f for f, v, _ in BAD_OPTIONS
           if any(isinstance(x, int) and x >= 2**31 for x in (v if isinstance(v, list) else [v]))}
    assert ints and ints <= big, ints - big


def test_unknown_option_in_replace() -> None:
    with pytest.raises(TypeError, match="nrelaxx"):
        MGRITOptions().replace(nrelaxx=1)
    with pytest.raises(TypeError):
        MGRITOptions(nrelaxx=1)  # type: ignore[call-arg]


def test_options_are_immutable_and_normalised() -> None:
    o = MGRITOptions(cfactor=[4, 2], nrelax=2)
    assert o.cfactor == (4, 2) and o.nrelax == (2,)
    assert o.cfactor_at(0) == 4 and o.cfactor_at(5) == 2 and o.nrelax_at(3) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.tol = 1.0  # type: ignore[misc]


# --- solve() arguments ------------------------------------------------------------------------

U0 = torch.ones(1, dtype=torch.float64)


def _solve(**kw):
    args = dict(step=DAHL.step, u0=U0, n_steps=8, t_final=1.0, options=MGRITOptions())
    args.update(kw)
    return solve(**args)


@pytest.mark.parametrize("kw,exc,name", [
    (dict(n_steps=0), ValueError, "n_steps"),
    (dict(n_steps=-3), ValueError, "n_steps"),
    (dict(n_steps=8.0), TypeError, "n_steps"),
    (dict(n_steps=True), TypeError, "n_steps"),
    (dict(t_final=0.0), ValueError, "t_final"),
    (dict(t_final=math.inf), ValueError, "t_final"),
    (dict(t_final="1"), TypeError, "t_final"),
    (dict(t_start=2.0), ValueError, "t_final"),
    (dict(t_start=math.nan), ValueError, "t_start"),
    (dict(u0=[1.0]), TypeError, "u0"),
    (dict(step="step"), TypeError, "step"),
    (dict(step_batch=3), TypeError, "step_batch"),
    (dict(init=3), TypeError, "init"),
    (dict(options=dict(max_levels=2)), TypeError, "options"),
])
def test_invalid_solve_argument(kw: dict, exc: type, name: str) -> None:
    with pytest.raises(exc, match=f"`{name}`"):
        _solve(**kw)


@pytest.mark.parametrize("levels", [1, 3])
@pytest.mark.parametrize("bad,exc,pattern", [
    (lambda u: torch.cat([u, u]), ValueError, r"`step` returned a state of shape \(2,\)"),
    (lambda u: u.float(), ValueError, r"`step` returned .*float32"),
    (lambda u: u.tolist(), TypeError, r"`step` must return a torch.Tensor, got list"),
    (lambda u: None, TypeError, r"`step`"),
])
def test_step_returning_the_wrong_thing(levels: int, bad, exc: type, pattern: str) -> None:
    with pytest.raises(exc, match=pattern):
        _solve(step=lambda u, ts, te, lvl: bad(u), options=MGRITOptions(max_levels=levels))


def test_init_and_step_batch_returning_the_wrong_thing() -> None:
    with pytest.raises(ValueError, match=r"`init` returned a state of shape \(3,\)"):
        _solve(init=lambda t: torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"`step_batch` returned 1 states for \d+ inputs"):
        _solve(n_steps=16, step_batch=lambda us, ts, te, lvl: [us[0]])
    with pytest.raises(ValueError, match=r"`step_batch` returned a state of shape"):
        _solve(n_steps=16, step_batch=lambda us, ts, te, lvl: [u.reshape(1, 1) for u in us])


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_non_finite_values_raise_divergence_error(value: float) -> None:
    calls = [0]

    def step(u, ts, te, lvl):
        calls[0] += 1
        out = DAHL.step(u, ts, te, lvl)
        return out * value if calls[0] > 100 else out  # after r_1 (80 calls), before r_2

    with pytest.raises(DivergenceError, match=r"non-finite.*history \[[0-9.e-]+, "):
        _solve(step=step, n_steps=32, options=MGRITOptions(max_levels=3, tol=1e-15))


class _MyError(Exception):
    pass


@pytest.mark.parametrize("levels", [1, 2, 4])
def test_exception_in_step_propagates_unchanged(levels: int) -> None:
    err = _MyError("boom")

    def step(u, ts, te, lvl):
        if te > 0.5:
            raise err
        return DAHL.step(u, ts, te, lvl)

    with pytest.raises(_MyError) as info:
        _solve(step=step, options=MGRITOptions(max_levels=levels))
    assert info.value is err


def test_exception_in_init_and_step_batch_propagate() -> None:
    with pytest.raises(KeyError, match="no guess"):
        _solve(init=lambda t: {}["no guess"])

    def batch(us, ts, te, lvl):
        raise OSError("batch failed")

    with pytest.raises(OSError, match="batch failed"):
        _solve(n_steps=16, step_batch=batch)


def test_strict_raises_convergence_error() -> None:
    opts = MGRITOptions(max_levels=3, tol=1e-15, max_iter=2)
    assert not _solve(n_steps=32, options=opts).converged
    with pytest.raises(ConvergenceError, match="not converged after 2 iterations"):
        _solve(n_steps=32, options=opts.replace(strict=True))
    assert _solve(n_steps=32, options=opts.replace(max_iter=50, tol=1e-12,
                                                   strict=True)).converged


def test_solve_after_a_failure_works() -> None:
    with pytest.raises(ValueError):
        _solve(step=lambda u, ts, te, lvl: torch.cat([u, u]))
    assert _solve(options=MGRITOptions(tol=1e-12)).converged


# --- the same on every rank, under MPI -----------------------------------------------------


def _expect(case: str, rank: int, size: int) -> tuple[set[str], str]:
    """(exception types allowed on `rank`, text its message must contain) for `case`."""
    last = size - 1
    step_shape = "`step` returned a state of shape (2,)"
    step_dtype = "`step` returned a state of shape (1,), torch.float32"
    mismatch = ({"RankMismatchError"}, "differ between ranks")
    table = {
        "invalid_option": ({"ValueError"}, "`cfactor` must be >= 2"),
        "n_steps_zero": ({"ValueError"}, "`n_steps` must be >= 1"),
        "fewer_steps_than_ranks": ({"ValueError"},
                                   f"`n_steps` ({size - 1}) must be >= the number of ranks"),
        "bad_t_final_on_one_rank": (({"ValueError"}, "`t_final` (-1.0) must be > `t_start`")
                                    if rank == 1 else
                                    ({"RemoteError"}, "rank 1 failed: ValueError: `t_final`")),
        "wrong_shape": ({"ValueError", "RemoteError"}, step_shape),
        "wrong_dtype": ({"ValueError", "RemoteError"}, step_dtype),
        "wrong_shape_late": (({"ValueError"}, "`step` returned a state of shape (1, 1)")
                             if rank == last else
                             ({"RemoteError"}, f"rank {last} failed: ValueError: `step`")),
        "nan_mid_solve": ({"DivergenceError"}, "residual became nan in iteration 3"),
        "step_raises_on_one_rank": (({"RuntimeError"}, "injected failure on rank 1")
                                    if rank == 1 else
                                    ({"RemoteError"}, "rank 1 failed: RuntimeError: injected")),
        "init_raises_on_rank0": (({"KeyError"}, "no initial guess on rank 0") if rank == 0
                                 else ({"RemoteError"}, "rank 0 failed: KeyError")),
        "options_differ": mismatch,
        "u0_shape_differs": mismatch,
        "u0_dtype_differs": mismatch,
        "recovers": ({"OK"}, "iterations="),
    }
    return table[case]


MPI_CASES = ["invalid_option", "n_steps_zero", "fewer_steps_than_ranks",
             "bad_t_final_on_one_rank", "wrong_shape", "wrong_dtype", "wrong_shape_late",
             "nan_mid_solve", "step_raises_on_one_rank", "init_raises_on_rank0",
             "options_differ", "u0_shape_differs", "u0_dtype_differs", "recovers"]
REPORT = re.compile(r"(\w+) (OK|\w+)(?::| |$)(.*)")


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 4])
def test_bad_input_under_mpi_on_every_rank(nprocs: int) -> None:
    proc = run_mpi(WORKERS / "solve_errors.py", nprocs, *MPI_CASES, timeout=150)
    assert proc.returncode == 0, describe(proc)
    lines = rank_lines(proc.stdout)
    assert sorted(lines) == list(range(nprocs)), describe(proc)
    for rank in range(nprocs):
        reports = {}
        for text in lines[rank]:
            m = REPORT.match(text)
            assert m, (rank, text)
            reports[m.group(1)] = (m.group(2), text)
        assert list(reports) == MPI_CASES, (rank, describe(proc))
        for case in MPI_CASES:
            kind, text = reports[case]
            allowed, needle = _expect(case, rank, nprocs)
            assert kind in allowed and needle in text, (case, rank, text)
    # the wrong step is reported as such by at least one rank (the others learn of it)
    for case in ("wrong_shape", "wrong_dtype"):
        kinds = {REPORT.match(t).group(2) for r in lines for t in lines[r]  # type: ignore
                 if t.startswith(case + " ")}
        assert "ValueError" in kinds, case


def test_error_classes() -> None:
    assert issubclass(RankMismatchError, ValueError)
    assert issubclass(DivergenceError, ArithmeticError)
    e = RemoteError(3, "ValueError: x")
    assert e.rank == 3 and str(e) == "rank 3 failed: ValueError: x"
