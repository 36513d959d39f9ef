"""MPI worker: loss scaling with a model whose layers lie on several ranks.

Run: mpiexec -n P python -m mpi4py tests/workers/lp_scaler.py OUT.json
(also importable: `run_all(None)` for one rank in-process).  Rank 0 writes
{case: [rank 0's result, rank 1's, ...]}.

- "agreeing": `layerpar.parallel.GradScaler` against torch's scaler on the serial net,
  four steps with an overflow planted in the last layer's gradient at the second: the
  parameters' largest difference from serial's, every step's scale, and whether the
  second step was skipped;
- "torch's": the same with torch's own scaler on each rank: the step is skipped on the
  overflowing rank alone, and the scales part (found by the loss gradient's check
  between the ranks in the first batches; a silent difference after them);
- "warning": what a float16-autocast training pass warns, without and with the
  agreeing scaler built for the model.
"""
from __future__ import annotations

import copy
import sys
import warnings
from typing import Any, Callable

import torch
from torch import nn

import layerpar
from layerpar.mgrit import MGRITOptions
from layerpar.ode import blocks
from layerpar.parallel import GradScaler

CONVERGED = MGRITOptions(max_levels=2, cfactor=2, tol=0.0, max_iter=8)
N_STEPS = 8
#: the parameter whose gradient overflows at the second step: the last layer's, held
#: by the last rank
PLANTED = f"layers.1.blocks.{N_STEPS - 1}.linear.weight"
SCALER = {"init_scale": 2.0 ** 12, "growth_interval": 2}


def _net(dtype: torch.dtype = torch.float64) -> layerpar.ODENet:
    torch.manual_seed(0)
    return layerpar.ODENet(open=nn.Linear(3, 4),
                           steps=lambda k: blocks.Dense(4, activation="tanh"),
                           n_steps=N_STEPS, close=nn.Linear(4, 5)).to(dtype)


def _train(module: nn.Module, named: Callable[[], Any], scaler: torch.amp.GradScaler
           ) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """Four SGD steps under `scaler`, the gradient of `PLANTED` made inf at the second
    (where this rank holds it): the scales after each step, and the parameters
    (`named()`) after each."""
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    scales, states = [], []
    for step in range(4):
        x = torch.randn(6, 3, generator=gen, dtype=torch.float64)
        opt.zero_grad()
        scaler.scale(module(x).square().mean()).backward()
        if step == 1:
            for name, p in module.named_parameters():
                if name == PLANTED:
                    p.grad.view(-1)[0] = float("inf")
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        states.append({k: v.detach().clone() for k, v in named().items()})
    return scales, states


def _against_serial(comm: Any, make: Callable[[nn.Module], torch.amp.GradScaler]
                    ) -> dict[str, Any]:
    net = _net()
    serial = copy.deepcopy(net)
    s_scales, s_states = _train(serial, serial.state_dict,
                                torch.amp.GradScaler("cpu", **SCALER))
    model = layerpar.LayerParallel(net, comm, CONVERGED)
    try:
        scales, states = _train(model, model.gather_state_dict, make(model))
    except Exception as exc:  # noqa: BLE001 - reported for the test to read
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        model.close()
    diff = max(float((states[-1][k] - s_states[-1][k]).abs().max()) for k in s_states[-1])
    skipped = all(torch.equal(states[1][k], states[0][k]) for k in states[0])
    return {"scales": scales, "serial_scales": s_scales, "diff": diff, "skipped": skipped}


def _warning(comm: Any, agreeing: bool) -> list[str]:
    """The warnings two float16-autocast training passes give."""
    net = _net(torch.float32)
    model = layerpar.LayerParallel(net, comm, CONVERGED)
    if agreeing:
        GradScaler(model, "cpu")
    x = torch.randn(6, 3)
    try:
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            for _ in range(2):
                with torch.autocast("cpu", dtype=torch.float16):
                    out = model(x)
                out.float().sum().backward()
    finally:
        model.close()
    return [str(w.message) for w in got if "GradScaler" in str(w.message)]


def run_all(comm: Any) -> dict[str, Any]:
    """Every case on this rank, by name."""
    return {
        "agreeing": _against_serial(comm, lambda m: GradScaler(m, "cpu", **SCALER)),
        "torch's": _against_serial(comm, lambda m: torch.amp.GradScaler("cpu", **SCALER)),
        "warning": _warning(comm, False),
        "no warning": _warning(comm, True),
    }


if __name__ == "__main__":
    from by_case import write_by_case
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    results = run_all(world)
    write_by_case(world, results, sys.argv[1])
