"""Worker: the baselines (data and pipeline parallelism) against the serial oracle.

Backend: torch.distributed (gloo) when the environment has RANK and MASTER_ADDR
(torchrun), else mpi4py (the pipeline then initialises gloo from the communicator).

Case "correct": for two nets (one segment with plain layers before and after it; two
segments with a plain layer between them), every method below runs one train_step on
a float64 batch and its gradients are compared with the serial net's (same initial
weights); then two more steps with SGD, and the gathered state dict and the
eval_forward output are compared with serial training's.  Each rank prints per method
``RANK <r> CASE <net>/<method> OK <max relative error>`` or ``... SKIP <reason>`` (a
schedule torch refuses) or ``... FAIL <what>``; at the end ``RANK <r> DONE``.

Case "refusals": bad arguments raise the same way on every rank before any message.
Case "tune": `PipelineNet.tune_microbatches` chooses alike on every rank.
"""
import os
import sys
from pathlib import Path

import torch
from torch import nn

import layerpar
from layerpar.ode import blocks
from layerpar.ode.net import Segment
from layerpar.parallel.baselines import (
    SCHEDULES,
    DataParallelNet,
    LayerParallelMethod,
    PipelineNet,
    SerialMethod,
    process_group_from_mpi,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: tolerances
from tolerances import F64  # noqa: E402

TORCH = "MASTER_ADDR" in os.environ and "RANK" in os.environ
if TORCH:
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    comm = dist.group.WORLD
    rank, size = dist.get_rank(), dist.get_world_size()
else:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
torch.set_num_threads(1)
B, WIDTH = 8, 4


def one_segment():
    torch.manual_seed(0)
    return layerpar.ODENet(layers=[nn.Linear(3, WIDTH), nn.Tanh(),
                                   Segment(lambda k: blocks.Dense(WIDTH), 16, 1.0),
                                   nn.Tanh(), nn.Linear(WIDTH, 5)]).double()


def two_segments():
    torch.manual_seed(1)
    return layerpar.ODENet(layers=[nn.Linear(3, WIDTH),
                                   Segment(lambda k: blocks.Dense(WIDTH), 8, 1.0),
                                   nn.Linear(WIDTH, WIDTH),
                                   Segment(lambda k: blocks.Dense(WIDTH), 8, 1.0),
                                   nn.Linear(WIDTH, 5)]).double()


NETS = {"one": one_segment, "two": two_segments}


def data(step):
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(B, 3, generator=g, dtype=torch.float64),
            torch.randint(0, 5, (B,), generator=g))


def loss_fn(out, y):
    return nn.functional.cross_entropy(out, y)


def rel(a, b):
    return float((a - b).norm() / max(float(b.norm()), 1e-300))


def serial_run(make):
    """Serial oracle: first step's gradients, the state after 3 SGD steps, eval output."""
    m = SerialMethod(make())
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    grads, losses = None, []
    for step in range(3):
        losses.append(m.train_step(*data(step), loss_fn))
        if step == 0:
            grads = {n: p.grad.clone() for n, p in m.named_parameters()}
        opt.step()
    return grads, m.gather_state_dict(), losses, m.eval_forward(data(9)[0])


def check(method, want):
    """The worst relative error of `method` against the serial run `want`."""
    grads, state, losses, out = want
    opt = torch.optim.SGD(method.parameters(), lr=0.1)
    worst = 0.0
    for step in range(3):
        loss = method.train_step(*data(step), loss_fn)
        worst = max(worst, abs(loss - losses[step]) / abs(losses[step]))
        if step == 0:
            names = 0
            for n, p in method.named_parameters():
                worst = max(worst, rel(p.grad, grads[n]))
                names += 1
            assert names > 0, "no parameters on this rank"
        opt.step()
    got = method.gather_state_dict()
    assert got.keys() == state.keys(), sorted(set(got) ^ set(state))
    worst = max(worst, *(rel(got[k], state[k]) for k in state))
    worst = max(worst, rel(method.eval_forward(data(9)[0]), out))
    return worst


def methods(make):
    yield "data-allreduce", lambda: DataParallelNet(make(), comm, engine="allreduce")
    # DistributedDataParallel; under mpiexec over the world group made from MPI
    yield "data-ddp", lambda: DataParallelNet(
        make(), comm if TORCH else process_group_from_mpi(comm), engine="ddp")
    yield "layerparallel-exact", lambda: LayerParallelMethod(make(), comm)
    for name in SCHEDULES:
        for m in (2, 4, 8) if size > 2 else (2, 4):
            yield f"pipeline-{name}-m{m}", lambda name=name, m=m: PipelineNet(
                make(), comm, schedule=name, microbatches=m)


def report(text):
    sys.stdout.write(f"RANK {rank} {text}\n")
    sys.stdout.flush()


def correct(only=None):
    for net_name, make in NETS.items():
        want = serial_run(make)
        for label, build in methods(make):
            if only and only not in label:
                continue
            case = f"CASE {net_name}/{label}"
            try:
                method = build()
            except ValueError as exc:  # a schedule torch (or the plan) refuses, alike
                report(f"{case} SKIP {type(exc).__name__}: {exc}")
                continue
            try:
                worst = check(method, want)
            finally:
                method.close()
            status = "OK" if worst <= F64.roundoff else "FAIL"
            report(f"{case} {status} {worst:.2e}")
    report("DONE")


def refusals():
    make = one_segment
    cases = {
        "schedule": lambda: PipelineNet(make(), comm, schedule="bogus"),
        "microbatches": lambda: PipelineNet(make(), comm, microbatches=0),
        "engine": lambda: DataParallelNet(make(), comm, engine="bogus"),
        # a setting that differs between ranks
        "differ": lambda: PipelineNet(make(), comm, microbatches=2 + rank),
        "rows": lambda: DataParallelNet(make(), comm).train_step(
            torch.zeros(size - 1, 3, dtype=torch.float64),
            torch.zeros(size - 1, dtype=torch.long), loss_fn),
        # a rank passing a batch of another shape
        "batch-differ": lambda: PipelineNet(make(), comm, microbatches=2).train_step(
            torch.zeros(4 * (rank + 1), 3, dtype=torch.float64),
            torch.zeros(4 * (rank + 1), dtype=torch.long), loss_fn),
    }
    for name, fn in cases.items():
        try:
            fn()
            report(f"CASE {name} NORAISE")
        except Exception as exc:  # noqa: BLE001 - reported
            report(f"CASE {name} {type(exc).__name__}: {str(exc).splitlines()[0]}")
    report("DONE")


def tune():
    """tune_microbatches: the same choice on every rank, no parameter changed, and
    training with the chosen count still matches serial training."""
    want = serial_run(one_segment)
    pipe = PipelineNet(one_segment(), comm, schedule="gpipe", microbatches=1)
    before = pipe.gather_state_dict()
    times = pipe.tune_microbatches(*data(0), loss_fn, candidates=(1, 2, 3, 4, 8),
                                   repeats=1)
    after = pipe.gather_state_dict()
    same = all(torch.equal(before[k], after[k]) for k in before)
    grads_unset = all(p.grad is None for p in pipe.parameters())
    worst = check(pipe, want)
    report(f"CASE tune chose={pipe.microbatches} candidates={sorted(times)} "
           f"unchanged={same} grads_unset={grads_unset} worst={worst:.2e}")
    pipe.close()
    report("DONE")


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "correct":
        correct(sys.argv[2] if len(sys.argv) > 2 else None)
    elif what == "refusals":
        refusals()
    elif what == "tune":
        tune()
    else:
        raise SystemExit(f"unknown case {what}")
    import gc

    gc.collect()  # the refused models' groups and threads go before the process group
    import torch.distributed as dist

    if dist.is_initialized():  # under torchrun, or a pipeline's group under mpiexec
        dist.barrier()
        dist.destroy_process_group()
