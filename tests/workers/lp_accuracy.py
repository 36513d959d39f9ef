"""MPI worker: `LayerParallel.check_gradients` against errors computed independently.

Run: mpiexec -n P python -m mpi4py tests/workers/lp_accuracy.py OUT.json
`tests/test_accuracy.py` also imports this file and calls `run_cases(None)` on one
process, so the 1-rank and P-rank checks are the same code.

Per case, the reference numbers come without `check_gradients`: the serial `ODENet`
(plain autograd: exact) and a second `LayerParallel` with the same options trained
the ordinary way (`.backward()`, gradients read from `.grad`), their squared norms
summed over the ranks with `comm.allreduce`.  Each rank also checks that the check
left `.grad`, the random generator, batch-norm buffers and the training mode alone,
and that every rank got the same `GradientCheck`.  Rank 0 writes {case: result} to
OUT.json; a failed assertion on any rank aborts the job (``python -m mpi4py``).
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch.nn import functional as F

import layerpar
from layerpar.ode import Segment, blocks
from layerpar.parallel.accuracy import check_gradients, exact_reference

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: tolerances
from tolerances import SOLVER_TOL  # noqa: E402

SEED_FORWARD = 123  # global generator state before each pass: the same dropout masks


def _sum(comm: Any, values: list[float]) -> list[float]:
    """Sums over the ranks (elementwise)."""
    if comm is None:
        return values
    from mpi4py import MPI

    return [float(v) for v in comm.allreduce(np.asarray(values, dtype=np.float64),
                                             op=MPI.SUM)]


def dense_net(n: int, width: int = 4, T: float = 2.0) -> layerpar.ODENet:
    return layerpar.ODENet(open=torch.nn.Linear(3, width),
                           steps=lambda k: blocks.Dense(width, activation="tanh"),
                           n_steps=n, t_final=T, close=torch.nn.Linear(width, 5))


def conv_net(n1: int, n2: int) -> layerpar.ODENet:
    return layerpar.ODENet(layers=[
        torch.nn.Conv2d(1, 3, 3, padding=1),
        Segment(lambda k: blocks.Conv(3, activation="tanh"), n1, 1.0),
        torch.nn.Conv2d(3, 4, 3, stride=2, padding=1),
        Segment(lambda k: blocks.Conv(4, activation="tanh"), n2, 1.5),
        torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 5)])


def dropout_bn_net() -> layerpar.ODENet:
    return layerpar.ODENet(layers=[
        torch.nn.Conv2d(1, 3, 3, padding=1),
        Segment(lambda k: torch.nn.Sequential(
            blocks.Conv(3, activation="tanh", batch_norm=True), torch.nn.Dropout(0.2)),
            9, 1.0),
        torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 5)])


def _opts(levels: int, cf: int, iters: int, tol: float = 0.0) -> layerpar.MGRITOptions:
    return layerpar.MGRITOptions(max_levels=levels, cfactor=cf, max_iter=iters, tol=tol)


EXACT = _opts(1, 2, 1)
CONVERGED = _opts(3, 2, 60, SOLVER_TOL)
INEXACT = _opts(3, 4, 1)

# name -> (net factory, input shape, forward options, backward options)
CASES: dict[str, tuple[Callable[[], layerpar.ODENet], tuple[int, ...], Any, Any]] = {
    "dense exact L1": (lambda: dense_net(12), (6, 3), EXACT, EXACT),
    "dense converged L3": (lambda: dense_net(12), (6, 3), CONVERGED, CONVERGED),
    "dense inexact L3 cf4 1/1": (lambda: dense_net(32, width=8, T=5.0), (16, 3), INEXACT,
                                 INEXACT),
    "dense inexact L3 cf4 2/1": (lambda: dense_net(32, width=8, T=5.0), (16, 3),
                                 _opts(3, 4, 2), INEXACT),
    "conv 2seg inexact L3 cf2 1/1": (lambda: conv_net(8, 6), (4, 1, 8, 8), _opts(3, 2, 1),
                                     _opts(3, 2, 1)),
    "dropout+bn converged": (dropout_bn_net, (4, 1, 8, 8), CONVERGED, CONVERGED),
    "dropout+bn inexact": (dropout_bn_net, (4, 1, 8, 8), _opts(3, 2, 1), _opts(3, 2, 1)),
}


def _rel(d2: float, e2: float) -> float:
    return math.sqrt(d2 / e2) if e2 > 0 else (0.0 if d2 == 0 else math.inf)


def independent(comm: Any, net: layerpar.ODENet, x: torch.Tensor, y: torch.Tensor,
                fwd: Any, bwd: Any) -> dict[str, Any]:
    """The errors `check_gradients` should report, computed without it."""
    ref, inx_net = copy.deepcopy(net), copy.deepcopy(net)
    seg_of = {k: s for s, (k, _) in enumerate(inx_net.segments)}
    n_seg = len(seg_of)
    xr = x.clone().requires_grad_()
    torch.manual_seed(SEED_FORWARD)
    out_r = ref(xr)
    loss_r = F.cross_entropy(out_r, y)
    loss_r.backward()
    model = layerpar.LayerParallel(inx_net, comm, fwd, bwd)
    xi = x.clone().requires_grad_()
    torch.manual_seed(SEED_FORWARD)
    out_i = model(xi)
    loss_i = F.cross_entropy(out_i, y)
    loss_i.backward()
    out_i, out_r = out_i.detach(), out_r.detach()
    refp = dict(ref.named_parameters())
    seg_d2, seg_e2 = [0.0] * n_seg, [0.0] * n_seg
    d2 = e2 = i2 = dot = 0.0
    # this rank's own layers (`model.layers`, named as in the serial net)
    for name, p in model.layers.named_parameters(prefix="layers"):
        gi, ge = p.grad.double(), refp[name].grad.double()
        pd2, pe2 = float(((gi - ge) ** 2).sum()), float((ge ** 2).sum())
        d2, e2, i2 = d2 + pd2, e2 + pe2, i2 + float((gi ** 2).sum())
        dot += float((gi * ge).sum())
        k = int(name.split(".")[1])
        if k in seg_of:
            seg_d2[seg_of[k]] += pd2
            seg_e2[seg_of[k]] += pe2
    tot = _sum(comm, seg_d2 + seg_e2 + [d2, e2, i2, dot])
    seg_d2, seg_e2 = tot[:n_seg], tot[n_seg:2 * n_seg]
    d2, e2, i2, dot = tot[2 * n_seg:]
    res = {
        "output_error": _rel(float(((out_i - out_r) ** 2).sum()), float((out_r ** 2).sum())),
        "loss_error": abs(loss_i.item() - loss_r.item()) / abs(loss_r.item()),
        "input_grad_error": _rel(float(((xi.grad - xr.grad) ** 2).sum()),
                                 float((xr.grad ** 2).sum())),
        "segment_grad_errors": [_rel(a, b) for a, b in zip(seg_d2, seg_e2)],
        "param_grad_error": _rel(d2, e2),
        "cosine": dot / math.sqrt(i2 * e2),
        "fwd_iterations": [s.iterations for s in model.last_forward],
        "bwd_iterations": [s.iterations for s in model.last_backward],
        "fwd_residuals": [s.residual_history[-1] if s.residual_history else None
                          for s in model.last_forward],
        "bwd_residuals": [s.residual_history[-1] if s.residual_history else None
                          for s in model.last_backward],
    }
    model.close()
    return res


def one_case(comm: Any, name: str) -> dict[str, Any]:
    make, shape, fwd, bwd = CASES[name]
    torch.manual_seed(7)
    net = make().double()
    x = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 5, (shape[0],), generator=torch.Generator().manual_seed(2))
    want = independent(comm, net, x, y, fwd, bwd)

    model = layerpar.LayerParallel(copy.deepcopy(net), comm, fwd, bwd)
    # some parameters hold a gradient already, others none: both must stay as they are
    params = list(model.parameters())
    for i, p in enumerate(params):
        p.grad = torch.full_like(p, float(i + 1)) if i % 2 else None
    before = [None if p.grad is None else (p.grad, p.grad.clone()) for p in params]
    torch.manual_seed(SEED_FORWARD)
    rng = torch.get_rng_state()
    buffers = [b.clone() for b in model.buffers()]
    stats = (model.last_forward, model.last_backward)
    got = model.check_gradients(x, y, F.cross_entropy)
    assert model.training
    assert torch.equal(torch.get_rng_state(), rng), "the random generator moved"
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), buffers)), "buffers moved"
    assert (model.last_forward, model.last_backward) == stats
    for p, b in zip(params, before):
        if b is None:
            assert p.grad is None, "a .grad appeared"
        else:
            assert p.grad is b[0] and torch.equal(p.grad, b[1]), ".grad changed"
    again = model.check_gradients(x, y, F.cross_entropy)  # exact mode again, same result
    assert again == got, (again, got)
    # the exact pass run once and reused (as auto-tuning's checks of one batch do): the
    # same result, and again nothing the training sees moved
    ref = exact_reference(model, x, y, F.cross_entropy)
    assert torch.equal(torch.get_rng_state(), rng), "the random generator moved"
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), buffers)), "buffers moved"
    assert (model.last_forward, model.last_backward) == stats
    for _ in range(2):
        shared = check_gradients(model, x, y, F.cross_entropy, reference=ref)
        assert shared == got, (shared, got)
    try:  # a reference of another batch is refused (on every rank alike: same x)
        check_gradients(model, x.clone(), y, F.cross_entropy, reference=ref)
        raise AssertionError("a reference of another batch was accepted")
    except ValueError as e:
        assert "`reference`" in str(e)
    model.eval()
    model.check_gradients(x, y, F.cross_entropy)  # eval mode: runs, mode kept
    assert not model.training and not any(m.training for m in model.modules())
    # exact propagation is a mode of this model: no second model, no second communicator
    assert not any(isinstance(v, layerpar.LayerParallel) for v in vars(model).values())
    model.close()
    assert model.closed
    if comm is not None:
        every = comm.allgather(got)
        assert all(g == got for g in every), f"ranks differ: {every}"
    text = str(got)
    assert "\n" not in text and "cos" in text
    return {"check": dataclasses.asdict(got), "want": want, "str": text}


def bad_arguments(comm: Any) -> list[str]:
    """The messages of each bad call (every rank raises the same way)."""
    torch.manual_seed(7)
    model = layerpar.LayerParallel(dense_net(6).double(), comm, INEXACT, INEXACT)
    x = torch.randn(4, 3, dtype=torch.float64)
    y = torch.randint(0, 5, (4,))
    calls: list[tuple[str, Callable[[], Any]]] = [
        ("`x`", lambda: model.check_gradients("x", y, F.cross_entropy)),
        ("`x`", lambda: model.check_gradients(torch.ones(4, 3, dtype=torch.bool), y,
                                              F.cross_entropy)),
        ("`x`", lambda: model.check_gradients(torch.ones(0, 3, dtype=torch.float64), y,
                                              F.cross_entropy)),
        ("`y`", lambda: model.check_gradients(x, None, F.cross_entropy)),
        ("`loss_fn`", lambda: model.check_gradients(x, y, "cross_entropy")),
        ("`loss_fn`", lambda: model.check_gradients(x, y, lambda o, t: o.sum(0))),
    ]
    seen = []
    for word, call in calls:
        try:
            call()
        except (TypeError, ValueError) as exc:
            assert word in str(exc), (word, exc)
            seen.append(f"{type(exc).__name__}: {exc}")
        else:
            raise AssertionError(f"no error for a bad {word}")
    model.close()
    try:
        model.check_gradients(x, y, F.cross_entropy)
    except RuntimeError as exc:
        assert "closed" in str(exc)
        seen.append(f"RuntimeError: {exc}")
    else:
        raise AssertionError("a closed model ran")
    return seen


def run_cases(comm: Optional[Any]) -> dict[str, Any]:
    """Every case, and the bad-argument messages, as JSON-ready data."""
    out: dict[str, Any] = {name: one_case(comm, name) for name in CASES}
    out["bad arguments"] = bad_arguments(comm)
    return json.loads(json.dumps(out))  # as OUT.json holds it (tuples become lists)


def main() -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    results = run_cases(comm)
    if comm.rank == 0:
        with open(sys.argv[1], "w") as fh:
            json.dump(results, fh, indent=1)
    sys.stdout.write(f"RANK {comm.rank} OK\n")


if __name__ == "__main__":
    main()
