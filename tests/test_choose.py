"""`choose_method`: layer-parallel, data-parallel and pipelined training timed on the
user's batch, the fastest kept, alike on every rank (`workers/lp_choose.py`).

Each candidate is made the fastest by its clock in turn and must be the one returned,
on every rank, at 1, 2 and 4 ranks; the returned method then trains as the serial net
does (float64).  Ranks whose clocks disagree still keep one candidate; with batch norm
the batch split stands aside and the pipeline runs one micro-batch, and the timing
steps leave the running statistics as they were, and the batch split's error under
batch norm is measured; bad arguments fail alike.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from mpi_util import describe, rank_lines, run_mpi

WORKER = Path(__file__).parent / "workers" / "lp_choose.py"


def _run(case: str, ranks: int) -> dict[int, list[str]]:
    proc = run_mpi(WORKER, ranks, case, timeout=300)
    assert proc.returncode == 0, describe(proc)
    lines = rank_lines(proc.stdout)
    assert sorted(lines) == list(range(ranks)), describe(proc)
    assert all(got[-1] == "DONE" for got in lines.values()), describe(proc)
    return lines


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_each_method_is_picked_when_its_clock_is_fastest(ranks: int) -> None:
    lines = _run("pick", ranks)
    kinds = {"serial": "SerialMethod", "solo": "SoloMethod",
             "layerparallel": "LayerParallelMethod",
             "data": "DataParallelNet", "pipeline": "PipelineNet"}
    for r, got in lines.items():
        for name, cls in kinds.items():
            chose = [ln for ln in got if ln.startswith(f"CASE pick/{name} CHOSE")]
            assert len(chose) == 1 and chose[0].split()[3].startswith(name) and \
                chose[0].endswith(cls), (r, got)
            ok = [ln for ln in got if ln.startswith(f"CASE pick/{name} OK")]
            assert ok, (r, got)
    assert len({tuple(g) for g in lines.values()}) == 1  # every rank alike


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_serial_and_the_batch_split_stand_on_layer_parallel_tuning(ranks: int) -> None:
    """Layer-parallel's tuning timed replicated serial and the batch split: the serial
    and data candidates take those times, and the one chosen is built then."""
    lines = _run("tabled", ranks)
    kinds = {"serial": "SerialMethod", "data": "DataParallelNet",
             "layerparallel": "LayerParallelMethod"}
    for r, got in lines.items():
        for name, cls in kinds.items():
            chose = [ln for ln in got if ln.startswith(f"CASE tabled/{name} CHOSE")]
            assert len(chose) == 1, (r, got)
            _, _, _, picked, kind, _, tabled = chose[0].split()
            assert (picked, kind) == (name, cls), (r, got)
            # one rank: layer-parallel's exact setting is serial autograd itself, and
            # nothing replicated is timed
            assert tabled == ("-" if ranks == 1 else "data,serial"), (r, got)
            assert f"CASE tabled/{name} OK" in " ".join(got), (r, got)
    assert len({tuple(g) for g in lines.values()}) == 1


@pytest.mark.mpi
def test_exact_propagation_is_timed_only_where_it_may_count() -> None:
    """Exact propagation runs the layers one after another, so a caller's serial step
    is the least its pass takes: where that is clearly slower than the time to beat,
    it is not timed unless an MGRIT setting's gradient check needs it (its time then
    prices the checks), and the choice says why it was not; a floor below the time to
    beat changes nothing (passes clocked at fixed times, alike on every rank)."""
    lines = _run("floor", 2)
    assert lines[0] == lines[1]
    assert lines[0][:3] == ["CASE floor beaten exact=0 checked=0 note=True",
                            "CASE floor checked exact=1 checked=1 note=False",
                            "CASE floor below exact=1 checked=0 note=False"], lines[0]


@pytest.mark.mpi
def test_ranks_whose_clocks_disagree_keep_one_method() -> None:
    lines = _run("disagree", 2)
    assert lines[0] == lines[1] and lines[0][0].startswith("CASE disagree CHOSE ")


@pytest.mark.mpi
def test_batch_norm_keeps_the_serial_statistics() -> None:
    for got in _run("bn", 2).values():
        data = [ln for ln in got if ln.startswith("CASE bn DATA ")]
        # measured, and then either kept or standing aside, never both
        assert data in (["CASE bn DATA measured=True kept=True aside=False"],
                        ["CASE bn DATA measured=True kept=False aside=True"]), got
        assert "CASE bn CHOSE pipeline_gpipe_m=1" in got, got
        # solo (the serial run a user would make) first, its serial gradient the
        # split's check; layer-parallel's tuning cannot time the split under batch
        # norm: it goes before
        assert "CASE bn ORDER solo,data,layerparallel,serial,pipeline,pipeline" in got, got
        assert any(ln.startswith("CASE bn OK") for ln in got), got


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_a_users_module_that_couples_rows_or_keeps_statistics_is_found(ranks: int) -> None:
    """No type tells that a user's block centres by the batch mean, keeps a running
    mean in a buffer, or draws its dropout mask itself: the probe of the net's rows
    finds each, and each method then equals serial training or is measured against
    it, never silently apart (nor does a pipeline's refusal stop the choice)."""
    for r, got in _run("coupled", ranks).items():
        line = {ln.split()[1]: ln for ln in got if ln.startswith("CASE coupled/")
                and "CHOSE" in ln}
        exact = {ln.split()[1]: ln.split()[2] for ln in got
                 if ln.startswith("CASE coupled/") and ln.split()[2] in ("EXACT", "INEXACT")}
        # the pipeline (made fastest) runs one micro-batch, saying why: serial's result
        for name in ("centred", "tracker"):
            assert re.search(f"coupled/{name}/pipeline CHOSE pipeline_(gpipe|1f1b)_m=1 ",
                             line[f"coupled/{name}/pipeline"]), got
            assert "PIPE_NOTE=True" in line[f"coupled/{name}/pipeline"], got
            assert exact[f"coupled/{name}/pipeline"] == "EXACT", got
        # coupled rows: the split is measured against serial's gradient, its note
        # naming the block (kept within the bound: then inexact, as batch norm's)
        assert "DATA kept=True measured=True" in line["coupled/centred/data"], got
        # a running statistic: the split stands aside naming the buffer
        assert "DATA kept=False measured=False buffer=True" in line["coupled/tracker/data"], got
        assert "CHOSE data" not in line["coupled/tracker/data"], got
        assert exact["coupled/tracker/data"] == "EXACT", got
        # drawing its own random numbers: the split and the pipeline stand aside
        # (the pipeline would refuse it at its first step), saying so; serial's result
        for fast in ("pipeline", "data"):
            got_line = line[f"coupled/drawing/{fast}"]
            assert re.search(r"CHOSE (serial|solo|layerparallel) ", got_line), got
            assert "'data'" in got_line and "'pipeline'" in got_line, got
            assert exact[f"coupled/drawing/{fast}"] == "EXACT", got
        # too short a training for timings apart: never layer-parallel's online trial
        for name in ("drawing", "tracker"):
            online = [ln for ln in got if ln.startswith(f"CASE coupled/online/{name} ")]
            assert len(online) == 1 and online[0].endswith(" EXACT"), got
            assert "CHOSE layerparallel" not in online[0], got
        # layer-parallel's own tuning times its batch split on the plain net only
        split = {ln.split()[1]: ln.split()[-1] for ln in got if "coupled/tuning/" in ln}
        assert split == {"coupled/tuning/plain": str(ranks > 1),
                         "coupled/tuning/centred": "False"}, (r, got)


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_under_autocast_the_pipeline_refuses_before_it_is_built(ranks: int) -> None:
    """Choosing under `torch.autocast` (bfloat16): the pipeline, which does not run
    under it, stands aside with its reason instead of failing the choice; every other
    candidate made fastest is kept and trains as serial does under autocast."""
    for r, got in _run("autocast", ranks).items():
        cases = [ln for ln in got if ln.startswith("CASE autocast/")]
        assert len(cases) == 5, got
        for ln in cases:
            fast, chose = ln.split()[1].split("/")[1], ln.split()[3]
            assert chose == ("layerparallel" if fast == "pipeline" else fast), (r, ln)
            assert "PIPE_REFUSED True OK" in ln, (r, ln)


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_a_training_too_short_to_time_each_candidate_times_on_its_own_steps(ranks: int
                                                                           ) -> None:
    """``online=True`` where the share of the steps to come pays for less than a
    warm-up and a timed step of each candidate: nothing is timed apart, layer-parallel
    under auto is returned with its trial of the exact settings running, the training's
    own steps decide it, alike on every rank, and it trains as serial does; a longer
    training, or a net with batch norm (the trial cannot split its batch), times the
    candidates apart."""
    lines = _run("online", ranks)
    assert len({tuple(g[:1] + g[2:]) for g in lines.values()}) == 1  # (errors: own)
    for got in lines.values():
        # (at one rank layer-parallel is serial autograd itself, tuned at once)
        assert got[0] == "CASE online CHOSE layerparallel LayerParallelMethod TIMED 0 " \
            f"TRIAL {ranks > 1}", got
        assert got[1].startswith(f"CASE online DECIDED True ONLINE {ranks > 1} OK"), got
        assert got[2:4] == ["CASE online LONG TIMED True", "CASE online BN TIMED True"], got


@pytest.mark.mpi
def test_bad_arguments_fail_alike() -> None:
    for got in _run("refusal", 2).values():
        assert got[0] == "CASE refusal RAISED True", got


@pytest.mark.mpi
def test_choosing_costs_at_most_its_share_of_the_training() -> None:
    lines = _run("budget", 2)
    assert lines[0] == lines[1]
    # solo, timed first (a few steps: the serial run a user would make), spent the
    # share of one step: nothing else is timed, layer-parallel's tuning included
    assert lines[0][0] == "CASE budget CHOSE solo SKIPPED layerparallel,serial,data," \
        "pipeline gpipe,pipeline 1f1b", lines
    assert lines[0][1] == "CASE budget threads held=True back=True", lines


@pytest.mark.mpi
def test_batch_split_under_batch_norm_is_held_to_the_bound() -> None:
    for got in _run("bnbound", 2).values():
        assert got[:2] == ["CASE bnbound 1e-12 kept=False", "CASE bnbound 10 kept=True"], got


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 4])
def test_the_batch_splits_check_runs_each_share_once_for_the_same_figures(ranks: int
                                                                          ) -> None:
    """The split's gradient error under batch norm, from each rank's share run once
    and averaged, equals its own step's against serial's; at 2 ranks the sampling
    error from the two shares equals the two halves' serial gradients' (as `Auto`
    measures it); at 4, the four shares' spread gives one.  From the serial gradient
    solo's timing steps kept (rank 0's alone), no serial copy is run and every rank
    has the same error."""
    for got in _run("splitcheck", ranks).values():
        assert got[0] == "CASE splitcheck err=True noise=True solo=True", got


@pytest.mark.mpi
def test_a_patient_wait_sleeps_so_the_working_rank_keeps_the_cores() -> None:
    """Solo's waiting ranks wait patiently: over 20 waits of 10 ms each they use a
    fraction of the CPU time a spinning wait burns (0.006 s against 0.12 s here).  And
    their clocks do not time solo's steps: a run in which only rank 1 works (30 ms)
    takes about nothing by rank 0's clock, on every rank."""
    proc = run_mpi(Path(__file__).parent / "workers" / "lp_patient.py", 2, timeout=120)
    assert proc.returncode == 0, describe(proc)
    lines = rank_lines(proc.stdout)
    got = {ln.split()[0]: float(ln.split()[2]) for ln in lines[1] if "cpu" in ln}
    assert got["patient"] < 0.25 * 0.2, got  # 0.2 s of waiting
    assert got["patient"] < 0.5 * got["spinning"], got
    for r in (0, 1):
        clock = next(ln.split() for ln in lines[r] if ln.startswith("clock"))
        every, root = float(clock[2]), float(clock[4])
        assert every >= 0.03 and root < 0.01, lines


@pytest.mark.mpi
def test_layer_parallel_tuning_takes_a_time_to_beat_and_a_limit() -> None:
    """A time per pass found outside (no MGRIT setting beats 1 ns: none is checked)
    and a limit of 0 s (no MGRIT setting is timed), alike on every rank; a limit
    given as a function of the fastest pass found is evaluated at the tuning's own
    finds (a budget counted in steps of the fastest way shrinks when the tuning finds
    a faster one)."""
    lines = _run("outside", 2)
    assert lines[0] == lines[1]
    beat, limit, shrinking, ample = lines[0][:4]
    assert beat.startswith("CASE outside to_beat mgrit=") and beat.endswith("checked=0")
    assert int(beat.split("mgrit=")[1].split()[0]) >= 1, beat
    assert limit == "CASE outside limit mgrit=0 checked=0", limit
    assert shrinking == "CASE outside shrinking mgrit=0 checked=0", shrinking
    assert int(ample.split("mgrit=")[1].split()[0]) >= 1, ample


def test_the_budget_counts_a_pipelines_setup() -> None:
    """A pipeline is not timed where its steps fit the share but its setup (stages and
    schedule built per micro-batch count, `PIPELINE_SETUP`) would not: on a 1.3-second
    Peaks training a sweep the steps alone allowed took 0.75 s."""
    import torch

    from layerpar.mgrit.transport import make_transport
    from layerpar.parallel import choose as ch

    cal = ch._Calibration(make_transport(None), torch.zeros(4, 2), None, lambda o, y: o.sum(),
                          2, lambda name, s: s, steps_to_come=1000, share=0.05)
    cal.held["serial"] = (lambda: None, 0.01)  # budget: 5 % of 1,000 steps of 10 ms = 0.5 s
    assert cal.spent(3 * 3, serial_long=True) is None
    why = cal.spent(3 * 3, serial_long=True, setup=3 * ch.PIPELINE_SETUP)
    assert why is not None and "9 more steps and about 0.60 s to set up" in why, why


def test_a_pipeline_no_faster_than_its_floor_is_not_built() -> None:
    """Solo's serial step at the ranks' thread count bounds a pipeline's step from
    below (the stages share its work; with one micro-batch they run one after
    another): where that floor is no faster than the fastest candidate, the pipeline
    is not built, and the table says why; where ranks run different thread counts,
    or solo was not timed at theirs, nothing is concluded."""
    import torch

    from layerpar.parallel import choose as ch

    class TwoRanks:  # (what `_pipeline_floor` asks of the transport)
        size = 2

        def __init__(self, counts: list[int]) -> None:
            self.counts = counts

        def allgather_object(self, value: object, what: str) -> list[object]:
            return list(self.counts)

    threads = torch.get_num_threads()
    cal = ch._Calibration(TwoRanks([threads, threads]), torch.zeros(4, 2), None,
                          lambda o, y: o.sum(), 2, lambda name, s: s, steps_to_come=None,
                          share=0.05)
    cal.held["data"] = (lambda: None, 0.10)
    cal.solo = {threads: 0.15}
    why = ch._pipeline_floor(cal, one_micro=True)  # 150 ms >= 100 ms
    assert why is not None and "at least the serial step, 150.0 ms" in why, why
    assert "(100.0 ms)" in why, why
    assert ch._pipeline_floor(cal, one_micro=False) is None  # 75 ms: it may win
    cal.solo = {threads: 0.25}
    why = ch._pipeline_floor(cal, one_micro=False)  # 125 ms over two ranks
    assert why is not None and "250.0 ms over 2 ranks, 125.0 ms" in why, why
    cal.solo = {threads + 1: 0.25}  # solo not timed at the ranks' count
    assert ch._pipeline_floor(cal, one_micro=True) is None
    cal.solo = {threads: 0.25}
    cal.transport = TwoRanks([threads, threads + 1])  # the ranks disagree
    assert ch._pipeline_floor(cal, one_micro=True) is None
    # in the table: each schedule stands aside with the reason, nothing built
    cal.transport = TwoRanks([threads, threads])
    ch._time_pipelines(cal, lambda: None, None, ("gpipe", "1f1b"), (1,), True)  # type: ignore[arg-type, return-value]
    assert [(t.name, t.seconds) for t in cal.trials] == \
        [("pipeline gpipe", None), ("pipeline 1f1b", None)]
    assert all(t.note.startswith("not timed: its stages run") for t in cal.trials)
