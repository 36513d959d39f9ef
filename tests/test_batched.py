"""The batched (vectorised) MGRIT cycle: same results as the per-step cycle, far fewer
tensor operations, and a clear fallback for blocks that cannot be vectorised.

Multi-rank (1, 2, 3, 4) comparisons run in an mpiexec job (workers/lp_batched.py)."""
from __future__ import annotations

import copy
import json
import warnings
import weakref
from pathlib import Path

import pytest
import torch
from mpi_util import rank_lines, run_mpi
from tolerances import F32, F64

import layerpar
from layerpar import MGRITOptions
from layerpar.apps import opcount
from layerpar.ode import blocks, flat

WORKERS = Path(__file__).parent / "workers"
INEXACT = (MGRITOptions(max_levels=3, cfactor=3, max_iter=2, tol=0.0),
           MGRITOptions(max_levels=3, cfactor=3, max_iter=1, tol=0.0))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / max(float(b.norm()), 1e-300))


def dense_net(n: int = 30, width: int = 5, **kw: object) -> layerpar.ODENet:
    return layerpar.ODENet(open=torch.nn.Linear(3, width),
                           steps=lambda k: blocks.Dense(width, **kw),  # type: ignore[arg-type]
                           n_steps=n, t_final=3.0, close=torch.nn.Linear(width, 4))


def train(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple:
    xp = x.clone().requires_grad_()
    out = model(xp)
    torch.nn.functional.cross_entropy(out, y).backward()
    return out.detach(), xp.grad, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("scheme", ["euler", "rk4"])
def test_batched_equals_per_step_path(dtype: torch.dtype, scheme: str, tol: dict) -> None:
    torch.manual_seed(0)
    net = layerpar.ODENet(open=torch.nn.Linear(3, 5), steps=lambda k: blocks.Dense(5),
                          n_steps=29, t_final=3.0, close=torch.nn.Linear(5, 4),
                          scheme=scheme).to(dtype)
    x, y = torch.randn(7, 3, dtype=dtype), torch.randint(0, 4, (7,))
    mb = layerpar.LayerParallel(copy.deepcopy(net), None, *INEXACT, batched=True)
    ms = layerpar.LayerParallel(copy.deepcopy(net), None, *INEXACT, batched=False)
    assert mb._runners[1].vectorised is not None and ms._runners[1].vectorised is None
    b, s = train(mb, x, y), train(ms, x, y)
    bound = tol[dtype].roundoff
    assert rel(b[0], s[0]) <= bound and rel(b[1], s[1]) <= bound
    for name in b[2]:
        assert rel(b[2][name], s[2][name]) <= bound, name
    assert mb.last_forward[0].iterations == ms.last_forward[0].iterations == 2


class Unread(torch.nn.Module):
    """A residual branch with a trainable parameter its forward never reads."""

    def __init__(self, w: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(w, w)
        self.unread = torch.nn.Parameter(torch.ones(w))

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(u))


def test_a_parameter_the_blocks_never_read_gets_no_gradient() -> None:
    """As in serial autograd (and on the per-step path), a parameter the blocks never
    read keeps `.grad` None on the batched path, not a zero gradient that an optimizer
    would step with (weight decay, momentum); the others' gradients are the per-step
    path's."""
    torch.manual_seed(0)
    net = layerpar.ODENet(open=torch.nn.Linear(3, 5), steps=lambda k: Unread(5),
                          n_steps=12, t_final=1.0, close=torch.nn.Linear(5, 4)).double()
    x, y = torch.randn(7, 3, dtype=torch.float64), torch.randint(0, 4, (7,))
    serial = copy.deepcopy(net)
    _, _, gs = train(serial, x, y)
    mb = layerpar.LayerParallel(copy.deepcopy(net), None, *INEXACT, batched=True)
    ms = layerpar.LayerParallel(copy.deepcopy(net), None, *INEXACT, batched=False)
    assert mb._runners[1].vectorised is not None
    b, s = train(mb, x, y), train(ms, x, y)
    for name, g in b[2].items():
        if name.endswith(".unread"):
            assert g is None and s[2][name] is None and gs[name] is None, name
        else:
            assert rel(g, s[2][name]) <= F64.roundoff, name


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["layers", "data"])
def test_a_parameter_the_blocks_never_read_at_two_processes(mode: str) -> None:
    """The same at 2 processes: a segment over both (rows next to the boundary stepped
    again, `AdjointApp._rows_vjp`) and two data replicas (gradients averaged record by
    record): its missing gradient is skipped there too."""
    proc = run_mpi(WORKERS / "lp_unread_param.py", 2, mode, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = rank_lines(proc.stdout)
    assert sorted(got) == [0, 1], proc.stdout
    for r, lines in got.items():
        worst, given = lines[-1].split()
        assert float(worst) <= F64.roundoff and given == "-", (r, lines)


def test_gradients_are_rows_of_one_tensor_and_accumulate() -> None:
    """A plain backward() puts each layer's gradient into .grad as a row of one stacked
    tensor (no copy per layer); a second backward accumulates as serial code does."""
    torch.manual_seed(0)
    net = dense_net().double()
    model = layerpar.LayerParallel(net, None, *INEXACT, batched=True)
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randint(0, 4, (6,))
    _, _, g1 = train(model, x, y)
    g1 = {n: g.clone() for n, g in g1.items()}
    ws = [model.layers[1].blocks[str(k)].linear.weight.grad for k in range(30)]
    assert ws[0]._base is not None and all(w._base is ws[0]._base for w in ws)
    assert all(w.is_contiguous() for w in ws)  # torch's fused CPU Adam needs it
    _, _, g2 = train(model, x, y)
    for n in g1:
        assert rel(g2[n], 2 * g1[n]) <= F64.step, n


def test_hooks_and_retained_grads_are_honoured() -> None:
    torch.manual_seed(0)
    model = layerpar.LayerParallel(dense_net().double(), None, *INEXACT, batched=True)
    p = model.layers[1].blocks["4"].linear.weight
    seen = []
    p.register_hook(lambda g: seen.append(g.clone()))
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randint(0, 4, (6,))
    _, _, g = train(model, x, y)
    assert len(seen) == 1 and torch.equal(seen[0], g["layers.1.blocks.4.linear.weight"])


def test_blocks_that_cannot_be_vectorised_fall_back_with_one_warning() -> None:
    torch.manual_seed(0)
    acts = ["tanh", "relu"]
    net = layerpar.ODENet(open=torch.nn.Linear(3, 5),
                          steps=lambda k: blocks.Dense(5, activation=acts[k % 2]),
                          n_steps=12, t_final=2.0, close=torch.nn.Linear(5, 4)).double()
    with pytest.warns(UserWarning, match="Dense is not vectorised .*differ in structure") \
            as caught:
        model = layerpar.LayerParallel(copy.deepcopy(net), None, *INEXACT, batched=True)
    assert caught[0].filename == __file__  # the user's line, not layerpar's
    assert model._runners[1].vectorised is None
    # and the per-step path it falls back to is still right
    ref = layerpar.LayerParallel(copy.deepcopy(net), None, *INEXACT, batched=False)
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randint(0, 4, (6,))
    assert rel(train(model, x, y)[0], train(ref, x, y)[0]) == 0.0


def test_a_block_whose_vmap_fails_falls_back_at_the_first_pass() -> None:
    class Items(torch.nn.Module):  # data-dependent Python control flow: vmap cannot
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(5, 5)

        def forward(self, u: torch.Tensor) -> torch.Tensor:
            return self.lin(u) if float(u.detach().sum()) > -1e9 else u

    torch.manual_seed(0)
    net = layerpar.ODENet(open=torch.nn.Linear(3, 5), steps=lambda k: Items(), n_steps=12,
                          t_final=2.0, close=torch.nn.Linear(5, 4)).double()
    model = layerpar.LayerParallel(net, None, *INEXACT, batched=True)
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randint(0, 4, (6,))
    with pytest.warns(UserWarning, match="Items is not vectorised .*vmap failed") as caught:
        train(model, x, y)
    assert caught[0].filename == __file__  # the user's pass (here, in `train`)
    assert model._runners[1].vectorised is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train(model, x, y)  # once only


class Checkpointed(torch.nn.Module):
    """Recomputes its activations in the backward (`torch.utils.checkpoint`): its
    forward runs under vmap, its backward does not."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(5, 8), torch.nn.Linear(8, 5)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(
            lambda v: self.b(torch.tanh(self.a(v))), u, use_reentrant=False)


@pytest.mark.parametrize("batched", [True, None])
def test_a_block_vmap_cannot_differentiate_falls_back_at_the_first_pass(batched) -> None:
    """The first pass's probe runs the vectorised step's backward too: a block whose
    vmapped forward works and whose backward fails steps layer by layer, with the
    per-step path's gradients (it raised from the path timing or the first adjoint)."""
    torch.manual_seed(0)
    net = layerpar.ODENet(open=torch.nn.Linear(3, 5), steps=lambda k: Checkpointed(),
                          n_steps=12, t_final=2.0, close=torch.nn.Linear(5, 4)).double()
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randint(0, 4, (6,))
    _, _, want = train(layerpar.LayerParallel(copy.deepcopy(net), None, *INEXACT,
                                              batched=False), x, y)
    model = layerpar.LayerParallel(net, None, *INEXACT, batched=batched)
    why = model._runners[1].vectorised.probe(torch.zeros(6, 5, dtype=torch.float64))
    assert why.startswith("vmap's backward failed: RuntimeError"), why
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the one warning per block type may be gone)
        _, _, got = train(model, x, y)
    assert model._runners[1].vectorised is None
    assert max(rel(g, want[n]) for n, g in got.items()) <= F64.roundoff


def test_operation_counts_are_pinned() -> None:
    """Operations per training batch (zero_grad, forward, backward, SGD step) on small
    nets: the batched cycle's count is independent of the layers per interval, and a
    regression that brings back per-layer work fails here.  If a deliberate change
    moves these numbers, update them from `python -m layerpar.bench ops --quick`."""
    torch.set_num_threads(1)
    rows = {r.model: r for r in opcount.ops_rows(quick=True)}
    assert (rows["dense"].serial_ops, rows["dense"].mgrit_ops) == (1050, 447)
    assert (rows["conv"].serial_ops, rows["conv"].mgrit_ops) == (602, 385)
    # the per-step path issues several times more
    steps = {r.model: r for r in opcount.ops_rows(quick=True, models=("dense",),
                                                  batched=False)}
    assert steps["dense"].mgrit_ops > 3 * rows["dense"].mgrit_ops


def test_operation_count_grows_with_levels_not_layers() -> None:
    """4x the layers is one more level (cf 4, coarsest 16): each adds about the same
    number of operations, while serial training's count grows 4x."""
    torch.set_num_threads(1)
    counts = []
    for n in (64, 256, 1024):
        torch.manual_seed(0)
        net, x, y = opcount.dense_model(n_steps=n, width=4, batch=2)
        fwd, bwd = opcount.mgrit_options(n)
        lp = layerpar.LayerParallel(net, None, fwd, bwd, batched=True)
        opt = torch.optim.SGD(lp.parameters(), lr=1e-3, foreach=True)
        counts.append(opcount.count_ops(opcount.train_step(lp, opt, x, y))[0])
    first, second = counts[1] - counts[0], counts[2] - counts[1]
    assert abs(second - first) <= 0.3 * first, counts
    assert counts[2] < 2 * counts[0], counts


def test_structures_are_computed_once_inside_same_structures(monkeypatch) -> None:
    """`same_structures` (the auto-tuning builds a model per candidate over the same
    modules): inside, a module's structure is computed once; outside, every time, so
    a module changed between two tunings is seen; nested uses share the outer cache."""
    import layerpar.parallel.batched as batched
    from layerpar.ode import blocks

    walks: list[int] = []
    named = torch.nn.Module.named_modules

    def counted(self, *a, **k):  # structure walks the module's tree once per call
        walks.append(id(self))
        return named(self, *a, **k)

    monkeypatch.setattr(torch.nn.Module, "named_modules", counted)
    block = blocks.Dense(4)
    first = batched.structure(block)
    with batched.same_structures():
        assert batched.structure(block) == first
        with batched.same_structures():
            assert batched.structure(block) == first
        assert batched.structure(block) == first
    assert walks.count(id(block)) == 2  # once outside, once for the whole context
    block.activation = "relu"  # changed between two tunings: seen
    with batched.same_structures():
        assert batched.structure(block) != first


def test_adjoint_sweeps_do_not_flip_their_batches() -> None:
    """The adjoint visits a record's rows last to first; its F-sweeps hand each
    batched step's result on in the record's order (reversed `Row`s) instead of
    flipping every input and result (issue 20: 16 copies of the whole batch a step
    at 2 levels, cf 8).  Flips per training step, pinned: a fine sweep flips its
    first input only; a coarse sweep's steps also feed the level's sums, which flip."""
    from layerpar import MGRITOptions

    torch.set_num_threads(1)
    got = {}
    for levels in (2, 3):
        torch.manual_seed(0)
        net, x, y = opcount.dense_model(n_steps=256, width=4, batch=2)
        opts = MGRITOptions(max_levels=levels, cfactor=8, max_iter=1, tol=0.0)
        lp = layerpar.LayerParallel(net, None, opts, opts, batched=True)
        opt = torch.optim.SGD(lp.parameters(), lr=1e-3, foreach=True)
        got[levels] = opcount.count_ops(opcount.train_step(lp, opt, x, y))[1]
    assert got[2].get("aten::flip", 0) == 1  # (16 before)
    assert got[3].get("aten::flip", 0) == 9  # (23 before)
    # the coarse steps' parameters are strided views in the forward order, and the
    # engine's zero state repeated is broadcast into its sums, not stacked
    assert got[3].get("aten::stack", 0) == 6  # (28 before)


def test_a_repeated_state_is_broadcast_into_a_sum() -> None:
    """`batched_sum` with one tensor repeated on a side (the engine's zero state):
    the same values, bit for bit, as the stacked sum, without a copy of the batch."""
    from layerpar.parallel.batched import Row, batched_sum, stack_rows

    zero, base = torch.zeros(3, 4), torch.randn(5, 3, 4)
    xs = [Row(base, k) for k in range(5)]
    for alpha, beta in ((1.0, 1.0), (1.0, -1.0), (0.5, 2.0)):
        got = torch.stack([r.tensor() for r in batched_sum(alpha, xs, beta, [zero] * 5)])
        want = alpha * stack_rows(xs) + beta * torch.stack([zero] * 5)
        assert torch.equal(got, want)
        back = torch.stack([r.tensor() for r in batched_sum(alpha, [zero] * 5, beta, xs)])
        assert torch.equal(back, alpha * torch.stack([zero] * 5) + beta * base)
    calls = opcount.count_ops(lambda: batched_sum(1.0, xs, -1.0, [zero] * 5))[1]
    assert "aten::stack" not in calls


def test_counting_drops_only_the_profilers_trace_from_stderr(capfd) -> None:
    """count_ops hides the ``USDT: profiler_start/stop`` lines some torch builds print
    at every profile, and keeps whatever else the counted call writes to stderr."""
    import os

    def noisy() -> None:
        os.write(2, b"USDT: profiler_start (a stand-in)\nkept line\n")
        torch.ones(2).add_(1)

    count_ops = opcount.count_ops(noisy)[1]
    assert count_ops.get("aten::add_") == 1
    err = capfd.readouterr().err
    # the untimed call's stderr is left as it is; the profiled call's loses its trace
    assert err.count("USDT") == 1 and err.count("kept line") == 2


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_batched_equals_per_step_at_every_rank_count(nprocs: int, tmp_path: Path) -> None:
    out = tmp_path / "b.json"
    proc = run_mpi(WORKERS / "lp_batched.py", nprocs, str(out), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert len(results) == 18
    for name, r in results.items():
        tol = (F32 if "float32" in name else F64).roundoff
        assert r["batched_used"], name
        assert r["batched_vs_steps"] <= tol, (name, r)
        assert r["iters"] == r["iters_steps"], name
        assert len(r["history"]) == len(r["history_steps"])
        scale = r["history_steps"][0]  # late residuals sit at round-off of this
        for a, b in zip(r["history"], r["history_steps"]):
            assert abs(a - b) <= 10 * tol * scale, (name, r)
        if "inexact" in name:
            assert r["iters"] == [2, 1], name
        else:
            assert r["oracle"] <= F64.converged, (name, r)
    if nprocs > 1:  # the rows next to a rank boundary are swept alone: stepped again
        assert all(r["sparse_rows"] > 0 for r in results.values()), results


@pytest.mark.parametrize("blocks_from", [0, 5])
def test_averaged_coarse_parameters_match_coarse_block(blocks_from: int) -> None:
    """`BatchedBlocks.averaged` (one stack and one mean per span, rows of it) gives the
    parameters `coarse_block(..., "average")` averages, for aligned intervals that
    follow each other, out of order, truncated at the end, and starting before the
    blocks' range (blocks from layer 5: the fallback, interval by interval)."""
    from layerpar.ode.coarsening import coarse_block
    from layerpar.parallel.batched import BatchedBlocks

    torch.manual_seed(0)
    seg = dense_net(n=30, width=4).layers[1]
    have = {k: seg.blocks[k] for k in range(blocks_from, 30)}
    bb = BatchedBlocks(have, seg.scheme, [seg.time(i) for i in range(31)], "average")
    cases = [((6, 9), (9, 12), (12, 15)), ((12, 15), (6, 9)), ((27, 30),), ((24, 30),),
             ((18, 27),), ((28, 30),), ((10, 14),)]
    for pairs in cases:
        if min(a for a, _ in pairs) < blocks_from:
            continue
        got = bb.averaged(pairs)
        for k, (a, b) in enumerate(pairs):
            # what coarse_block evaluates: block a with the spanned layers' mean
            u = torch.randn(3, 4)
            want = coarse_block(list(seg.blocks), a, b, "average")(u)
            one = {n: t[k:k + 1] for n, t in got.items()}
            assert torch.allclose(bb.fn(one, {}, u[None])[0], want, rtol=1e-6,
                                  atol=1e-7), pairs
            assert not any(t.requires_grad for t in got.values())
    bb.new_pass()
    assert not any(key[0] == "average" for key in bb._stacked if isinstance(key[0], str))


def test_average_two_forwards_then_one_backward() -> None:
    """Average coarsening, two forward passes before one backward: the vectorised
    cycle's gradients equal the per-step cycle's (each backward steps through its own
    pass's path and averages)."""
    torch.manual_seed(0)
    net = dense_net(n=37, width=6).double()
    x1, x2 = torch.randn(9, 3, dtype=torch.float64), torch.randn(9, 3, dtype=torch.float64)
    y = torch.randint(0, 4, (9,))
    grads = []
    for batched in (True, False):
        m = layerpar.LayerParallel(copy.deepcopy(net), None, *INEXACT, batched=batched,
                                   coarsening="average")
        first = torch.nn.functional.cross_entropy(m(x1), y)
        second = torch.nn.functional.cross_entropy(m(x2), y)
        (first + 2 * second).backward()
        assert all(r.bb is not None for r in m._runners.values()) == batched
        grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
        m.close()
    for n, g in grads[0].items():
        assert rel(g, grads[1][n]) <= F64.roundoff, n


@pytest.mark.parametrize("ks, rows, n_rec", [
    (list(range(63)), list(range(62, -1, -1)), 64),  # rank 0: a record less its last row
    (list(range(63)), list(range(62, -1, -1)), 63),  # rank 1: a whole record, reversed
    ([1, 2, 3], [5, 6, 7], 9),                      # a span inside, in order
    ([4, 0, 2], [1, 5, 3], 6),                      # not a span: gathered and scattered
    ([0, 3], [2, 2 + 1], 4),                        # a span of rows, not of ks
])
def test_adjoint_row_moves_equal_indexed_copies(ks: list, rows: list, n_rec: int,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The adjoint's cotangent of a record (rows[i] <- lam[ks[i]], the others zero) and
    the output's rows (out[ks[i]] <- dx[rows[i]], the others kept), moved by slices
    where the rows are one span, equal the plain indexed copies, row for row."""
    from layerpar.parallel.adjoint import AdjointApp

    app = AdjointApp.__new__(AdjointApp)
    app.index_cache, app.move_cache = {}, {}
    g = torch.Generator().manual_seed(0)
    lam = torch.randn(max(ks) + 2, 3, 2, generator=g)
    want = torch.zeros(n_rec, 3, 2)
    for k, r in zip(ks, rows):
        want[r] = lam[k]
    dx = torch.randn(n_rec, 3, 2, generator=g)
    out = torch.randn(lam.shape, generator=g)
    expect = out.clone()
    for k, r in zip(ks, rows):
        expect[k] = dx[r]
    # new tensors come filled with NaN: a row left unzeroed cannot pass as zero
    monkeypatch.setattr(torch.utils.deterministic, "fill_uninitialized_memory", True)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        got = [app._gather(lam, ks, rows, want.shape) for _ in range(2)]  # 2nd: cached plan
        app._scatter(out, ks, dx, rows)
    finally:
        torch.use_deterministic_algorithms(was)
    assert all(torch.equal(c, want) for c in got)
    assert torch.equal(out, expect)


def test_segment_parameters_are_flat_rows_and_steps_read_views() -> None:
    """A Segment keeps its blocks' parameters as the rows of one tensor per name (the
    values and Parameter objects unchanged), again after `.double()`; LayerParallel's
    vectorised steps read views of those rows instead of stacking copies; a `.data` a
    user sets is honoured (that name is stacked again), and the results equal the
    per-step path's throughout."""
    torch.manual_seed(0)
    torch.nn.Linear(3, 5), torch.nn.Linear(5, 4)  # dense_net's open and close draw first
    want = [blocks.Dense(5) for _ in range(30)]
    torch.manual_seed(0)
    net = dense_net()
    seg = net.layers[1]
    params = [b.linear.weight for b in seg.blocks]
    assert all(torch.equal(p, w.linear.weight) for p, w in zip(params, want))
    for name in ("linear.weight", "linear.bias"):
        col = [dict(b.named_parameters())[name] for b in seg.blocks]
        assert flat.rows(col) is not None, name
    net = net.double()
    assert [b.linear.weight for b in seg.blocks] == params  # the same objects
    assert params[0].dtype == torch.float64 and flat.rows(params) is not None
    # tied blocks (one module twice) are left apart, and still train
    tied = layerpar.ode.sequential_segment([want[0], want[0], want[1]])
    assert flat.rows([b.linear.weight for b in tied.blocks]) is None

    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randint(0, 4, (6,))
    mb = layerpar.LayerParallel(copy.deepcopy(net), None, *INEXACT, batched=True)
    ms = layerpar.LayerParallel(copy.deepcopy(net), None, *INEXACT, batched=False)
    bb = mb._runners[1].vectorised
    assert bb is not None and sorted(bb._flat) == [0, 1]  # a deep copy is made flat too
    w0 = mb.layers[1].blocks["0"].linear.weight
    bb.new_pass()
    view = bb.stacked((0, 3, 6))[0]["linear.weight"]
    assert view.data_ptr() == w0.data_ptr() and view.stride()[0] == 3 * 25
    for step in range(2):
        b, s = train(mb, x, y), train(ms, x, y)
        assert rel(b[0], s[0]) <= F64.roundoff and rel(b[1], s[1]) <= F64.roundoff
        for name in b[2]:
            assert rel(b[2][name], s[2][name]) <= F64.roundoff, (step, name)
        for m in (mb, ms):  # a user's own storage for one layer's weight
            w = m.layers[1].blocks["4"].linear.weight
            w.data = w.data + 0.1
            m.zero_grad()
    assert sorted(bb._flat) == [1]  # the weights are stacked again, the biases are views


def test_making_parameters_flat_keeps_their_gradients_and_hooks() -> None:
    """`flat.flatten` swaps each tensor for a row of one storage: a gradient accumulated
    before (a LayerParallel, or auto's MGRIT twin, built between a backward and the
    optimizer's step) stays the parameter's, and a tensor with a user's hooks is left
    as it is (swapping would drop them), so the hooks still fire."""
    blks = [torch.nn.Linear(3, 3) for _ in range(4)]
    grads = [torch.full_like(b.weight, float(k)) for k, b in enumerate(blks)]
    for b, g in zip(blks, grads):
        b.weight.grad = g.clone()
    flat.flatten(blks)
    assert flat.rows([b.weight for b in blks]) is not None
    assert all(torch.equal(b.weight.grad, g) for b, g in zip(blks, grads))

    blks = [torch.nn.Linear(3, 3) for _ in range(4)]
    fired: list[str] = []
    blks[1].weight.register_hook(lambda g: fired.append("hook"))
    blks[2].bias.register_post_accumulate_grad_hook(lambda p: fired.append("post"))
    flat.flatten(blks)
    assert flat.rows([b.weight for b in blks]) is None
    assert flat.rows([b.bias for b in blks]) is None
    x = torch.randn(2, 3)
    sum(b(x).sum() for b in blks).backward()
    assert sorted(fired) == ["hook", "post"]


def test_nothing_is_made_flat_under_autocast() -> None:
    """Inside a `torch.autocast` region the casts of the parameters (their autograd
    nodes) live until the region ends: a parameter swapped for a row then would fail
    the backward ("poisoned by swap_tensors", as an auto setting built during a pass
    did), so `flatten` leaves them; after the region it makes them flat."""
    blks = [torch.nn.Linear(3, 3) for _ in range(3)]
    x = torch.randn(5, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = sum(b(x).float().sum() for b in blks)
        flat.flatten(blks)
        out.backward()
    assert all(b.weight.grad is not None for b in blks)
    assert flat.rows([b.weight for b in blks]) is None
    flat.flatten(blks)
    assert flat.rows([b.weight for b in blks]) is not None


def test_auto_keeps_the_first_batchs_gradients() -> None:
    """Under ``options="auto"`` without `tune()`, the first training pass's backward
    tunes (building MGRIT twins of the same blocks) after the gradients were written:
    they stay serial's, in every layer."""
    torch.manual_seed(6)
    serial = layerpar.ODENet(
        open=torch.nn.Linear(3, 4),
        steps=lambda k: torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()),
        n_steps=8, close=torch.nn.Linear(4, 5)).double()
    model = layerpar.LayerParallel(copy.deepcopy(serial), None, "auto")
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.tensor([0, 1, 2, 3])
    for m in (serial, model):
        torch.nn.functional.cross_entropy(m(x), y).backward()
    assert model.tuner is not None and model.tuner.tuned
    want = dict(serial.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert rel(p.grad, want[name].grad) <= F64.roundoff, name
    model.close()


def test_a_parameter_changed_between_forward_and_backward_is_refused() -> None:
    """The vectorised steps read the parameters as views: one changed in place after
    the forward pass would make the backward pass mix two values, so it is refused,
    as serial autograd refuses it."""
    torch.manual_seed(0)
    net = dense_net().double()
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randint(0, 4, (6,))
    lp = layerpar.LayerParallel(copy.deepcopy(net), None, *INEXACT, batched=True)
    for model, blk in ((net, net.layers[1].blocks[4]), (lp, lp.layers[1].blocks["4"])):
        out = model(x)
        with torch.no_grad():
            blk.linear.weight.mul_(1.5)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            torch.nn.functional.cross_entropy(out, y).backward()
    # a forward pass after the change is fine
    torch.nn.functional.cross_entropy(lp(x), y).backward()


def test_gradient_rows_are_reused_only_where_nothing_holds_them() -> None:
    """After `zero_grad()` a pass writes its gradients into the last pass's rows (the
    same `.grad` tensors come back, no new views per layer), with the per-step path's
    values; a row, its base or a view of it that a user holds is never overwritten
    (new rows are made then)."""
    torch.manual_seed(0)
    net = dense_net().double()
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randint(0, 4, (6,))
    mb = layerpar.LayerParallel(copy.deepcopy(net), None, *INEXACT, batched=True)
    ms = layerpar.LayerParallel(copy.deepcopy(net), None, *INEXACT, batched=False)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (mb, ms)]

    def step() -> torch.Tensor:
        for m, opt in zip((mb, ms), opts):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
        for (name, a), b in zip(mb.named_parameters(), ms.parameters()):
            assert rel(a.grad, b.grad) <= F64.roundoff, name
        for opt in opts:
            opt.step()
        return mb.layers[1].blocks["4"].linear.weight.grad

    g = weakref.ref(step())  # (a weak reference holds nothing)
    assert step() is g()  # reused
    for hold in (lambda t: t, lambda t: t._base, lambda t: t.view(-1)):
        held = hold(step())
        want = held.clone()
        g = weakref.ref(step())
        assert torch.equal(held, want)  # not overwritten: new rows were made
        assert step() is g()  # and those are reused, nothing holding them
        del held


_ATTR_BLOCK = """
import functools, sys, torch
from torch import nn
from layerpar.parallel.batched import structure
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.act = functools.partial(torch.nn.functional.leaky_relu, negative_slope=0.1)
        self.gen = torch.Generator()
    def forward(self, u):
        return self.act(self.lin(u))
print(repr(structure(Block())))
"""


def test_structure_is_the_same_in_every_process() -> None:
    """A pure block holding an object whose repr has a memory address (a
    `functools.partial` activation, an unused `torch.Generator`) digests alike in two
    processes: identical nets on two ranks were refused as a structure mismatch."""
    import subprocess
    import sys

    got = [subprocess.run([sys.executable, "-c", _ATTR_BLOCK], capture_output=True,
                          text=True, check=True).stdout for _ in range(2)]
    assert got[0] == got[1] and "0x7" not in got[0] and "negative_slope" in got[0]
