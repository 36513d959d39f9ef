"""The baselines (`layerpar.parallel.baselines`): data and pipeline parallelism from the
same `ODENet`, behind the training-step interface all methods share.

In one process: the stage plans cut where `LayerParallel` cuts, and the serial and
layer-parallel adapters train as the serial net does.  Under mpiexec and torchrun at 2
and 4 ranks (`workers/lp_baselines.py`): every method's first gradients, losses, the
state after three SGD steps and the evaluated output equal serial training's (float64,
same initial weights), for a net with plain layers around one segment and one with two
segments; every schedule torch runs on CPU/gloo runs, and a count of micro-batches torch
refuses is refused alike on every rank; bad arguments fail alike on every rank.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from mpi_util import describe, rank_lines, run_mpi, run_torchrun
from torch import nn

import layerpar
from layerpar.mgrit.grid import Partition
from layerpar.ode import blocks
from layerpar.ode.net import Segment
from layerpar.parallel import Plan
from layerpar.parallel.baselines import (
    METHODS,
    SCHEDULES,
    LayerParallelMethod,
    SerialMethod,
    StagePlan,
    make_method,
)

WORKERS = Path(__file__).parent / "workers"
LAUNCHERS = {"mpiexec": run_mpi, "torchrun": run_torchrun}


def two_segments(n1: int = 8, n2: int = 6) -> layerpar.ODENet:
    torch.manual_seed(1)
    return layerpar.ODENet(layers=[nn.Linear(3, 4), Segment(lambda k: blocks.Dense(4), n1),
                                   nn.Tanh(), Segment(lambda k: blocks.Dense(4), n2),
                                   nn.Linear(4, 5)]).double()


def one_segment(n: int = 16) -> layerpar.ODENet:
    torch.manual_seed(0)
    return layerpar.ODENet(open=nn.Linear(3, 4), steps=lambda k: blocks.Dense(4),
                           n_steps=n, close=nn.Linear(4, 5)).double()


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_one_stage_per_rank_holds_layerparallels_layers(ranks: int) -> None:
    """gpipe/1f1b on one segment: stage q is LayerParallel's block q; the plain layer
    before the segment is on rank 0, the one after on the last rank."""
    net = one_segment(13)
    plan = StagePlan.build(net, ranks, "1f1b")
    lp = Plan.build(net, ranks, layerpar.MGRITOptions(max_levels=1))
    assert plan.ranks == tuple(range(ranks))
    for q, units in enumerate(plan.stages):
        steps = [st for k, st in units if st is not None]
        owned = lp.segments[0].layers(q)
        assert steps == [(owned.start, owned.stop)]
    assert plan.stages[0][0] == (0, None) and plan.stages[-1][-1] == (2, None)


@pytest.mark.parametrize("schedule", ["interleaved", "zero-bubble", "looped-bfs"])
def test_looped_stages_of_two_segments_are_layerparallels(schedule: str) -> None:
    """With v = S (two segments, the default), rank q holds block q of each segment:
    exactly LayerParallel's layers; plain layers between and after sit on the last rank."""
    net = two_segments()
    plan = StagePlan.build(net, 2, schedule)
    assert plan.ranks == (0, 1, 0, 1)
    for q in range(2):
        held = [u for s in plan.stages_of(q) for u in plan.stages[s]]
        want = []
        for k, seg in net.segments:
            r = Partition.build(seg.n_steps, 2).steps(q)
            want.append((k, (r.start, r.stop)))
        assert [u for u in held if u[1] is not None] == want
        plain = {k for k, st in held if st is None}
        assert plain == ({0} if q == 0 else {2, 4})


def test_v_and_contiguous_placements() -> None:
    """zbv puts stage s on rank s then 2P-1-s; a one-stage schedule over two segments
    cuts all residual layers into P contiguous blocks; every layer lands in one stage."""
    net = two_segments(8, 6)
    v = StagePlan.build(net, 2, "zbv")
    assert v.ranks == (0, 1, 1, 0)
    c = StagePlan.build(net, 2, "gpipe")
    assert [[u for u in s if u[1] is not None] for s in c.stages] == \
        [[(1, (0, 7))], [(1, (7, 8)), (3, (0, 6))]]
    for plan in (v, c, StagePlan.build(net, 2, "interleaved", stages_per_rank=4)):
        steps = sorted((k, n) for s in plan.stages for k, st in s if st for n in range(*st))
        assert steps == [(1, n) for n in range(8)] + [(3, n) for n in range(6)]
        plain = sorted(k for s in plan.stages for k, st in s if st is None)
        assert plain == [0, 2, 4]
    assert "stage 0 on rank 0: layers[0], layers[1] steps 0-6" in str(c)


@pytest.mark.parametrize("args, match", [
    (("bogus",), "`schedule` must be one of"),
    (("interleaved", 3), "multiple of the net's 2 segments"),
    (("zbv", 3), "`stages_per_rank` must be 2"),
    (("1f1b", 2), "`stages_per_rank` must be 1"),
    (("interleaved", 0), "`stages_per_rank` must be a positive int"),
])
def test_stage_plan_refusals(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=re.escape(match)):
        StagePlan.build(two_segments(), 2, *args)


def test_too_many_stages_for_a_segment() -> None:
    with pytest.raises(ValueError, match=r"has 6 layers but is cut into 8 pipeline stages"):
        StagePlan.build(two_segments(), 4, "interleaved", stages_per_rank=4)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y)


def test_serial_and_layerparallel_adapters_train_as_the_net(tol) -> None:
    """SerialMethod and LayerParallelMethod (one rank) give the plain net's gradients,
    losses and state; make_method builds by name and refuses unknown names."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 3, generator=g, dtype=torch.float64)
    y = torch.randint(0, 5, (8,), generator=g)
    ref = one_segment()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = loss_fn(ref(x), y)
        loss.backward()
        losses.append(float(loss.detach()))
        opt.step()
    for method in (SerialMethod(one_segment), make_method("layerparallel", one_segment()),
                   LayerParallelMethod(layerpar.LayerParallel(one_segment()))):
        opt = torch.optim.SGD(method.parameters(), lr=0.1)
        got = []
        for _ in range(3):
            got.append(method.train_step(x, y, loss_fn))
            opt.step()
        assert got == pytest.approx(losses, rel=tol[torch.float64].roundoff)
        state = method.gather_state_dict()
        for k, v in ref.state_dict().items():
            assert torch.allclose(state[k], v, rtol=tol[torch.float64].roundoff, atol=0)
        assert torch.allclose(method.eval_forward(x), ref(x).detach(),
                              rtol=tol[torch.float64].roundoff, atol=0)
        method.close()
    assert set(METHODS) == {"serial", "solo", "layerparallel", "data", "pipeline"}
    with pytest.raises(ValueError, match="`name` must be one of"):
        make_method("bogus", one_segment())
    with pytest.raises(TypeError, match="`net` must be an ODENet"):
        SerialMethod(nn.Linear(2, 2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`y` has 3 rows but `x` has 8"):
        SerialMethod(one_segment()).train_step(x, y[:3], loss_fn)


def _cases(proc) -> dict[int, dict[str, str]]:
    out: dict[int, dict[str, str]] = {}
    for r, lines in rank_lines(proc.stdout).items():
        for line in lines:
            m = re.match(r"CASE (\S+) (.*)", line)
            if m:
                out.setdefault(r, {})[m.group(1)] = m.group(2)
    return out


@pytest.mark.mpi
@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
@pytest.mark.parametrize("nprocs", [2, 4])
def test_baselines_train_as_the_serial_net(launcher: str, nprocs: int) -> None:
    """Data parallelism (DDP and layerpar's all-reduce), LayerParallel (exact) and the
    pipeline with every schedule and 2, 4 (and 8) micro-batches: gradients, losses,
    state after 3 SGD steps and output equal serial training's, at every rank."""
    proc = LAUNCHERS[launcher](WORKERS / "lp_baselines.py", nprocs, "correct", timeout=400)
    assert proc.returncode == 0, describe(proc)
    cases = _cases(proc)
    assert sorted(cases) == list(range(nprocs)), describe(proc)
    ms = (2, 4, 8) if nprocs > 2 else (2, 4)
    want = {f"{net}/{m}" for net in ("one", "two") for m in
            ["data-allreduce", "data-ddp", "layerparallel-exact",
             *(f"pipeline-{s}-m{k}" for s in SCHEDULES for k in ms)]}
    for r, got in cases.items():
        assert set(got) == want, describe(proc)
        bad = {k: v for k, v in got.items() if not v.startswith(("OK", "SKIP"))}
        assert not bad, f"rank {r}: {bad}\n{describe(proc)}"
        skipped = {k for k, v in got.items() if v.startswith("SKIP")}
        # torch asks 1F1B for at least one micro-batch per stage: the only refusal
        assert skipped == ({f"{net}/pipeline-1f1b-m2" for net in ("one", "two")}
                           if nprocs == 4 else set()), describe(proc)
        for k in skipped:
            assert "Number of microbatches (2) must be greater than or equal to the " \
                   "number of stages (4)" in got[k]
        status = {k: v.split()[0] for k, v in got.items()}  # (errors are each rank's own)
        assert status == {k: v.split()[0] for k, v in cases[0].items()}, describe(proc)
    assert all(lines[-1] == "DONE" for lines in rank_lines(proc.stdout).values())


@pytest.mark.mpi
def test_baselines_refuse_alike_on_every_rank() -> None:
    """Bad settings, settings that differ between ranks, a batch of fewer rows than
    ranks, and a rank passing a batch of another shape raise the same way on every rank."""
    proc = run_torchrun(WORKERS / "lp_baselines.py", 2, "refusals", timeout=200)
    assert proc.returncode == 0, describe(proc)
    cases = _cases(proc)
    assert cases[0] == cases[1], describe(proc)
    got = cases[0]
    assert got["schedule"].startswith("ValueError: `schedule` must be one of")
    assert got["microbatches"].startswith("ValueError: `microbatches` must be a positive")
    assert got["engine"].startswith("ValueError: `engine` must be one of")
    assert got["differ"].startswith("RankMismatchError:") and "`microbatches`" in got["differ"]
    assert "fewer than the 2 ranks" in got["rows"]
    assert got["batch-differ"].startswith("RankMismatchError:")


@pytest.mark.mpi
def test_tune_microbatches_chooses_alike_and_changes_nothing() -> None:
    """tune_microbatches times the candidates that divide the batch (3 does not), picks
    the same count on every rank and leaves the parameters and gradients untouched."""
    proc = run_mpi(WORKERS / "lp_baselines.py", 2, "tune", timeout=200)
    assert proc.returncode == 0, describe(proc)
    cases = _cases(proc)
    lines = [cases[r]["tune"] for r in (0, 1)]
    chosen = {re.search(r"chose=(\d+)", t).group(1) for t in lines}  # type: ignore[union-attr]
    assert len(chosen) == 1, describe(proc)
    for t in lines:
        assert "candidates=[1, 2, 4, 8] unchanged=True grads_unset=True" in t, describe(proc)
        assert float(t.rsplit("worst=", 1)[1]) <= 1e-12


def test_step_seconds_cuts_a_clearly_slower_candidate(monkeypatch: pytest.MonkeyPatch
                                                      ) -> None:
    """`step_seconds` (what `choose_method` and `tune_microbatches` time steps with):
    a warm-up step, then the fewest of at most `repeats` timed ones; two agreeing
    within AGREE end it, and against a time to beat a first timed step SLOWER times it
    ends it (the auto-tuning's rule, `timing.gauged_seconds`).  A clock the steps
    advance: the test does not depend on the machine; `.grad` is cleared after."""
    import types

    from layerpar.mgrit.transport import SerialTransport
    from layerpar.parallel import timing
    from layerpar.parallel.baselines.method import TrainingMethod, step_seconds

    now = [0.0]
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))

    class Clocked(TrainingMethod):
        name = "clocked"

        def __init__(self, durations: list[float]) -> None:
            self.transport = SerialTransport()
            self.w = nn.Parameter(torch.ones(()))
            self.durations, self.steps = durations, 0

        def train_step(self, x: torch.Tensor, y: object, loss_fn: object) -> float:
            now[0] += self.durations[self.steps]
            self.steps += 1
            (self.w * x.sum()).backward()
            return 0.0

        def parameters(self) -> list[nn.Parameter]:
            return [self.w]

        def eval_forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

        def gather_state_dict(self) -> dict[str, torch.Tensor]:
            return {}

    x = torch.ones(2)
    steady = Clocked([0.3, 0.100, 0.102, 0.05])
    assert step_seconds(steady, x, None, None, 3) == pytest.approx(0.100)
    assert steady.steps == 3 and steady.w.grad is None
    slow = Clocked([0.3, 0.25, 0.09, 0.09])  # warm-up and first timed step > 1.2 x 0.1
    assert step_seconds(slow, x, None, None, 3, bound=0.1) == pytest.approx(0.25)
    assert slow.steps == 2
    hopeless = Clocked([0.5, 0.1])  # warm-up > GIVE_UP x the time to beat: no more
    assert step_seconds(hopeless, x, None, None, 3, bound=0.1) == pytest.approx(0.5)
    assert hopeless.steps == 1


def test_solo_runs_at_the_thread_count_measured_fastest(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """`SoloMethod.tune_threads` times the step at each count, the most first and each
    against the fastest so far (a warm-up step before the first count only), keeps the
    fastest (the fewest on a tie) and leaves torch's thread count as it was; a bad
    count is refused by name.  A clock that each
    step advances by its thread count's duration: the test does not depend on the
    machine."""
    import types

    from layerpar.parallel import timing
    from layerpar.parallel.baselines import SoloMethod

    now = [0.0]
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randint(0, 5, (8,))
    before = torch.get_num_threads()

    ran: list[int] = []

    def clocked(durations: dict[int, float]):
        def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            ran.append(torch.get_num_threads())
            now[0] += durations[torch.get_num_threads()]
            return nn.functional.cross_entropy(out, target)
        return loss_fn

    solo = SoloMethod(one_segment())
    per = solo.tune_threads(x, y, clocked({1: 0.3, 2: 0.1, 4: 0.2}), counts=[4, 1, 2])
    assert solo.threads == 2 and per[2] == pytest.approx(0.1) and set(per) == {1, 2, 4}
    # 4: a warm-up and two agreeing steps; 2: two steps; 1: one step, clearly slower
    assert ran == [4, 4, 4, 2, 2, 1], ran
    assert per[4] == pytest.approx(0.2) and per[1] >= 0.3  # (cut: GIVE_UP x 0.1)
    assert torch.get_num_threads() == before
    assert all(p.grad is None for p in solo.parameters())
    tie = solo.tune_threads(x, y, clocked({1: 0.1, 2: 0.1}), counts=[1, 2])
    assert solo.threads == 1 and tie[1] == tie[2]
    with pytest.raises(ValueError, match="`counts`"):
        solo.tune_threads(x, y, clocked({1: 0.1}), counts=[0])


def test_a_solo_holding_its_threads_gives_them_back_when_closed() -> None:
    """`hold_threads` keeps rank 0 at solo's thread count between passes (the
    optimizer's step runs at it too) until `close`, which sets torch's count back."""
    from layerpar.parallel.baselines import SoloMethod

    before = torch.get_num_threads()
    other = 1 if before > 1 else 2
    solo = SoloMethod(one_segment(), threads=other)
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randint(0, 5, (8,))
    solo.train_step(x, y, nn.functional.cross_entropy)
    assert torch.get_num_threads() == before  # set back after a pass
    solo.hold_threads()
    solo.train_step(x, y, nn.functional.cross_entropy)
    assert torch.get_num_threads() == other
    solo.close()
    assert torch.get_num_threads() == before


def _user_cases(case: str, ranks: int = 2) -> dict[str, str]:
    """`workers/lp_baseline_users.py`'s verdicts by method, alike on every rank."""
    proc = run_mpi(WORKERS / "lp_baseline_users.py", ranks, case, timeout=300)
    assert proc.returncode == 0, describe(proc)
    lines = rank_lines(proc.stdout)
    assert sorted(lines) == list(range(ranks)) and all(
        got[-1] == "DONE" for got in lines.values()), describe(proc)
    assert len({tuple(got) for got in lines.values()}) == 1, describe(proc)
    return dict(ln.split(" ", 2)[1:] for ln in lines[0] if ln.startswith("CASE "))


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 4])
def test_a_parameter_shared_across_ranks_trains_as_serial_or_is_refused(ranks: int) -> None:
    """A weight tied between a layer before the segment and one after it, and one block
    module for every step: data parallelism trains as serial; a pipeline, whose ranks
    would each train a copy with their own stages' gradient, refuses it by name."""
    got = _user_cases("tied", ranks)
    for kind in ("tied", "shared"):
        assert got[f"{kind}/data"].startswith("OK"), got
        assert got[f"{kind}/pipeline"].startswith("RAISED ValueError: `layers.") and \
            "is the same tensor as" in got[f"{kind}/pipeline"], got


@pytest.mark.mpi
def test_data_parallelism_follows_replaced_and_unfrozen_parameters() -> None:
    """`load_state_dict(..., assign=True)` between steps replaces the parameters, and a
    layer frozen when the method was built is unfrozen later: both engines average the
    new ones (the ranks would otherwise step apart) and train as serial."""
    got = _user_cases("reload")
    for case in ("reload", "unfreeze"):
        for engine in ("allreduce", "ddp"):
            assert got[f"{case}/{engine}"].startswith("OK"), got


@pytest.mark.mpi
def test_any_loss_trains_as_serial_or_is_refused_where_the_batch_is_cut() -> None:
    """A sum, class weights and ignored rows are not means over the rows: averaging the
    losses of a batch's parts is not the batch's loss.  Data parallelism applies the
    loss to the gathered whole output (both engines: as serial); a pipeline of 2
    micro-batches refuses them by name, alike on every rank, and takes label
    smoothing (a mean); one micro-batch takes any loss."""
    got = _user_cases("losses")
    for kind in ("sum", "weighted", "ignored", "smoothed"):
        for name in ("data", "ddp", "pipeline-m1"):
            assert got[f"{kind}/{name}"].startswith("OK"), got
    for kind in ("sum", "weighted", "ignored"):
        assert got[f"{kind}/pipeline-m2"].startswith(
            "RAISED ValueError: `loss_fn` on the whole batch gave"), got
    assert got["smoothed/pipeline-m2"].startswith("OK"), got


@pytest.mark.mpi
def test_dropout_keeps_the_ranks_random_streams_in_step() -> None:
    """Dropout on one pipeline stage, and in each rank's share of the batch (each share
    masked by draws of its own, not one mask repeated): the ranks' generators stay in
    step (a shuffling DataLoader loads the same batch everywhere);
    a block drawing random numbers itself is refused by the pipeline; `choose_method`
    leaves the generators as it found them (its timing steps ran on some ranks only)."""
    got = _user_cases("streams")
    assert got["streams/data"].startswith("STREAMS") and \
        got["streams/data"].endswith("distinct=True"), got  # each share its own masks
    assert got["streams/pipeline"].startswith("STREAMS"), got
    assert got["streams/rand"].startswith("RAISED RuntimeError: the net drew random"), got
    assert got["streams/choose"].endswith("kept=True"), got


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 4])
def test_clipping_the_gradient_norm_trains_as_serial(ranks: int) -> None:
    """`method.clip_grad_norm_` clips by the whole net's norm on every rank: a pipeline
    rank holds only its stages' gradients, whose own norm torch's function would use."""
    got = _user_cases("clip", ranks)
    for name in ("data", "gpipe", "interleaved"):
        assert got[f"clip/{name}"].startswith("OK"), got


@pytest.mark.mpi
def test_another_ranks_optimizer_state_is_refused_for_a_pipeline() -> None:
    """Rank 0's ``optimizer.state_dict()`` loaded on every rank: right for the batch
    split (every rank holds the whole net), refused for a pipeline on every rank (each
    rank's optimizer holds its stages' parameters)."""
    got = _user_cases("optstate")
    assert got == {"optstate/data": "RAN", "optstate/pipeline": "REFUSED"}, got


@pytest.mark.mpi
def test_data_parallel_batch_norm_evaluates_alike_on_every_rank() -> None:
    """Each rank's batch norm updates its running statistics from its own share; after
    each step every rank takes rank 0's, so the state dicts and the evaluation after
    training are the same on every rank (both engines)."""
    got = _user_cases("bn")  # (every rank's lines alike: `_user_cases`)
    assert got["bn/allreduce"].startswith("STATE") and got["bn/ddp"].startswith("STATE")


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 4])
def test_batches_that_do_not_split_evenly_train_as_serial(ranks: int) -> None:
    """Batches of 7, 7 and 5 rows (an epoch's last batch is often smaller): shares as
    even as can be, each rank's mean loss weighted by its rows, train as serial; a
    pipeline of 4 micro-batches takes batches of 6 and 7 rows as the most micro-batches
    that divide them (under GPipe where 1F1B refuses that count), as serial."""
    got = _user_cases("ragged", ranks)
    for name in ("allreduce", "ddp", *SCHEDULES):
        assert got[f"ragged/{name}"].startswith("OK"), got


@pytest.mark.mpi
def test_what_a_pipeline_step_cannot_run_as_serial_is_refused_by_name() -> None:
    """A buffer updated in forward (a call counter; spectral norm's vectors) runs once a
    step with one micro-batch (as serial: the shapes' probe does not count) and is
    refused with two; one block module in two stages of one rank (torch scales each
    stage's gradients apart) and a micro-batch whose rows are all ignored by the loss
    (its loss NaN, the whole's finite) are refused."""
    got = _user_cases("stages")
    assert got["stages/counter-m1"].startswith("OK"), got
    for name in ("counter-m2", "spectral-m2"):
        assert got[f"stages/{name}"].startswith(
            "RAISED ValueError: the net updated its buffer(s)"), got
    assert "is the same tensor as" in got["stages/shared04"] and \
        "on rank 0" in got["stages/shared04"], got
    assert got["stages/ignored-part"].startswith(
        "RAISED ValueError: `loss_fn` on the whole batch gave"), got


@pytest.mark.mpi
def test_a_penalty_on_the_parameters_trains_as_serial_or_is_refused() -> None:
    """A loss adding a penalty on the net's weights: data parallelism counts it once
    (the output's gradient alone is scaled by the ranks), as serial; a pipeline, whose
    last stage's rank holds stale copies of the other stages, refuses it by name."""
    got = _user_cases("penalty")
    assert got["penalty/data"].startswith("OK") and got["penalty/ddp"].startswith("OK"), got
    assert got["penalty/pipeline"].startswith(
        "RAISED ValueError: `loss_fn` reached parameters of stages on other ranks"), got


@pytest.mark.mpi
def test_inputs_and_calls_the_methods_cannot_serve_are_refused_by_name() -> None:
    """An input that requires grad (no rank holds its whole gradient), targets that are
    not a tensor (torch cuts them into micro-batches), autocast around a pipeline (its
    buffers are the net's dtype), a closed method: refused by name on every rank; a
    dropout pipeline's eval_forward in training mode keeps the generators in step."""
    got = _user_cases("usage")
    for name in ("data", "pipeline"):
        assert got[f"usage/grad-x/{name}"].startswith("RAISED ValueError: `x` requires grad"), got
        assert got[f"usage/closed/{name}"].startswith("RAISED RuntimeError: this ") and \
            "was closed" in got[f"usage/closed/{name}"], got
    assert got["usage/tuple-y/pipeline"].startswith("RAISED TypeError: `y` must be a tensor"), got
    assert got["usage/autocast/pipeline"].startswith(
        "RAISED RuntimeError: PipelineNet does not run under torch.autocast"), got
    assert got["usage/eval-dropout"].startswith("STREAMS"), got


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 4])
def test_a_failure_on_one_rank_stops_every_rank_with_its_message(ranks: int) -> None:
    """A block raising on one rank only, in forward or in backward, caught by the
    user, under data parallelism (both engines), every pipeline schedule (and its
    eval_forward) and solo; a loss with a weight penalty under the zero-bubble
    schedules (torch cannot split its backward): every rank raises the failing rank's
    message within seconds, where the others waited in torch's own messages until the
    group's timeout; later calls say the method stopped; the user's group and
    communicator still work."""
    got = _user_cases("failure", ranks)
    last = ranks - 1
    for name, verdict in got.items():
        if name == "failure/world":
            assert verdict == f"SUM {ranks} {ranks}", got
            continue
        assert verdict.startswith("STOPPED ") and verdict.endswith(
            "| RuntimeError True | prompt"), (name, got)
    for case in [f"{e}/{w}" for e in ("allreduce", "ddp") for w in ("forward", "backward")] \
            + [f"{name}/forward" for name in SCHEDULES]:
        where = case.split("/")[1]
        assert f"boom in {where} on rank {last}" in got[f"failure/{case}"], got
    assert "boom in backward on rank 0" in got["failure/gpipe/backward"], got
    assert "boom in forward on rank 0" in got["failure/solo/forward"], got
    assert f"boom in forward on rank {last}" in got["failure/eval/pipeline"], got
    for name in ("zero-bubble", "zbv"):
        assert got[f"failure/{name}/penalty"].startswith(
            "STOPPED ValueError: `loss_fn` reached the parameters of this rank's stages"), got


@pytest.mark.mpi
def test_a_pipeline_stage_slower_than_the_timeout_stops_every_rank() -> None:
    """A stage that outlasts the method's `timeout` (3 s; it sleeps 9 s once): the
    schedule's receives, torch's own messages, are bounded by it too (the method's own
    group is made with it), so every rank raises gloo's timeout about 3 s into the step,
    under GPipe and 1F1B, instead of waiting for the stage (or the user's group's
    timeout, had it never come)."""
    got = _user_cases("stall", 2)
    for name in ("gpipe", "1f1b"):
        verdict, took = got[f"stall/{name}"].rsplit(" | ", 1)
        assert verdict == "STOPPED gloo timed out", got
        assert int(took) < 8, got


@pytest.mark.mpi
def test_a_collective_done_before_a_failure_is_read_returns_its_result() -> None:
    """A rank that reads a failure posted after a collective it took part in was done
    (it was descheduled before it saw the collective finish) returns the collective's
    result, as the failing rank did, and raises the failure at its next wait: every
    rank stops in the same place (raising at the collective instead, one rank of four
    stopped in a method's construction while the others stopped in its step)."""
    got = _user_cases("late", 2)
    assert got["late/gathered"] == "GOT [0, 1]", got
    assert got["late/next"] == "NEXT RuntimeError: late failure on rank 0", got
