"""MPI worker: LayerParallel bad-input and cross-rank contract cases.  Every rank prints
one line `RANK <r> <ExceptionType>: <message>` (or `RANK <r> OK`) and exits normally.
The contract cases (ranks that differ in what they differentiate) print OK when their
outputs and gradients equal the serial oracle's (float64, <= 1e-10 relative).

Run: mpiexec -n P python -m mpi4py tests/workers/lp_errors.py CASE
"""
import copy
import sys
from pathlib import Path

import torch
from mpi4py import MPI

import layerpar
from layerpar.ode import Segment, blocks

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: tolerances
from tolerances import F64  # noqa: E402

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
OPTS = layerpar.MGRITOptions(max_levels=2, cfactor=2, max_iter=3)
EXACT = layerpar.MGRITOptions(max_levels=3, cfactor=2, tol=1e-13, max_iter=40)


def net(n=8, width=4, steps=None):
    """The test net; `steps` (a block factory) replaces its Dense blocks."""
    torch.manual_seed(0)
    return layerpar.ODENet(open=torch.nn.Linear(3, width),
                           steps=steps or (lambda k: blocks.Dense(width)), n_steps=n,
                           t_final=1.0, close=torch.nn.Linear(width, 5))


def case_layers_lt_ranks():
    layerpar.LayerParallel(net(n=comm.size - 1), comm, OPTS)


def case_options_differ():
    opts = OPTS if rank == 0 else OPTS.replace(max_iter=4)
    layerpar.LayerParallel(net(), comm, opts)


def case_accuracy_differs():
    from layerpar.parallel.adaptive import AccuracyPolicy

    policy = AccuracyPolicy() if rank != 1 else AccuracyPolicy(min_cosine=0.9)
    layerpar.LayerParallel(net(), comm, OPTS, accuracy=policy)


def case_accuracy_bad_on_one_rank():
    layerpar.LayerParallel(net(), comm, OPTS, accuracy=True if rank != 2 else "on")


def case_factory_fails_on_one_rank():
    def factory():
        if rank == comm.size - 1:
            raise RuntimeError("factory exploded")
        return net()
    layerpar.LayerParallel(factory, comm, OPTS)


def case_shape_mismatch_between_segments():
    def bad():
        torch.manual_seed(0)
        return layerpar.ODENet(layers=[
            torch.nn.Linear(3, 4), Segment(lambda k: blocks.Dense(4), 8, 1.0),
            torch.nn.Linear(4, 6), Segment(lambda k: blocks.Dense(5), 8, 1.0),
            torch.nn.Linear(5, 2)])
    model = layerpar.LayerParallel(bad, comm, OPTS)
    model(torch.randn(2, 3)).sum().backward()


def case_input_differs():
    model = layerpar.LayerParallel(net(), comm, OPTS)
    model(torch.randn(2 + (rank == 1), 3))


def case_input_values_differ_after_checks():  # check_inputs=0: the user opted out
    model = layerpar.LayerParallel(net(), comm, OPTS, check_inputs=0)
    torch.manual_seed(100 + rank)
    model(torch.randn(2, 3))


def case_nan_loss():
    model = layerpar.LayerParallel(net(), comm, OPTS)
    out = model(torch.randn(2, 3))
    (out.sum() * float("nan")).backward()


def case_nan_loss_one_rank():
    model = layerpar.LayerParallel(net(), comm, OPTS)
    out = model(torch.randn(2, 3))
    (out.sum() * (float("nan") if rank == 1 else 1.0)).backward()


def case_retain_graph_twice():
    model = layerpar.LayerParallel(net(), comm, OPTS)
    loss = model(torch.randn(2, 3)).sum()
    loss.backward(retain_graph=True)
    loss.backward()


def case_create_graph():
    model = layerpar.LayerParallel(net(), comm, OPTS)
    model(torch.randn(2, 3)).sum().backward(create_graph=True)


def case_activation_differs():  # only the activation: same types and shapes
    act = "relu" if rank == 1 else "tanh"
    layerpar.LayerParallel(net(steps=lambda k: blocks.Dense(4, activation=act)), comm, OPTS)


def case_n_steps_differs():  # a script that builds the net per rank: named, not a digest
    layerpar.LayerParallel(net(n=12 if rank == 1 else 8), comm, OPTS)


def case_width_differs():
    layerpar.LayerParallel(net(width=5 if rank == 1 else 4), comm, OPTS)


def case_optimizer_over_other_tensors_on_one_rank():
    model = layerpar.LayerParallel(net(), comm, OPTS)
    params = list(model.parameters()) + ([torch.zeros(3, requires_grad=True)] if rank == 2
                                         else [])
    model.gather_optimizer_state(torch.optim.SGD(params, lr=0.1))


def case_rank_skips_backward():
    """Rank 1 skips a backward() and goes on to the next batch: the others wait for its
    adjoint messages, time out and say so; rank 1 hears of it at its next wait."""
    model = layerpar.LayerParallel(net(), comm, OPTS, timeout=3)
    x = torch.randn(2, 3)
    loss = model(x).sum()
    if rank != 1:
        loss.backward()
    model(x)


def case_rank_sleeps_in_loss():
    model = layerpar.LayerParallel(net(), comm, OPTS, timeout=3)
    out = model(torch.randn(2, 3))
    if rank == 1:
        import time

        time.sleep(8)
    out.sum().backward()


def case_input_values_differ():  # same shape, rank-dependent values
    model = layerpar.LayerParallel(net(), comm, OPTS)
    torch.manual_seed(100 + rank)
    model(torch.randn(2, 3))


def case_loss_differs():  # rank-dependent targets: only the last rank's would count
    model = layerpar.LayerParallel(net(), comm, OPTS)
    out = model(torch.randn(2, 3))
    torch.nn.functional.cross_entropy(out, torch.tensor([rank % 5, 0])).backward()


def case_step_fails_on_one_rank():
    class Boom(torch.nn.Module):
        def __init__(self, k):
            super().__init__()
            self.k = k
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, u):
            if self.k == 5 and not torch.is_grad_enabled():
                raise RuntimeError("layer 5 failed")
            return torch.tanh(self.lin(u))

    model = layerpar.LayerParallel(net(steps=Boom), comm, OPTS)
    model(torch.randn(2, 3))


def case_reuse_after_failure():
    """The opening layer fails on rank 0 alone (a float32 input into a float64 net);
    the next call, with a good input, is refused on every rank, the failing one too,
    naming the first failure (it raised that failure again as RemoteError, on rank 0
    naming rank 0 itself)."""
    model = layerpar.LayerParallel(net().double(), comm, OPTS)
    x = torch.randn(2, 3, dtype=torch.float64)
    try:
        model(x.float())
    except (RuntimeError, layerpar.RemoteError):
        pass
    else:
        raise AssertionError("the float32 input ran")
    model(x)


def case_block_changes_shape():
    class Narrow(torch.nn.Module):  # layer 6 maps width 4 to 1: u + h F(u) would broadcast
        def __init__(self, k):
            super().__init__()
            self.lin = torch.nn.Linear(4, 1 if k == 6 else 4)

        def forward(self, u):
            return torch.tanh(self.lin(u))

    model = layerpar.LayerParallel(net(steps=Narrow), comm, OPTS)
    model(torch.randn(2, 3)).sum().backward()


def rel(a, b):
    return float((a - b).norm() / max(float(b.norm()), 1e-300))


def check(model, ref, x_here, x_ref):
    torch.manual_seed(1)
    y = torch.randint(0, 5, (6,))
    torch.nn.functional.cross_entropy(model(x_here), y).backward()
    torch.nn.functional.cross_entropy(ref(x_ref), y).backward()
    refp = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        want = refp[n].grad
        if (p.grad is None) != (want is None):
            raise AssertionError(f"{n}: grad {p.grad is not None}, oracle {want is not None}")
        if want is not None and rel(p.grad, want) > F64.converged:
            raise AssertionError(f"{n}: relative error {rel(p.grad, want)}")


def case_frozen_rank():
    """Fine-tune the head only: every parameter but the classifier's is frozen, so the
    ranks without the classifier have nothing of their own to differentiate."""
    base = net(n=12).double()
    for n, p in base.named_parameters():
        p.requires_grad_(n.startswith("layers.2."))
    ref = copy.deepcopy(base)
    model = layerpar.LayerParallel(base, comm, EXACT, EXACT)
    x = torch.randn(6, 3, dtype=torch.float64)
    check(model, ref, x, x)


def case_x_requires_grad_differs():
    base = net(n=12).double()
    ref = copy.deepcopy(base)
    model = layerpar.LayerParallel(base, comm, EXACT, EXACT)
    x = torch.randn(6, 3, dtype=torch.float64)
    xp = x.clone().requires_grad_(rank == 1)  # not the broadcast root
    xr = x.clone().requires_grad_()
    check(model, ref, xp, xr)
    if rank == 1 and rel(xp.grad, xr.grad) > F64.converged:
        raise AssertionError(f"x.grad relative error {rel(xp.grad, xr.grad)}")
    if rank != 1 and xp.grad is not None:
        raise AssertionError("x.grad set on a rank whose x does not require grad")


def main():
    case = sys.argv[1]
    try:
        globals()["case_" + case]()
        print(f"RANK {rank} OK", flush=True)
    except Exception as exc:  # noqa: BLE001 - report what each rank saw
        msg = str(exc).replace("\n", " ")
        print(f"RANK {rank} {type(exc).__name__}: {msg}", flush=True)


if __name__ == "__main__":
    main()
