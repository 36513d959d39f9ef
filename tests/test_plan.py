"""`Plan`: the placement a LayerParallel runs, as printable data built without MPI,
checked against what the runners and ghosts compute for every rank."""
from __future__ import annotations

import pytest
import torch

import layerpar
from layerpar.mgrit.grid import Partition
from layerpar.parallel.ghosts import Ghosts, needed_layers
from layerpar.parallel.plan import Plan, SegmentPlan


def _net(n: int = 32) -> layerpar.ODENet:
    torch.manual_seed(0)
    return layerpar.ODENet(open=torch.nn.Linear(2, 4),
                           steps=lambda k: layerpar.ode.blocks.Dense(4), n_steps=n,
                           t_final=5.0, close=torch.nn.Linear(4, 5))


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
    seg = net.layers[1]
    part = Partition.build(n, ranks, fwd)
    assert sp.forward == part and len(sp.adjoint_levels) == 2
    covered = []
    for q in range(ranks):
        covered += list(sp.layers(q))
        g = Ghosts(seg, part, q, lambda r: needed_layers(n, ranks, r, fwd, bwd, coarsening))
        assert [k for k, _ in sp.ghosts[q]] == g.layers
        assert all(o == g.plan_owner(k) for k, o in sp.ghosts[q])
    assert covered == list(range(n))  # every layer on exactly one rank, in order
    for lv in part.levels:  # a boundary state goes to the next rank owning points
        for a, b, j in sp.boundary_sends(lv.index):
            assert a < b and j == part.level_range(lv.index, a).stop - 1
            assert all(not len(part.level_range(lv.index, r)) for r in range(a + 1, b))


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
