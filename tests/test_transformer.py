"""Pre-norm transformer blocks (`layerpar.ode.blocks.Transformer`) in layer-parallel
training: the batched evaluation (its own `forward_batched`, and vmap over the block)
equals the per-step one, and SGD under LayerParallel at 1 and 2 ranks equals serial
training of the same ODENet (float64, converged MGRIT)."""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from tolerances import F64
from torch.func import functional_call, vmap

import layerpar
from layerpar import MGRITOptions
from layerpar.ode import blocks
from layerpar.ode.schemes import ForwardEuler
from layerpar.parallel.batched import BatchedBlocks

WORKERS = Path(__file__).parent / "workers"
D, HEADS, SEQ = 8, 2, 5


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / max(float(b.norm()), 1e-300))


def transformer_net(n: int = 8) -> layerpar.ODENet:
    return layerpar.ODENet(open=torch.nn.Linear(3, D),
                           steps=lambda k: blocks.Transformer(D, HEADS), n_steps=n,
                           t_final=1.0,
                           close=torch.nn.Sequential(torch.nn.Flatten(),
                                                     torch.nn.Linear(SEQ * D, 4)))


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # vmap of CPU attention
@pytest.mark.parametrize("causal", [False, True])
def test_batched_and_vmapped_equal_per_step(causal: bool) -> None:
    torch.manual_seed(0)
    bl = {k: blocks.Transformer(D, HEADS, causal=causal).double() for k in range(3)}
    bb = BatchedBlocks(bl, ForwardEuler(), [0.0, 0.3, 0.5, 0.9])
    assert bb.probe(torch.zeros(2, SEQ, D, dtype=torch.float64)) is None
    x = torch.randn(3, 2, SEQ, D, dtype=torch.float64)
    pairs = ((0, 1), (1, 2), (2, 3))
    want = torch.stack([x[k] + (bb.times[b] - bb.times[a]) * bl[a](x[k])
                        for k, (a, b) in enumerate(pairs)])
    assert rel(bb.step(x, pairs), want) <= F64.exact
    p, b = bb.stacked((0, 1, 2))
    proto = bl[0]
    vm = vmap(lambda p_, b_, v: functional_call(proto, (p_, b_), (v,)))(p, b, x)
    assert rel(vm, torch.stack([bl[k](x[k]) for k in range(3)])) <= F64.exact


def test_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="heads"):
        blocks.Transformer(10, heads=4)
    with pytest.raises(TypeError, match="d_model"):
        blocks.Transformer(8.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="activation"):
        blocks.Transformer(8, activation="swish")


def compare(comm: Optional[Any] = None, steps: int = 3) -> dict[str, Any]:
    """Train the serial net and LayerParallel (on `comm`) for `steps` SGD steps; the
    largest relative difference of losses and of this rank's parameters."""
    torch.manual_seed(0)
    net = transformer_net().double()
    x = torch.randn(4, SEQ, 3, dtype=torch.float64)
    y = torch.randint(0, 4, (4,))
    opts = MGRITOptions(max_levels=2, cfactor=2, max_iter=30, tol=1e-13)
    ref = copy.deepcopy(net)
    lp = layerpar.LayerParallel(copy.deepcopy(net), comm, opts, opts, batched=True)
    out = {"diff": 0.0, "losses": [],
           "batched": all(r.vectorised is not None for r in lp._runners.values())}
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt_l = torch.optim.SGD(lp.parameters(), lr=0.1)
    for _ in range(steps):
        losses = []
        for m, o in ((ref, opt_r), (lp, opt_l)):
            o.zero_grad()
            loss = torch.nn.functional.cross_entropy(m(x), y)
            loss.backward()
            o.step()
            losses.append(float(loss))
        out["losses"].append(losses)
        out["diff"] = max(out["diff"], abs(losses[1] - losses[0]) / abs(losses[0]))
    refp = dict(ref.named_parameters())
    for name, p in lp.named_parameters():
        out["diff"] = max(out["diff"], rel(p.detach(), refp[name].detach()))
    lp.close()
    return out


def test_trains_like_serial_on_one_rank() -> None:
    res = compare()
    assert res["batched"]
    assert res["diff"] <= F64.converged, res
    assert res["losses"][-1][0] < res["losses"][0][0]  # it trains


@pytest.mark.mpi
def test_trains_like_serial_on_two_ranks(tmp_path: Path) -> None:
    from mpi_util import run_mpi

    out = tmp_path / "out.json"
    proc = run_mpi(WORKERS / "lp_transformer.py", 2, str(out), timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["batched"] and res["diff"] <= F64.converged, res
