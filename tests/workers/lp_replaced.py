"""MPI worker: modules and parameters assigned anew after a LayerParallel was built.

Run: mpiexec -n P python -m mpi4py tests/workers/lp_replaced.py OUT.json
(also importable: `run_all(None)` for one rank in-process).  Rank 0 writes
{case: [rank 0's result, rank 1's, ...]}; a result is {"error": text} where the case
raised, else {"diff": the output's largest difference from serial's}.

- refused by name on every rank: a block's parameter, a block's submodule, a block
  in the ODENet's list, a plain layer's parameter replaced (after a pass, or after the
  input checks' batches), one replaced on the last rank only, a parametrization
  registered on a block's weight;
- run as serial: values set in place (``copy_``, ``.data``), and modules built
  elsewhere in the process between passes (the registration count moves, the
  model's objects do not);
- the net's own (serial) forward after a training pass: refused at 2+ ranks (its
  copies of the other ranks' layers are stale once a step follows; also with
  `FlatAdam`, which bumps no version counter), equal to the model's at one rank and
  after the gathered state was loaded into it.
"""
from __future__ import annotations

import copy
import io
import sys
from typing import Any, Callable

import torch
import torch.nn.utils.parametrize as parametrize
from torch import nn

import layerpar
from layerpar.mgrit import MGRITOptions
from layerpar.ode import blocks
from layerpar.parallel import FlatAdam

CONVERGED = MGRITOptions(max_levels=2, cfactor=2, tol=0.0, max_iter=8)
N_STEPS = 8
#: the batches run before the change where a case says "after the checks"
CHECKED = 3


def _net() -> layerpar.ODENet:
    torch.manual_seed(0)
    return layerpar.ODENet(open=nn.Linear(3, 4),
                           steps=lambda k: blocks.Dense(4, activation="tanh"),
                           n_steps=N_STEPS, close=nn.Linear(4, 5)).double()


class _Half(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return 0.5 * w


def _new_weight(net: nn.Module, name: str) -> None:
    """`name`'s parameter replaced by a new one of half its values."""
    owner, _, attr = name.rpartition(".")
    mod = net.get_submodule(owner)
    setattr(mod, attr, nn.Parameter(getattr(mod, attr).detach() * 0.5))


def _block(net: layerpar.ODENet, n: int) -> None:
    torch.manual_seed(9)
    net.layers[1].blocks[n] = blocks.Dense(4, activation="tanh").double()


def _linear(net: layerpar.ODENet, n: int) -> None:
    torch.manual_seed(9)
    net.layers[1].blocks[n].linear = nn.Linear(4, 4).double()


def _halved(net: layerpar.ODENet) -> None:
    parametrize.register_parametrization(net.layers[1].blocks[2].linear, "weight", _Half())


def _in_place(net: layerpar.ODENet) -> None:
    with torch.no_grad():
        for i, p in enumerate(net.parameters()):
            if i % 2:
                p.mul_(0.5)
            else:
                p.data = p.data * 0.25


def _elsewhere(net: layerpar.ODENet) -> None:
    _ = nn.Sequential(nn.Linear(2, 2), nn.Tanh())  # (registrations in the process)


def _case(comm: Any, change: Callable[[layerpar.ODENet], None], after: int = 1,
          only_last: bool = False) -> dict[str, Any]:
    """`change` made to the model's net (on the last rank only where `only_last`)
    after `after` training batches, then one more pass: its output against the serial
    net's under the same change, or the error it raised."""
    net = _net()
    serial = copy.deepcopy(net)
    model = layerpar.LayerParallel(net, comm, CONVERGED, check_inputs=1)
    x = torch.randn(6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    size = 1 if comm is None else comm.Get_size()
    rank = 0 if comm is None else comm.Get_rank()
    out: dict[str, Any] = {}
    try:
        for _ in range(after):
            model(x).sum().backward()
        if not only_last or rank == size - 1:
            change(net)
        change(serial)
        out["diff"] = float((model(x) - serial(x)).detach().abs().max())
    except Exception as exc:  # noqa: BLE001 - reported for the test to read
        out["error"] = f"{type(exc).__name__}: {exc}"
    model.close()
    return out


def _initialised(comm: Any) -> dict[str, Any]:
    """``model.apply(init)`` with an initialisation drawing random numbers, against
    ``serial.apply(init)`` from the same seed: the output, this rank's parameters and
    the global generator after it (each rank drew for its own layers alone, from where
    the net's first layer starts)."""
    net = _net()
    serial = copy.deepcopy(net)
    model = layerpar.LayerParallel(net, comm, CONVERGED)

    def init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.xavier_uniform_(m.weight)
            nn.init.normal_(m.bias)

    after = []
    for m in (model, serial):
        torch.manual_seed(5)
        m.apply(init)
        after.append(torch.get_rng_state())
    x = torch.randn(6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    ref = dict(serial.named_parameters())
    with torch.no_grad():
        out = {"diff": float((model(x) - serial(x)).abs().max()),
               "params": max(float((p - ref[n]).abs().max())
                             for n, p in model.named_parameters()),
               "generator as serial's": bool(torch.equal(*after))}
    model.close()
    return out


def _against_serial(model: layerpar.LayerParallel, serial: nn.Module,
                    run: Callable[[], None]) -> dict[str, Any]:
    """`run()`, then this rank's parameters against serial's (their largest difference),
    or the error it raised; the model closed."""
    out: dict[str, Any] = {}
    try:
        run()
        ref = dict(serial.named_parameters())
        out["params"] = max(float((p - ref[n]).abs().max())
                            for n, p in model.named_parameters())
    except Exception as exc:  # noqa: BLE001 - reported for the test to read
        out["error"] = f"{type(exc).__name__}: {exc}"
    model.close()
    return out


def _optimizer_state(comm: Any, gathered: bool) -> dict[str, Any]:
    """Two Adam steps, the optimizer's state saved and loaded into a new Adam on every
    rank, one more step and a pass: rank 0's ``optimizer.state_dict()`` (the
    DistributedDataParallel habit; each rank's optimizer holds its own layers), or,
    where `gathered`, ``model.gather_optimizer_state``.  What the last step and pass
    raised, and the parameters against serial's (the same steps, its own state).  The
    net is blocks alone, four a rank at most: every rank's parameters have the same
    shapes, so torch's `load_state_dict` takes another rank's state without a word."""
    torch.manual_seed(0)
    net = layerpar.ODENet(layers=[layerpar.ode.Segment(
        lambda k: blocks.Dense(4, activation="tanh"), N_STEPS, 1.0)]).double()
    serial = copy.deepcopy(net)
    model = layerpar.LayerParallel(net, comm, CONVERGED)
    x = torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    y = torch.randint(0, 4, (6,), generator=torch.Generator().manual_seed(4))

    def steps(opts: list[torch.optim.Optimizer]) -> None:
        for m, opt in zip((model, serial), opts):
            opt.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
            opt.step()

    def run() -> None:
        opts = [torch.optim.Adam(m.parameters(), lr=0.01) for m in (model, serial)]
        steps(opts)
        steps(opts)
        if gathered:
            state = model.gather_optimizer_state(opts[0])
        else:
            state = opts[0].state_dict() if comm is None else \
                comm.bcast(opts[0].state_dict() if comm.Get_rank() == 0 else None, root=0)
        again = [torch.optim.Adam(m.parameters(), lr=0.01) for m in (model, serial)]
        if gathered:
            model.load_optimizer_state(again[0], state)
        else:
            again[0].load_state_dict(state)
        again[1].load_state_dict(opts[1].state_dict())
        steps(again)
        model(x)  # (a rank that refused its step tells the others)

    return _against_serial(model, serial, run)


def _functional_call(comm: Any) -> dict[str, Any]:
    """``torch.func.functional_call(model, params, (x,))`` with this rank's parameters
    doubled: what it raised (the swapped-in tensors would get no gradient)."""
    from torch.func import functional_call

    model = layerpar.LayerParallel(_net(), comm, CONVERGED)
    x = torch.randn(6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    params = {n: (2 * p.detach()).requires_grad_() for n, p in model.named_parameters()}
    out: dict[str, Any] = {}
    try:
        functional_call(model, params, (x,)).sum().backward()
        out["grads"] = sum(p.grad is not None for p in params.values())
    except Exception as exc:  # noqa: BLE001 - reported for the test to read
        out["error"] = f"{type(exc).__name__}: {exc}"
    model.close()
    return out


def _lbfgs(comm: Any) -> dict[str, Any]:
    """Two LBFGS steps (a closure): the parameters against serial's, or the error."""
    net = _net()
    serial = copy.deepcopy(net)
    model = layerpar.LayerParallel(net, comm, CONVERGED)
    x = torch.randn(6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    y = torch.randint(0, 5, (6,), generator=torch.Generator().manual_seed(4))

    def run() -> None:
        for m in (model, serial):
            opt = torch.optim.LBFGS(m.parameters(), lr=0.5, max_iter=5)

            def closure(m: nn.Module = m, opt: torch.optim.Optimizer = opt) -> torch.Tensor:
                opt.zero_grad()
                loss = nn.functional.cross_entropy(m(x), y)
                loss.backward()
                return loss

            for _ in range(2):
                opt.step(closure)

    return _against_serial(model, serial, run)


def _serial_after(comm: Any, step: bool, load: bool, options: Any = CONVERGED,
                  batches: int = 1, flat: bool = False) -> dict[str, Any]:
    """The net's own forward after `batches` training batches (each with an optimizer
    step where `step`; the gathered state loaded into the net where `load`): against
    the model's output, or the error it raised; the load hooks on the net, and what
    its `state_dict()` did.
    `flat`: `FlatAdam`, which steps the parameters without bumping their versions."""
    net = _net()
    model = layerpar.LayerParallel(net, comm, options)
    opt: torch.optim.Optimizer = FlatAdam(model.parameters(), lr=0.01) if flat else \
        torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    y = torch.randint(0, 5, (6,), generator=torch.Generator().manual_seed(4))
    out: dict[str, Any] = {}
    try:
        for k in range(batches):
            opt.zero_grad()
            if options == "auto" and k == 0:  # (its tuning builds models on the net)
                model.tune(x, y, torch.nn.functional.cross_entropy)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            if step:
                opt.step()
        out["load_hooks"] = len(net._load_state_dict_post_hooks)
        if load:
            net.load_state_dict(model.gather_state_dict())
        for what, save in (("state_dict", net.state_dict),  # (checkpoints and copies
                           ("pickle", lambda: torch.save(net, io.BytesIO())),  # of the net:
                           ("deepcopy", lambda: copy.deepcopy(net))):  # refused alike)
            try:
                save()
                out[what] = "ran"
            except RuntimeError as exc:
                out[what] = str(exc)
        with torch.no_grad():
            out["diff"] = float((net(x) - model(x)).abs().max())
    except Exception as exc:  # noqa: BLE001 - reported for the test to read
        out["error"] = f"{type(exc).__name__}: {exc}"
    model.close()
    return out


def run_all(comm: Any) -> dict[str, Any]:
    """Every case on this rank, by name."""
    last = N_STEPS - 1
    return {
        "block parameter": _case(
            comm, lambda n: _new_weight(n, "layers.1.blocks.0.linear.weight")),
        "block submodule": _case(comm, lambda n: _linear(n, last)),
        "block in the net's list": _case(comm, lambda n: _block(n, 3)),
        "plain layer parameter, after the checks": _case(
            comm, lambda n: _new_weight(n, "layers.2.weight"), after=CHECKED),
        "last rank only": _case(
            comm, lambda n: _new_weight(n, f"layers.1.blocks.{last}.linear.bias"),
            only_last=True),
        "parametrization": _case(comm, _halved),
        "values in place": _case(comm, _in_place),
        "modules built elsewhere": _case(comm, _elsewhere, after=CHECKED),
        "initialised by model.apply": _initialised(comm),
        "optimizer state of rank 0": _optimizer_state(comm, gathered=False),
        "optimizer state gathered": _optimizer_state(comm, gathered=True),
        "LBFGS": _lbfgs(comm),
        "torch.func.functional_call": _functional_call(comm),
        "net's forward, trained": _serial_after(comm, step=True, load=False),
        "net's forward, no step": _serial_after(comm, step=False, load=False),
        "net's forward, loaded": _serial_after(comm, step=True, load=True),
        "net's forward, FlatAdam": _serial_after(comm, step=True, load=False, flat=True),
        "net's forward, auto": _serial_after(comm, step=True, load=False, options="auto",
                                             batches=3),
    }


if __name__ == "__main__":
    from by_case import write_by_case
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    results = run_all(world)
    write_by_case(world, results, sys.argv[1])
