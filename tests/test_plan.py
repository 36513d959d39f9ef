"""`Plan`: the placement a LayerParallel runs, as printable data built without MPI and
built once per model; its ghosts checked against the coarse steps each rank runs."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import layerpar
from layerpar.mgrit.grid import Partition, reversed_bounds
from layerpar.ode import blocks
from layerpar.ode.net import Segment
from layerpar.parallel.ghosts import Ghosts
from layerpar.parallel.plan import Plan, SegmentPlan


def _net(n: int = 32) -> layerpar.ODENet:
    torch.manual_seed(0)
    return layerpar.ODENet(open=torch.nn.Linear(2, 4),
                           steps=lambda k: layerpar.ode.blocks.Dense(4), n_steps=n,
                           t_final=5.0, close=torch.nn.Linear(4, 5))


def _coarse_blocks(n: int, ranks: int, q: int, fwd: layerpar.MGRITOptions,
                   bwd: layerpar.MGRITOptions, coarsening: str) -> set[int]:
    """The blocks rank q's coarse steps evaluate, found by walking the fine points the
    rank owns (an independent reading of the grid): on level l (stride s) a forward
    coarse step ends at each owned fine point i = j*s, j >= 1, and steps layers i-s..i-1;
    the adjoint's ends at each reverse point owned by engine rank P-1-q, m*s, and steps
    the forward layers n-m*s..n-m*s+s-1.  Injection uses only the first of them."""
    fpart = Partition.build(n, ranks, fwd)
    rbounds = reversed_bounds(list(fpart.bounds))
    rpart = Partition(n, ranks, tuple(rbounds), Partition.build(n, ranks, bwd).levels)
    got: set[int] = set()
    for part, mine, first in ((fpart, q, lambda i, s: i - s),
                              (rpart, ranks - 1 - q, lambda i, s: n - i)):
        for lv in part.levels[1:]:
            s = lv.stride
            for i in part.points(mine):
                if i >= s and i % s == 0 and i // s <= lv.n_intervals:
                    a = first(i, s)
                    got.update([a] if coarsening == "injection" else range(a, a + s))
    return got


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("coarsening", ["injection", "average"])
@pytest.mark.parametrize("n,cf", [(32, 4), (13, 2), (29, 3)])
def test_plan_matches_what_the_ranks_compute(ranks: int, coarsening: str, n: int,
                                             cf: int) -> None:
    fwd = layerpar.MGRITOptions(max_levels=3, cfactor=cf, max_iter=2)
    bwd = layerpar.MGRITOptions(max_levels=2, cfactor=cf, max_iter=1)
    net = _net(n)
    plan = Plan.build(net, ranks, fwd, bwd, coarsening)
    (sp,) = plan.segments
    assert isinstance(plan.items[0], tuple) and plan.items[0][2] == 0
    assert plan.items[-1][2] == ranks - 1  # type: ignore[index]
    assert plan.kinds == (("plain", 0), ("segment", 0), ("plain", ranks - 1))
    seg = net.layers[1]
    part = Partition.build(n, ranks, fwd)
    assert sp.forward == part and len(sp.adjoint_levels) == 2
    assert list(sp.adjoint.bounds) == reversed_bounds(list(part.bounds))
    covered = []
    for q in range(ranks):
        covered += list(sp.layers(q))
        need = _coarse_blocks(n, ranks, q, fwd, bwd, coarsening)
        assert [k for k, _ in sp.ghosts[q]] == sorted(need - set(part.steps(q)))
        assert all(k in sp.layers(o) for k, o in sp.ghosts[q])
        g = Ghosts(seg, sp, q)  # what the runner keeps
        assert g.layers == [k for k, _ in sp.ghosts[q]] and set(g.blocks) == set(g.layers)
        assert g.sends == [(k, o, r) for r in range(ranks) for k, o in sp.ghosts[r]]
    assert covered == list(range(n))  # every layer on exactly one rank, in order
    assert [(k, b, q) for k, b, q in plan.placements() if b is not None] == \
        [(1, b, q) for q in range(ranks) for b in sp.layers(q)]
    for lv in part.levels:  # a boundary state goes to the next rank owning points
        for a, b, j in sp.boundary_sends(lv.index):
            assert a < b and j == part.level_range(lv.index, a).stop - 1
            assert all(not len(part.level_range(lv.index, r)) for r in range(a + 1, b))


def _two_segments() -> layerpar.ODENet:
    torch.manual_seed(1)
    return layerpar.ODENet(layers=[nn.Linear(3, 4), Segment(lambda k: blocks.Dense(4), 16),
                                   nn.Tanh(), Segment(lambda k: blocks.Dense(4), 12),
                                   nn.Linear(4, 5)]).double()


def test_the_model_builds_its_plan_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model builds its placement once: one partition per segment, whatever the rank
    count (runners and ghosts read the plan's; earlier, every runner partitioned again
    1 + 2(P+1) times and every read of `model.plan` rebuilt it all)."""
    calls = []
    build = Partition.build.__func__  # type: ignore[attr-defined]

    def counted(cls: type, *args: object, **kwargs: object) -> Partition:
        calls.append(args)
        return build(cls, *args, **kwargs)

    monkeypatch.setattr(Partition, "build", classmethod(counted))
    opts = layerpar.MGRITOptions(max_levels=3, cfactor=2, max_iter=2)
    assert len(Plan.build(_two_segments(), 4, opts).segments) == 2
    assert len(calls) == 2  # one per segment, at 4 ranks as at 1
    calls.clear()
    model = layerpar.LayerParallel(_two_segments(), None, opts)
    assert len(calls) == 2
    assert model.plan is model.plan and len(calls) == 2
    assert [r.plan for r in model.runners] == model.plan.segments
    assert model.layer_kinds == [("plain", 0), ("segment", 0), ("plain", 0),
                                 ("segment", 1), ("plain", 0)]


def test_model_plan_prints_a_readable_table() -> None:
    opts = layerpar.MGRITOptions(max_levels=3, cfactor=4, max_iter=2)
    model = layerpar.LayerParallel(_net(), None, opts)
    assert isinstance(model.plan.segments[0], SegmentPlan)
    text = str(Plan.build(_net(), 4, opts))
    assert "segment 0 (net.layers[1]): 32 residual layers on [0, 5], forward 3 level(s)" \
        in text
    assert "  1     8-15    9-16         3-4          1            0 (from 0)" in text
    assert "level 0 forward sends: 0->1 (u at point 8), 1->2 (u at point 16)" in text
    assert text.endswith("output: broadcast from rank 3 to every rank")
