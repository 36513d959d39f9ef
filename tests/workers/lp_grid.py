"""Worker: data x layer parallelism (ProcessGrid) under MPI or torch.distributed (gloo).

Backend: torch.distributed when the environment has RANK/WORLD_SIZE/MASTER_ADDR (torchrun,
or processes the test spawned), else mpi4py.  Every process prints one line
``RANK <world rank> OK <detail>`` or ``RANK <world rank> <ExceptionType>: <message>``.

Correctness cases compare with the serial oracle (float64, <= 1e-10 relative):
  exact     grids 2x2, 1x4, 4x1 (max_levels=1) and 2x2 converged MGRIT: outputs of
            each replica's shard, every parameter gradient, five SGD steps' losses
  inexact   3 levels, cf 4, 2/1 iterations, tol 0: 2x2 equals 1x2 with the same
            global batch (losses of five steps and the final parameters)
  resume    2x2 with Adam, checkpoint, resume on 4x1 and on 1x4 = uninterrupted 2x2
  solve     solve() over the whole group = the serial solve
  correct   the four above in one job
Failure cases (each rank reports the exception it ended with):
  raise_one_rank, raise_in_layer, nan_one_replica, options_differ, grid_not_divide,
  shapes_differ, exact_differs, sigkill, auto_replicas, accuracy_replicas (options="auto"
  or an adaptive policy with data replicas: refused on every process)
  paths_differ  batched="auto" with replica timings that disagree: one path everywhere
"""
import datetime
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn

import layerpar
from layerpar.ode import blocks

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: tolerances
from tolerances import F64  # noqa: E402

TORCH = "MASTER_ADDR" in os.environ and "RANK" in os.environ
if TORCH:
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    comm = dist.group.WORLD
    rank, size = dist.get_rank(), dist.get_world_size()
else:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
torch.set_num_threads(1)

EXACT = layerpar.MGRITOptions(max_levels=1)
CONVERGED = layerpar.MGRITOptions(max_levels=3, cfactor=2, tol=1e-13, max_iter=40)
FWD = layerpar.MGRITOptions(max_levels=3, cfactor=4, max_iter=2, tol=0.0)
BWD = layerpar.MGRITOptions(max_levels=3, cfactor=4, max_iter=1, tol=0.0)
B = 8


def net(n=8, width=4):
    torch.manual_seed(0)
    return layerpar.ODENet(open=nn.Linear(3, width),
                           steps=lambda k: blocks.Dense(width), n_steps=n,
                           t_final=1.0, close=nn.Linear(width, 5)).double()


def data(step=0):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(B, 3, generator=g, dtype=torch.float64), torch.randint(0, 5, (B,),
                                                                            generator=g)


def rel(a, b):
    return float((a - b).norm() / max(float(b.norm()), 1e-300))


def shard(t, grid):
    n = t.shape[0] // grid.data
    return t[grid.data_rank * n:(grid.data_rank + 1) * n]


def sub_comm(ranks):
    """A communicator/group of `ranks` (collective over the world); None elsewhere."""
    if TORCH:
        g = dist.new_group(ranks)
        return g if rank in ranks else None
    c = comm.Split(0 if rank in ranks else MPI.UNDEFINED, rank)
    return c if rank in ranks else None


def replica_mean(grid, value):
    """The mean over replicas of a per-replica scalar (each replica's ranks agree)."""
    got = grid.world.allgather_object((grid.data_rank, value), "a replica mean")
    per = dict(got)
    return sum(per.values()) / len(per)


def check_against_serial(grid, opts, bopts=None, steps=5):
    serial = net()
    model = layerpar.LayerParallel(net(), grid=grid, options=opts,
                                   backward_options=bopts or opts)
    opt_s = torch.optim.SGD(serial.parameters(), lr=0.1)
    opt_p = torch.optim.SGD(model.parameters(), lr=0.1)
    worst = 0.0
    for step in range(steps):
        x, y = data(step)
        opt_s.zero_grad()
        out_s = serial(x)
        loss_s = nn.functional.cross_entropy(out_s, y)
        loss_s.backward()
        opt_p.zero_grad()
        out_p = model(shard(x, grid))
        loss_p = nn.functional.cross_entropy(out_p, shard(y, grid))
        loss_p.backward()
        errs = [rel(out_p.detach(), shard(out_s.detach(), grid))]
        grads_s = dict(serial.named_parameters())
        for name, p in model.named_parameters():
            errs.append(rel(p.grad, grads_s[name].grad))
        glob = replica_mean(grid, loss_p.item())
        errs.append(abs(glob - loss_s.item()) / abs(loss_s.item()))
        worst = max(worst, *errs)
        opt_s.step()
        opt_p.step()
    model.close()
    return worst


def case_exact():
    worst = {}
    for R, L in [(2, 2), (1, 4), (4, 1)]:
        grid = layerpar.ProcessGrid(comm, data=R, layers=L)
        worst[f"{R}x{L}"] = check_against_serial(grid, EXACT)
        if (R, L) == (2, 2):
            worst["2x2 converged"] = check_against_serial(grid, CONVERGED)
        grid.close()
    bad = {k: v for k, v in worst.items() if not v <= F64.converged}
    if bad:
        raise AssertionError(f"grid differs from serial: {bad}")
    return " ".join(f"{k}={v:.1e}" for k, v in worst.items())


def train_run(grid, steps=5, **kw):
    """Losses and final parameters of a training with SGD on `grid`, and the path
    (batched or not) each segment took (collective); `kw` goes to LayerParallel."""
    model = layerpar.LayerParallel(net(n=32), grid=grid, options=FWD, backward_options=BWD,
                                   **kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        x, y = data(step)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(shard(x, grid)), shard(y, grid))
        loss.backward()
        opt.step()
        losses.append(replica_mean(grid, loss.item()))
    paths = [c.batched for r in model._runners.values() for c in r.paths.values()]
    sd = model.gather_state_dict()
    model.close()
    return losses, sd, paths


def case_inexact():
    grid = layerpar.ProcessGrid(comm, data=2, layers=2)
    losses4, sd4, _ = train_run(grid)
    grid.close()
    pair = sub_comm([0, 1])
    if pair is not None:
        g2 = layerpar.ProcessGrid(pair, data=1, layers=2)
        losses2, sd2, _ = train_run(g2)
        g2.close()
        err = max(max(abs(a - b) / abs(b) for a, b in zip(losses4, losses2)),
                  max(rel(sd4[k], sd2[k]) for k in sd2))
        if not err <= F64.converged:
            raise AssertionError(f"2x2 differs from 1x2: {err:.2e}; {losses4} {losses2}")
        return f"err={err:.1e} losses={[f'{v:.6f}' for v in losses4]}"
    return "idle"


def case_paths_differ():
    """batched="auto" where the replicas' own timings disagree (replica 0 finds the
    vectorised cycles faster, replica 1 the per-step ones): every process takes the
    path of the summed timings, here vectorised, and trains as batched=True does.
    Each replica deciding alone paired a batched pass's gradient buckets with a
    per-step pass's and hung."""
    from layerpar.parallel import runner

    grid = layerpar.ProcessGrid(comm, data=2, layers=2, timeout=60)
    own = {0: {"vectorised": 1.0, "per_step": 3.0},
           1: {"vectorised": 3.0, "per_step": 1.5}}[grid.data_rank]
    real = runner.best_seconds
    runner.best_seconds = lambda fn, device, repeats: (fn(), own[fn.__name__])[1]
    try:
        losses, sd, paths = train_run(grid, steps=4, batched="auto", timeout=60)
    finally:
        runner.best_seconds = real
    want_losses, want_sd, _ = train_run(grid, steps=4, batched=True, timeout=60)
    grid.close()
    seen = comm_allgather(paths)
    if any(p != [True] for p in seen):
        raise AssertionError(f"the processes took different paths: {seen}")
    err = max(max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses)),
              max(rel(sd[k], want_sd[k]) for k in want_sd))
    if not err <= F64.converged:
        raise AssertionError(f"auto differs from batched=True: {err:.2e}")
    return f"paths={seen} err={err:.1e}"


def comm_allgather(value):
    if TORCH:
        out = [None] * size
        dist.all_gather_object(out, value)
        return out
    return comm.allgather(value)


def case_exact_differs():
    """One replica runs a pass under `model.exact()`, the other with MGRIT."""
    grid = layerpar.ProcessGrid(comm, data=2, layers=2, timeout=60)
    model = layerpar.LayerParallel(net(), grid=grid, options=FWD, backward_options=BWD,
                                   timeout=60)
    x, y = data()
    t0 = time.perf_counter()
    try:
        if grid.data_rank == 1:
            with model.exact():
                out = model(shard(x, grid))
        else:
            out = model(shard(x, grid))
        nn.functional.cross_entropy(out, shard(y, grid)).backward()
    finally:
        print(f"RANK {rank} took {time.perf_counter() - t0:.1f} s", flush=True)
    return "no error"


def adam_steps(model, opt, grid, first, last):
    for step in range(first, last):
        x, y = data(step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(shard(x, grid)), shard(y, grid)).backward()
        opt.step()


def case_resume():
    grid = layerpar.ProcessGrid(comm, data=2, layers=2)
    model = layerpar.LayerParallel(net(), grid=grid, options=EXACT)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    adam_steps(model, opt, grid, 0, 2)
    sd, ost = model.gather_state_dict(), model.gather_optimizer_state(opt)
    adam_steps(model, opt, grid, 2, 4)
    ref = model.gather_state_dict()
    model.close()
    grid.close()
    errs = {}
    for R, L in [(4, 1), (1, 4)]:
        g = layerpar.ProcessGrid(comm, data=R, layers=L)
        m = layerpar.LayerParallel(net(), grid=g, options=EXACT, state_dict=sd)
        o = torch.optim.Adam(m.parameters(), lr=0.01)
        m.load_optimizer_state(o, ost)
        adam_steps(m, o, g, 2, 4)
        got = m.gather_state_dict()
        errs[f"{R}x{L}"] = max(rel(got[k], ref[k]) for k in ref)
        m.close()
        g.close()
    if not all(v <= F64.converged for v in errs.values()):
        raise AssertionError(f"resumed run differs: {errs}")
    return " ".join(f"{k}={v:.1e}" for k, v in errs.items())


def case_solve():
    """`solve()` over the whole group (an mpi4py communicator or a torch.distributed
    process group) equals the serial solve: final state, iterations, residuals."""
    from layerpar.mgrit import solve

    def step(u, t0, t1, level):
        return u / (1 + (t1 - t0))

    opts = layerpar.MGRITOptions(max_levels=3, cfactor=4, tol=1e-10, max_iter=20)
    u0 = torch.ones(3, dtype=torch.float64)
    par = solve(step, u0, n_steps=64, t_final=1.0, options=opts, comm=comm)
    ser = solve(step, u0, n_steps=64, t_final=1.0, options=opts, comm=None)
    err = rel(par.final_state, ser.final_state)
    hist = max(abs(a - b) / b for a, b in zip(par.residual_history, ser.residual_history))
    if not (err <= F64.roundoff and par.iterations == ser.iterations
            and hist <= F64.converged):
        raise AssertionError(f"solve differs: {err} {par.iterations} {ser.iterations} {hist}")
    return f"iterations={par.iterations} err={err:.1e}"


def case_bn_stats():
    """Batch norm under a 2 x (size/2) grid, exact solves: after each step every
    replica holds the same running statistics, the mean of the replicas' own updates
    (they drifted apart, so an evaluation and the state dict saved depended on the
    replica); also with two forwards before one backward; an evaluation agrees on
    every replica.  Each replica normalises with its own share's statistics (no
    SyncBatchNorm), so only the first layer's running mean after the first step, whose
    input is serial's, is serial's (the mean of the shares' means is the batch's)."""
    def bn_net():
        torch.manual_seed(0)
        return layerpar.ODENet(open=nn.Conv2d(1, 4, 3, padding=1),
                               steps=lambda k: blocks.Conv(4, batch_norm=True), n_steps=8,
                               t_final=1.0, close=nn.Sequential(nn.Flatten(),
                                                                nn.Linear(4 * 36, 3))).double()

    exact = layerpar.MGRITOptions(max_levels=1)
    grid = layerpar.ProcessGrid(comm, data=2, layers=size // 2)
    serial, model = bn_net(), layerpar.LayerParallel(bn_net(), grid=grid, options=exact)
    opt_s = torch.optim.SGD(serial.parameters(), lr=0.1)
    opt_p = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        x = torch.randn(16, 1, 6, 6, generator=g, dtype=torch.float64)
        y = torch.randint(0, 3, (16,), generator=g)
        for m, opt, xs, ys in ((serial, opt_s, x, y),
                               (model, opt_p, shard(x, grid), shard(y, grid))):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(m(xs), ys)
            if step == 3:  # two forwards, one backward
                loss = loss + nn.functional.cross_entropy(m(xs.flip(0)), ys.flip(0))
            loss.backward()
            opt.step()
        if step == 0 and grid.layer_rank == 0:
            first = "layers.1.blocks.0.bn.running_mean"
            err = rel(dict(model.named_buffers())[first], dict(serial.named_buffers())[first])
            assert err <= F64.roundoff, err
    mine = {n: b for n, b in model.named_buffers() if "running" in n}
    model.eval()
    with torch.no_grad():
        out = model(torch.randn(4, 1, 6, 6, generator=g, dtype=torch.float64))
    got = grid.world.allgather_object(
        (grid.layer_rank, [b.tolist() for b in mine.values()], out.tolist()),
        "the replicas' statistics")
    for q, stats, o in got:
        same = [(s2, o2) for q2, s2, o2 in got if q2 == q]
        assert all(s2 == stats and o2 == o for s2, o2 in same), "replicas differ"
    model.close()
    return "replicas agree"


def case_correct():
    """exact, inexact, resume, solve and batch-norm statistics in one job (one
    start-up instead of five)."""
    return " | ".join(f"{name}: {globals()[f'case_{name}']()}"
                      for name in ("exact", "inexact", "resume", "solve", "bn_stats"))


def case_raise_one_rank():
    grid = layerpar.ProcessGrid(comm, data=2, layers=2, timeout=60)
    model = layerpar.LayerParallel(net(), grid=grid, options=FWD.replace(max_levels=2,
                                   cfactor=2), timeout=60)
    x, y = data()
    out = model(shard(x, grid))
    if rank == 3:
        raise RuntimeError("loss exploded on rank 3")
    nn.functional.cross_entropy(out, shard(y, grid)).backward()
    return "no error"


class Exploding(blocks.Dense):
    """A Dense block that raises on world rank 3 once armed."""

    armed = False

    def forward(self, u):
        if Exploding.armed and rank == 3:
            raise RuntimeError("a layer exploded on rank 3")
        return super().forward(u)


def case_raise_in_layer():
    torch.manual_seed(0)
    n = layerpar.ODENet(open=nn.Linear(3, 4), steps=lambda k: Exploding(4), n_steps=8,
                        t_final=1.0, close=nn.Linear(4, 5)).double()
    grid = layerpar.ProcessGrid(comm, data=2, layers=2, timeout=60)
    model = layerpar.LayerParallel(n, grid=grid, options=FWD.replace(max_levels=2,
                                   cfactor=2), timeout=60)
    x, y = data()
    nn.functional.cross_entropy(model(shard(x, grid)), shard(y, grid)).backward()
    Exploding.armed = True
    nn.functional.cross_entropy(model(shard(x, grid)), shard(y, grid)).backward()
    return "no error"


def case_nan_one_replica():
    """Replica 1 gets a NaN in its batch: its ranks raise DivergenceError, and the
    other replica's (which would wait for its gradients) learn of it within seconds."""
    grid = layerpar.ProcessGrid(comm, data=2, layers=2, timeout=60)
    model = layerpar.LayerParallel(net(), grid=grid, options=FWD.replace(max_levels=2,
                                   cfactor=2), timeout=60)
    x, y = data()
    xs = shard(x, grid).clone()
    if grid.data_rank == 1:
        xs[0, 0] = float("nan")
    t0 = time.perf_counter()
    try:
        nn.functional.cross_entropy(model(xs), shard(y, grid)).backward()
    finally:
        print(f"RANK {rank} took {time.perf_counter() - t0:.1f} s", flush=True)
    return "no error"


def case_options_differ():
    grid = layerpar.ProcessGrid(comm, data=2, layers=2)
    layerpar.LayerParallel(net(), grid=grid, options=FWD if rank != 2 else
                           FWD.replace(max_iter=3))
    return "no error"


def case_auto_replicas():
    grid = layerpar.ProcessGrid(comm, data=2, layers=2)
    layerpar.LayerParallel(net(), grid=grid, options="auto")
    return "no error"


def case_accuracy_replicas():
    grid = layerpar.ProcessGrid(comm, data=2, layers=2)
    layerpar.LayerParallel(net(), grid=grid, options=FWD, accuracy=True)
    return "no error"


def case_grid_not_divide():
    layerpar.ProcessGrid(comm, data=3)
    return "no error"


def case_shapes_differ():
    grid = layerpar.ProcessGrid(comm, data=2, layers=2)
    model = layerpar.LayerParallel(net(), grid=grid, options=EXACT)
    x, _ = data()
    model(x[:4] if grid.data_rank == 0 else x[:3])
    return "no error"


def case_shapes_differ_in_replica():
    """One rank of replica 0 passes another batch than its partner: every process
    raises at once (checked per group, rank 1 and its data partner raised a message
    about the replicas, and ranks 0 and 2 waited out the timeout)."""
    grid = layerpar.ProcessGrid(comm, data=2, layers=2)
    model = layerpar.LayerParallel(net(), grid=grid, options=EXACT)
    x, _ = data()
    t0 = time.perf_counter()
    try:
        model(x[:2] if rank == 1 else x[:4])
    finally:
        print(f"RANK {rank} took {time.perf_counter() - t0:.1f} s", flush=True)
    return "no error"


def case_skip_backward():
    """Rank 1 skips a backward() and goes on: every process names where each one is
    (the timeout found it before: 10 minutes by default).  The grid's timeout (60 s)
    is the model's, which used to override it with its own default."""
    grid = layerpar.ProcessGrid(comm, data=2, layers=2, timeout=60)
    model = layerpar.LayerParallel(net(), grid=grid, options=FWD.replace(max_levels=2,
                                   cfactor=2))
    assert model.transport.timeout == 60, model.transport.timeout
    # a timeout names the world rank beside a group's (it named group ranks only)
    assert model.transport.world_rank(0) == 2 * grid.data_rank
    assert model._data_transport.world_rank(1) == 2 + grid.layer_rank
    assert model._data_transport._who(1) == f"rank 1 of this group (world rank " \
        f"{2 + grid.layer_rank})", model._data_transport._who(1)
    x, y = data()
    t0 = time.perf_counter()
    try:
        for step in range(3):
            loss = nn.functional.cross_entropy(model(shard(x, grid)), shard(y, grid))
            if not (step == 1 and rank == 1):
                loss.backward()
    finally:
        print(f"RANK {rank} took {time.perf_counter() - t0:.1f} s", flush=True)
    return "no error"


def case_sigkill():
    grid = layerpar.ProcessGrid(comm, data=2, layers=2, timeout=60)
    model = layerpar.LayerParallel(net(), grid=grid, options=FWD.replace(max_levels=2,
                                   cfactor=2), timeout=60)
    x, y = data()
    for step in range(3):
        out = model(shard(x, grid))
        if step == 1 and rank == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        nn.functional.cross_entropy(out, shard(y, grid)).backward()
    return "no error"


if __name__ == "__main__":
    case = sys.argv[1]
    try:
        detail = globals()[f"case_{case}"]()
        print(f"RANK {rank} OK {detail}", flush=True)
    except BaseException as exc:  # noqa: BLE001 - reported, the test decides
        print(f"RANK {rank} {type(exc).__name__}: {str(exc).splitlines()[0][:400]}",
              flush=True)
        if TORCH:  # without torchrun, rank 0 hosts the store: let the others read it
            time.sleep(2)
    if TORCH and case not in ("sigkill", "raise_one_rank"):
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    sys.stdout.flush()
    if TORCH:
        os._exit(0)  # gloo's threads may still wait on a failed peer: do not join them
