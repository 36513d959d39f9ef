"""Scaling studies: the performance model's work counts against the engine's, its
predictions' invariants, and a short study end to end (CSV, resume, plots).

The step counts the model replays must equal the engine's ``step_counts`` /
``batch_counts`` exactly, per rank and level, at 1, 2 and 3 ranks, for the forward
partition (`block_bounds`) and the adjoint one (`reversed_bounds`): this pins the
model to the engine.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from mpi_util import describe, rank_lines, run_mpi

from layerpar.apps.studies import cli, runner
from layerpar.apps.studies import perfmodel as pm
from layerpar.mgrit import MGRITOptions, block_bounds, reversed_bounds, solve

# (n_steps, max_levels, cfactor, nrelax, iterations, skip, fmg, final_fc_relax)
CASES = [
    (64, 3, 4, 1, 2, True, False, True),     # the training default
    (64, 3, 4, 1, 1, True, False, True),     # one adjoint iteration
    (50, 3, 3, 0, 3, True, False, False),    # F-relaxation, ragged blocks
    (37, 4, 2, 1, 2, False, False, True),    # no skip, 4 levels
    (64, 2, 8, 2, 2, True, False, True),     # two levels, large cfactor, FCFCF
    (48, 3, 2, 1, 2, True, True, True),      # F-cycles
    (13, 1, 2, 1, 1, True, False, True),     # sequential (one level)
    (30, 3, 4, 1, 3, False, True, False),
]


def _options(case: tuple) -> MGRITOptions:
    n, lv, cf, nr, it, skip, fmg, ffc = case
    return MGRITOptions(max_levels=lv, cfactor=cf, nrelax=nr, max_iter=it, skip=skip,
                        fmg=fmg, final_fc_relax=ffc, tol=0.0)


def _step(u: torch.Tensor, ts: float, te: float, level: int) -> torch.Tensor:
    return u * (1.0 - 0.5 * (te - ts))


def _step_batch(us: list, ts: list, te: list, level: int) -> list:
    return [_step(u, a, b, level) for u, a, b in zip(us, ts, te)]


def _solve_flags(step_batch: object) -> tuple[bool, bool]:
    """(batched, seq) of the app `solve()` hands the engine (peeks at its private app
    class: the engine decides by the app's attributes, so must the model)."""
    from layerpar.mgrit.solve import _SolveApp

    return pm.app_flags(_SolveApp(_step, step_batch, torch.ones(3), None))


@pytest.mark.parametrize("batched", [False, True])
def test_counts_match_solve_on_one_rank(batched: bool) -> None:
    sb = _step_batch if batched else None
    flags = _solve_flags(sb)
    assert flags[0] == batched
    for case in CASES:
        o = _options(case)
        r = solve(_step, torch.ones(3), case[0], 1.0, o, step_batch=sb)
        steps, calls = pm.count_steps(case[0], 1, o, iterations=r.iterations,
                                      batched=flags[0], seq=flags[1])
        assert steps == [r.step_counts], case
        assert calls == [r.batch_counts], case


COUNT_WORKER = '''
import json, sys
import torch
from mpi4py import MPI
from layerpar._native._core import Core
from layerpar.mgrit import MGRITOptions, block_bounds, reversed_bounds, solve
from layerpar.mgrit.solve import _SolveApp
from layerpar.mgrit.solve import vec_norm_sq, vec_sum
from layerpar.mgrit.transport import MPITransport
from layerpar.apps.studies.perfmodel import app_flags

CASES = json.loads(sys.argv[1])


def step(u, ts, te, level):
    return u * (1.0 - 0.5 * (te - ts))


def step_batch(us, ts, te, level):
    return [step(u, a, b, level) for u, a, b in zip(us, ts, te)]


class App:
    """An engine app with or without step_batch / step_seq."""

    sum = staticmethod(vec_sum)
    norm_sq = staticmethod(vec_norm_sq)

    def __init__(self, batched, seq):
        if not batched:
            self.step_batch = None
        if not seq:
            self.step_seq = None

    def step(self, u, f, ts, te, a, b, level, final):
        out = step(u, ts, te, level)
        return out if f is None else out + f

    def step_batch(self, us, fs, ts, te, a, b, level, final):
        return [self.step(u, None if fs is None else fs[k], ts[k], te[k], 0, 0, level, final)
                for k, u in enumerate(us)]

    def step_seq(self, u, fs, ts, te, a, b, level, final):
        outs = []
        for k in range(len(ts)):
            u = self.step(u, None if fs is None else fs[k], ts[k], te[k], 0, 0, level, final)
            outs.append(u)
        return outs

    def init(self, t, i):
        return torch.ones(3) if i == 0 else torch.zeros(3)


def options(c):
    n, lv, cf, nr, it, skip, fmg, ffc = c
    return MGRITOptions(max_levels=lv, cfactor=cf, nrelax=nr, max_iter=it, skip=skip,
                        fmg=fmg, final_fc_relax=ffc, tol=0.0)


world = MPI.COMM_WORLD
pair = world.Split(0 if world.rank < 2 else MPI.UNDEFINED, world.rank)
out = []
for comm in (world, pair):
    if comm == MPI.COMM_NULL:
        continue
    size = comm.Get_size()
    for k, c in enumerate(CASES):
        o = options(c)
        for sb in (None, step_batch):  # solve() on the forward partition
            r = solve(step, torch.ones(3), c[0], 1.0, o, comm=comm, step_batch=sb)
            flags = app_flags(_SolveApp(step, sb, torch.ones(3), None))
            out.append(["block", size, k, *flags, r.iterations, r.step_counts,
                        r.batch_counts])
        for kind in ("block", "reversed"):  # the engine directly, every app kind
            bounds = block_bounds(c[0], size)
            if kind == "reversed":
                bounds = reversed_bounds(bounds)
            for batched in (False, True):
                for seq in (False, True):
                    tr = MPITransport(comm)
                    core = Core(c[0], 0.0, 1.0, tr.rank, size, bounds, App(batched, seq), tr)
                    core.set_options(**o.engine_kwargs())
                    tr.set_template(torch.ones(3))
                    core.drive()
                    out.append([kind, size, k, batched, seq, core.iterations,
                                core.step_counts(), core.batch_counts()])
                    tr.close()
sys.stdout.write(f"RANK {world.rank} {json.dumps(out)}\\n")
'''


@pytest.mark.mpi
def test_counts_match_engine_on_two_and_three_ranks(tmp_path: Path) -> None:
    script = tmp_path / "counts.py"
    script.write_text(COUNT_WORKER)
    proc = run_mpi(script, 3, json.dumps(CASES), timeout=180)
    assert proc.returncode == 0, describe(proc)
    reports = rank_lines(proc.stdout)
    assert sorted(reports) == [0, 1, 2], describe(proc)
    checked = 0
    for rank, lines in reports.items():  # world ranks 0, 1 are ranks 0, 1 of the pair
        for kind, size, k, batched, seq, iters, steps, calls in json.loads(lines[-1]):
            case = CASES[k]
            bounds = block_bounds(case[0], size)
            if kind == "reversed":
                bounds = reversed_bounds(bounds)
            want_s, want_c = pm.count_steps(case[0], size, _options(case), iterations=iters,
                                            bounds=bounds, batched=batched, seq=seq)
            assert want_s[rank] == steps, (kind, size, rank, case, batched, seq)
            assert want_c[rank] == calls, (kind, size, rank, case, batched, seq)
            checked += 1
    assert checked == len(CASES) * (2 + 8) * (3 + 2)


def test_model_invariants() -> None:
    # sequential stepping (one level) is a chain over the ranks: no speedup, any P
    unit = pm.Costs(fwd=0.0, fwd_rec=1.0, vjp=0.0, vjp_full=1.0)
    for p in (1, 2, 4, 64):
        pr = pm.predict(p, 64, unit, levels=1)
        assert pr.forward_seconds == pytest.approx(64.0)
        assert pr.seconds_per_batch == pytest.approx(128.0)
    # MGRIT: the final fine sweep is split over the ranks, the coarse solve is not
    c = pm.Costs(fwd=1e-5, fwd_rec=2e-5, vjp=2e-5, vjp_full=3e-5, vsum=1e-6,
                 alpha=2e-6, beta=5e9, state_bytes=8192, call_overhead=1e-5)
    t = [pm.predict(p, 1024, c, levels=3, cfactor=4).seconds_per_batch for p in (1, 4, 16)]
    assert t[0] > t[1] > t[2] > 0
    big = pm.predict(4096, 16384, c, levels=6, cfactor=4)
    assert math.isfinite(big.seconds_per_batch) and big.fwd_levels == 6
    assert pm.pipeline_seconds(10.0, 4, 8) == pytest.approx(10.0 / 4 * (1 + 3 / 8))
    with pytest.raises(ValueError, match="ranks"):
        pm.predict(8, 4, c)


def _is_png(path: Path) -> bool:
    import matplotlib.image as mpimg

    with path.open("rb") as fh:
        if fh.read(8) != b"\x89PNG\r\n\x1a\n":
            return False
    img = mpimg.imread(str(path))
    return img.ndim == 3 and img.shape[0] > 50 and img.shape[1] > 50


@pytest.mark.mpi
def test_short_study_end_to_end(tmp_path: Path) -> None:
    from mpi_util import mpi_available

    if not mpi_available():
        pytest.skip("no MPI (mpi4py and mpiexec) available")
    out = tmp_path / "study"
    argv = ["--quick", "--ranks", "1,2", "--layers", "64", "--width", "8", "--batch", "16",
            "--steps", "2", "--serial-threads", "1", "--out", str(out), "--no-progress"]
    args = cli.build_parser().parse_args(argv)
    assert cli.run(args) == 0
    csv_path = out / "results.csv"
    rows = runner.read_rows(csv_path)
    assert len(rows) == 2
    assert set(runner.REQUIRED_COLUMNS) <= set(rows[0])
    assert sorted(int(r["ranks"]) for r in rows) == [1, 2]
    for r in rows:
        v = {k: float(r[k]) for k in ("seconds_per_batch", "forward_seconds",
                                      "backward_seconds", "comm_idle_seconds",
                                      "serial_seconds_per_batch", "speedup", "efficiency",
                                      "loss", "serial_loss", "loss_rel_diff",
                                      "predicted_seconds_per_batch")}
        assert v["seconds_per_batch"] > 0 and v["forward_seconds"] > 0
        assert v["backward_seconds"] > 0 and v["comm_idle_seconds"] >= 0
        assert v["serial_seconds_per_batch"] > 0 and v["predicted_seconds_per_batch"] > 0
        assert v["speedup"] == pytest.approx(
            v["serial_seconds_per_batch"] / v["seconds_per_batch"], rel=1e-4)
        assert v["efficiency"] == pytest.approx(
            v["speedup"] / (int(r["ranks"]) * int(r["threads"])), rel=1e-4)
        assert math.isfinite(v["loss_rel_diff"]) and v["loss_rel_diff"] >= 0
        assert v["loss_rel_diff"] == pytest.approx(
            abs(v["loss"] - v["serial_loss"]) / abs(v["serial_loss"]), abs=1e-5)
        assert int(r["serial_threads"]) == 1
        assert int(r["fwd_iterations"]) == 2 and int(r["bwd_iterations"]) == 1
        assert r["model_role"] in ("fit", "validate")
        assert len(r["fwd_residual_history"].split(";")) >= 2
    for name in ("speedup", "breakdown", "residuals", "predicted_vs_measured", "model_map"):
        assert _is_png(out / f"{name}.png"), name
    summary = json.loads((out / "model.json").read_text())
    assert summary["fit_rows"] == 2 and summary["call_overhead_s"] >= 0
    # resume: the same grid again launches nothing and leaves the rows alone
    again = runner.run_study(cli.grid_from_args(args), csv_path, out_dir=out, plots=False,
                             progress=False, serial_threads=[1])
    assert again.launched == 0 and again.skipped == 2 and not again.failed
    assert len(runner.read_rows(csv_path)) == 2


def test_layer_parallel_run_without_solve_statistics_says_so(monkeypatch) -> None:
    """A study run needs each batch's forward and adjoint solve statistics (its
    communication columns): a batch without them is a RuntimeError naming what is
    missing, not a bare assert (gone under ``python -O``)."""
    from mpi4py import MPI

    from layerpar.apps.loop import Step
    from layerpar.apps.studies import worker

    def no_stats(model, batches, lr, before=None):
        z = torch.zeros(1)
        yield Step(loss=z, output=z, target=z, seconds=0.0, forward_seconds=0.0,
                   backward_seconds=0.0)

    monkeypatch.setattr(worker, "_sgd", no_stats)
    cfg = {"model": "dense", "layers": 8, "width": 4, "batch": 4, "levels": 2,
           "cfactor": 2, "steps": 1, "warmup": 0}
    with pytest.raises(RuntimeError, match="no forward MGRIT solve"):
        worker.run_layer_parallel(cfg, MPI.COMM_SELF)


def test_a_scan_reports_the_fastest_structure_at_each_rank_count() -> None:
    """`fastest_per_ranks`: per problem and rank count the run with the least seconds per
    batch, whatever its structure, iterations or threads; failed runs (no finite time)
    left out; problems in the order the rows name them, ranks ascending.  `_structure`
    names the levels the layers give where ``--levels`` asked for more."""
    def row(layers: int, ranks: int, levels: int, cf: int, t: object) -> dict:
        return {"model": "dense", "layers": str(layers), "width": "32", "batch": "64",
                "ranks": str(ranks), "threads": "1", "levels": str(levels),
                "cfactor": str(cf), "fwd_iters": "1", "bwd_iters": "1",
                "seconds_per_batch": str(t)}

    rows = [row(1024, 16, 3, 4, 0.0268), row(1024, 16, 5, 4, 0.0151),
            row(1024, 16, 4, 8, "nan"), row(1024, 2, 3, 4, 0.0471), row(1024, 2, 5, 4, 0.05),
            row(256, 2, 3, 8, 0.012), row(256, 2, 5, 8, 0.0117), row(1024, 8, 4, 4, "")]
    got = runner.fastest_per_ranks(rows)
    assert [(r["layers"], r["ranks"], r["levels"]) for r in got] == [
        ("1024", "2", "3"), ("1024", "16", "5"), ("256", "2", "5")]
    assert cli._structure(got[1]) == "L5 cf4"
    assert cli._structure(got[2]) == "L3 cf8 (asked 5 levels)"
    assert runner.fastest_per_ranks([row(64, 1, 2, 2, "nan")]) == []
