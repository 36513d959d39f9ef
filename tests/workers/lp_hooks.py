"""MPI worker: module hooks on the net a LayerParallel model trains, against serial.

Run: mpiexec -n P python -m mpi4py tests/workers/lp_hooks.py OUT.json
(also importable: `run_all(None)` for one rank in-process).  Rank 0 writes
{case: [rank 0's result, rank 1's, ...]}; a result is {"error": text} where the case
raised, else what it measured.

- hooks a layer-parallel pass cannot run as serial training does (a residual block's
  forward, pre- and backward hooks, one on a block's submodule, one registered on
  one rank only, a segment's and the ODENet's, a global module hook, the old
  `torch.nn.utils.weight_norm`'s; under MGRIT and under ``options="auto"``): refused
  by name on every rank before any pass runs;
- a plain layer's forward hook (modifying its output): the output and gradients
  equal serial's, the hook running once per pass on the layer's owner;
- on one rank with sequential options (direct passes), a block's hook: serial's
  output, gradients and number of calls.
"""
from __future__ import annotations

import copy
import sys
import warnings
from typing import Any, Callable, Optional

import torch
from torch import nn

import layerpar
from layerpar.mgrit import MGRITOptions
from layerpar.ode import blocks

CONVERGED = MGRITOptions(max_levels=2, cfactor=2, tol=0.0, max_iter=8)
SEQUENTIAL = MGRITOptions(max_levels=1)
N_STEPS = 8


def _rank(comm: Any) -> int:
    return 0 if comm is None else comm.Get_rank()


def _net() -> layerpar.ODENet:
    torch.manual_seed(0)
    return layerpar.ODENet(open=nn.Linear(3, 4),
                           steps=lambda k: blocks.Dense(4, activation="tanh"),
                           n_steps=N_STEPS, close=nn.Linear(4, 5)).double()


class _Counter:
    """A forward hook halving its module's output, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return 0.5 * out


def _compare(comm: Any, options: Any, hook_on: Callable[[layerpar.ODENet], nn.Module]
             ) -> dict[str, Any]:
    """Serial and LayerParallel, each with a `_Counter` on `hook_on(net)`: one forward
    and backward; output and gradient errors, and the calls per pass on each."""
    serial = _net()
    net = copy.deepcopy(serial)
    hooks = [_Counter(), _Counter()]
    for h, n in zip(hooks, (serial, net)):
        hook_on(n).register_forward_hook(h)
    model = layerpar.LayerParallel(net, comm, options)
    x = torch.randn(6, 3, dtype=torch.float64)
    out: dict[str, Any] = {}
    try:
        zs = [m(x) for m in (serial, model)]
        for z in zs:
            z.square().sum().backward()
        out["output"] = float((zs[1] - zs[0]).detach().abs().max())
        ref = dict(serial.named_parameters())
        out["grads"] = max(float((p.grad - ref[n].grad).abs().max())
                           for n, p in model.named_parameters())
        out["calls"] = [h.calls for h in hooks]
    except Exception as exc:  # noqa: BLE001 - reported for the test to read
        out["error"] = f"{type(exc).__name__}: {exc}"
    model.close()
    return out


def _refused(comm: Any, options: Any, hook: Callable[[layerpar.ODENet], Any],
             only_rank: Optional[int] = None, after: int = 0) -> dict[str, Any]:
    """A model whose net `hook(net)` hooked (on rank `only_rank` alone where given;
    after `after` training batches past the input checks), run on a batch:
    {"error": what it raised} or {"ran": True}."""
    net = _net()
    mine = only_rank is None or _rank(comm) == only_rank
    handle = hook(net) if mine and not after else None
    model = layerpar.LayerParallel(net, comm, options, check_inputs=1)
    x = torch.randn(6, 3, dtype=torch.float64)
    out: dict[str, Any] = {}
    try:
        for _ in range(after):
            model(x).sum().backward()
        if after and mine:
            handle = hook(net)
        model(x).sum().backward()
        out["ran"] = True
    except Exception as exc:  # noqa: BLE001 - reported for the test to read
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if handle is not None:
            handle.remove()
    model.close()
    return out


def _noop(*args: Any) -> None:
    return None


def _old_weight_norm(net: layerpar.ODENet) -> None:
    """Layer 1's block replaced by one under the deprecated `torch.nn.utils.weight_norm`,
    which computes the weight in a forward pre-hook."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        linear = torch.nn.utils.weight_norm(nn.Linear(4, 4).double())
    net.layers[1].blocks[1] = nn.Sequential(linear, nn.Tanh())


def run_all(comm: Any) -> dict[str, Any]:
    """Every case on this rank, by name."""
    last = N_STEPS - 1
    module = torch.nn.modules.module
    cases: dict[str, Callable[[], dict[str, Any]]] = {
        "block forward hook": lambda: _refused(
            comm, CONVERGED, lambda n: n.layers[1].blocks[0].register_forward_hook(_noop)),
        "block pre-hook": lambda: _refused(
            comm, CONVERGED, lambda n: n.layers[1].blocks[2].register_forward_pre_hook(_noop)),
        "block backward hook": lambda: _refused(
            comm, CONVERGED,
            lambda n: n.layers[1].blocks[3].register_full_backward_hook(_noop)),
        "submodule hook": lambda: _refused(
            comm, CONVERGED,
            lambda n: n.layers[1].blocks[last].linear.register_forward_hook(_noop)),
        "hook on the last rank only": lambda: _refused(
            comm, CONVERGED, lambda n: n.layers[1].blocks[last].register_forward_hook(_noop),
            only_rank=0 if comm is None else comm.Get_size() - 1),
        "segment hook": lambda: _refused(
            comm, SEQUENTIAL, lambda n: n.layers[1].register_forward_hook(_noop)),
        "ODENet hook": lambda: _refused(
            comm, SEQUENTIAL, lambda n: n.register_forward_pre_hook(_noop)),
        "global hook": lambda: _refused(
            comm, CONVERGED, lambda n: module.register_module_forward_hook(_noop)),
        "block hook, auto": lambda: _refused(
            comm, "auto", lambda n: n.layers[1].blocks[0].register_forward_hook(_noop)),
        "old weight norm": lambda: _refused(comm, CONVERGED, _old_weight_norm),
        "block hook mid-training": lambda: _refused(
            comm, CONVERGED, lambda n: n.layers[1].blocks[0].register_forward_hook(_noop),
            after=3),
        "block hook mid-training, last rank only": lambda: _refused(
            comm, CONVERGED, lambda n: n.layers[1].blocks[last].register_forward_hook(_noop),
            only_rank=0 if comm is None else comm.Get_size() - 1, after=3),
        "plain layer hook": lambda: _compare(comm, CONVERGED, lambda n: n.layers[0]),
    }
    if comm is None or comm.Get_size() == 1:
        cases["block hook, sequential"] = lambda: _compare(
            comm, SEQUENTIAL, lambda n: n.layers[1].blocks[1])
    return {name: case() for name, case in cases.items()}


if __name__ == "__main__":
    from by_case import write_by_case
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    results = run_all(world)
    write_by_case(world, results, sys.argv[1])
