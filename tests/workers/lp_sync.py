"""Worker: replica synchronisation strategies (allreduce, DASO, Lion Cub) on 4 processes
(case zeros also on 2).

Backend: torch.distributed (gloo) when RANK/MASTER_ADDR are set (torchrun), else mpi4py.
Every process prints ``RANK <world rank> OK <detail>`` or ``RANK <world rank> <Exc>: msg``.

  correct  (float64, exact MGRIT, <= 1e-10 relative)
           - DASO with S = 1, no warm-up, parameters exchanged in float64 = all-reduce
             training (SGD with momentum), on 2x2 and 4x1 (2 simulated nodes); in
             bfloat16 (the drift from the last average) within 1.5e-3 on 2x2 (4e-3 when
             the parameters themselves were rounded)
           - DASO's merges by hand (S = 2, plain SGD, float64, on 2x2 and 4x1 with 2
             nodes): after batch 1 each replica holds avg + (p_sent - lr g_1)
             (merge="progress") or (2 (p_sent - lr g_1) + avg) / 3 (merge="weighted"),
             avg the mean over the replicas of the parameters after batch 0, g_1 its
             node's gradient of batch 1
           - Lion Cub on 1x4 (one replica) = plain Lion on the serial net
           - Lion Cub on 2x2: the applied step is -lr * sign(sum of the replicas' signs)
           - Lion Cub with the same batch on both replicas (2x2; 2x1 on 2 processes:
             case zeros) = Lion, a dead ReLU unit's zero-gradient entries unmoved
           - every strategy: a 2x2 checkpoint with a DASO exchange in flight resumes on
             2x2 exactly (all replicas) and on 4x1 (state restored, training goes on)
  zeros    the Lion Cub case with the same batch on both replicas, alone
  suite    correct, then nan (strategies named in argv[2], default all)
  nan      (unattached: DASO trained without attach() raises RuntimeError everywhere)
           under each strategy in turn, a NaN gradient on world rank 2 at the third
           batch: every process raises (the failing one DivergenceError, the others
           RemoteError naming it), each within seconds
"""
import datetime
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

import layerpar
from layerpar.ode import blocks
from layerpar.parallel import DASO, Lion, LionCub

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: tolerances
from tolerances import F64  # noqa: E402

TORCH = "MASTER_ADDR" in os.environ and "RANK" in os.environ
if TORCH:
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    comm = dist.group.WORLD
    rank = dist.get_rank()
else:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
torch.set_num_threads(1)
if os.environ.get("LP_DUMP"):
    import faulthandler

    faulthandler.dump_traceback_later(float(os.environ["LP_DUMP"]), exit=True)
EXACT = layerpar.MGRITOptions(max_levels=1)
B = 8


def net(n=8, width=4):
    torch.manual_seed(0)
    return layerpar.ODENet(open=nn.Linear(3, width), steps=lambda k: blocks.Dense(width),
                           n_steps=n, t_final=1.0, close=nn.Linear(width, 5)).double()


def data(step):
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(B, 3, generator=g, dtype=torch.float64),
            torch.randint(0, 5, (B,), generator=g))


def comm_size():
    return dist.get_world_size() if TORCH else comm.Get_size()


def rel(a, b):
    return float((a - b).norm() / max(float(b.norm()), 1e-300))


def train(model, opt, grid, k0, k1, poison=None):
    for k in range(k0, k1):
        x, y = data(k)
        out = model(grid.shard(x) if grid is not None else x)
        loss = nn.functional.cross_entropy(out, grid.shard(y) if grid is not None else y)
        opt.zero_grad()
        loss.backward()
        if poison is not None and poison(k):
            next(iter(model.parameters())).grad.view(-1)[0] = float("nan")
        opt.step()


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def build(R, L, sync, optim, net=net, **kw):
    grid = layerpar.ProcessGrid(comm, data=R, layers=L, sync=sync, **kw)
    model = layerpar.LayerParallel(net(), grid=grid, options=EXACT)
    opt = optim(model.parameters())
    grid.sync.attach(model, opt)
    return grid, model, opt


def close(grid, model):
    model.close()
    grid.close()


def replicas_params(state):
    return [r["model"] for r in state["replicas"]]


def max_rel(sds_a, sds_b):
    return max(rel(a[k], b[k]) for a, b in zip(sds_a, sds_b) for k in a)


def case_daso_equals_allreduce():
    errs = {}
    for R, L in [(2, 2), (4, 1)]:
        got = {}
        for name, sync in [("allreduce", "allreduce"),
                           ("daso", DASO(cycle=(1,), global_dtype=None))]:
            grid, model, opt = build(R, L, sync, sgd, nodes=2)
            train(model, opt, grid, 0, 4 if R == 4 else 6)
            got[name] = replicas_params(grid.sync.state_dict())
            close(grid, model)
        if R == 2:
            got_allreduce_2x2 = got["allreduce"]
        errs[f"{R}x{L}"] = max_rel(got["daso"], got["allreduce"])
    # bfloat16 between nodes: the exchange sends the drift from the last global average,
    # so the rounding is 2^-9 of the drift, not of the parameters (which would be
    # 4e-3 here, 4e-4 with the drift; and would undo small late steps)
    grid, model, opt = build(2, 2, DASO(cycle=(1,)), sgd, nodes=2)
    train(model, opt, grid, 0, 6)
    bf16 = max_rel(replicas_params(grid.sync.state_dict()), got_allreduce_2x2)
    close(grid, model)
    if not (all(v <= F64.converged for v in errs.values()) and bf16 <= 1.5e-3):
        raise AssertionError(f"DASO (S=1) differs from all-reduce: {errs}, bf16 {bf16}")
    return "daso=allreduce " + " ".join(f"{k}:{v:.1e}" for k, v in errs.items()) + \
        f" bf16:{bf16:.1e}"


def case_daso_merge():
    """See the module docstring: the merge computed here from the parameters sent and
    the gradient of the batch trained meanwhile, against DASO's."""
    lr, out = 0.1, []
    for merge in ("progress", "weighted"):
        for R, L in [(2, 2), (4, 1)]:
            grid, model, opt = build(R, L, DASO(cycle=(2,), global_dtype=None, merge=merge),
                                     lambda p: torch.optim.SGD(p, lr=lr), nodes=2)
            train(model, opt, grid, 0, 1)  # batch 0: the exchange starts (S = 2)
            sent = [p.detach().clone() for p in model.parameters()]
            if grid.sync.pending is None or grid.sync.pending["due"] != 1:
                raise AssertionError(f"DASO {merge} {R}x{L}: no exchange in flight")
            mine = grid.world.allgather_object((grid.layer_rank, sent), "sent")
            theirs = [s for q, s in mine if q == grid.layer_rank]
            avg = [sum(s[i] for s in theirs) / R for i in range(len(sent))]
            train(model, opt, grid, 1, 2)  # batch 1: trained, then merged
            local = [s - lr * p.grad for s, p in zip(sent, model.parameters())]
            want = [a + loc - s if merge == "progress" else (2 * loc + a) / 3
                    for a, loc, s in zip(avg, local, sent)]
            err = max(rel(p.detach(), w) for p, w in zip(model.parameters(), want))
            moved = min(rel(p.detach(), a) for p, a in zip(model.parameters(), avg))
            close(grid, model)
            if not (err <= F64.roundoff and moved > 1e-6):
                raise AssertionError(f"DASO merge={merge} on {R}x{L}: {err} from the "
                                     f"hand-computed merge (moved from avg {moved})")
            out.append(f"{merge}:{R}x{L}:{err:.0e}")
    return "daso merge " + " ".join(out)


def case_lioncub():
    # one replica: Lion Cub = plain Lion on the serial net (full batch)
    grid, model, opt = build(1, 4, "lioncub", lambda p: Lion(p, lr=0.01, weight_decay=0.1))
    train(model, opt, grid, 0, 4)
    got = grid.sync.state_dict()["replicas"][0]["model"]
    close(grid, model)
    ref = net()
    ropt = Lion(ref.parameters(), lr=0.01, weight_decay=0.1)
    train(ref, ropt, None, 0, 4)
    err1 = max(rel(got[k], v) for k, v in ref.state_dict().items())
    # two replicas: the step applied is -lr * sign(s_0 + s_1) of the replicas' own signs
    lr = 0.01
    grid, model, opt = build(2, 2, LionCub(momentum_every=0), lambda p: Lion(p, lr=lr))
    before = [p.detach().clone() for p in model.parameters()]
    x, y = data(0)
    loss = nn.functional.cross_entropy(model(grid.shard(x)), grid.shard(y))
    loss.backward()
    mine = [torch.sign(0.1 * p.grad) for p in model.parameters()]  # m = 0: c = (1-b1) g
    allsigns = grid.world.allgather_object((grid.layer_rank, mine), "signs")
    total = [sum(s[i] for q, s in allsigns if q == grid.layer_rank) for i in range(len(mine))]
    opt.step()
    err2 = max(rel(p.detach() - b, -lr * torch.sign(t))
               for p, b, t in zip(model.parameters(), before, total))
    ties = sum(int((t == 0).sum()) for t in total)
    close(grid, model)
    if not (err1 <= F64.converged and err2 <= F64.roundoff and ties > 0):
        raise AssertionError(f"Lion Cub: 1 replica vs Lion {err1}, vote {err2}, ties {ties}")
    return f"lioncub 1x4=lion {err1:.1e} vote {err2:.1e} ({ties} ties)"


def dead_unit_net():
    """`net()` with a ReLU after the opening layer whose unit 0 is dead (weight row 0,
    bias -1): that row's and that bias's gradients are exactly 0 on every batch."""
    torch.manual_seed(0)
    m = layerpar.ODENet(open=nn.Sequential(nn.Linear(3, 4), nn.ReLU()),
                        steps=lambda k: blocks.Dense(4), n_steps=8, t_final=1.0,
                        close=nn.Linear(4, 5)).double()
    with torch.no_grad():
        m.layers[0][0].weight[0] = 0.0
        m.layers[0][0].bias[0] = -1.0
    return m


DEAD = ("layers.0.0.weight", "layers.0.0.bias")  # the dead unit's row and bias: index 0


def case_zeros():
    """Lion Cub with the same (whole) batch on both replicas of a 2 x (size/2) grid is
    plain Lion: parameters equal to all-reduce Lion's on the same grid bitwise, to the
    serial Lion's within F64.converged, and the dead unit's entries (Lion's sign(0) =
    0) never move."""
    R, L, lr, steps = 2, comm_size() // 2, 0.01, 5
    got = {}
    for name, sync in (("lioncub", LionCub(momentum_every=2)), ("allreduce", "allreduce")):
        grid, model, opt = build(R, L, sync, lambda p: Lion(p, lr=lr), net=dead_unit_net)
        train(model, opt, None, 0, steps)  # no shard: every replica the whole batch
        got[name] = replicas_params(grid.sync.state_dict())
        close(grid, model)
    ref = dead_unit_net()
    start = {k: v.clone() for k, v in ref.state_dict().items()}
    train(ref, Lion(ref.parameters(), lr=lr), None, 0, steps)
    want = ref.state_dict()
    same = all(torch.equal(a[k], b[k]) for a, b in zip(got["lioncub"], got["allreduce"])
               for k in a)
    err = max(rel(r[k], v) for r in got["lioncub"] for k, v in want.items())
    moved = max(float((r[k][0] - start[k][0]).abs().max())
                for r in got["lioncub"] + [want] for k in DEAD)
    if not (same and err <= F64.converged and moved == 0.0):
        raise AssertionError(f"Lion Cub with equal batches on {R}x{L}: equal to all-reduce "
                             f"Lion {same}, {err:.1e} from serial Lion, the dead unit "
                             f"(zero gradient) moved {moved:g} (want 0) in {steps} steps "
                             f"at lr {lr}")
    return f"lioncub zeros {R}x{L}=lion {err:.1e} dead moved {moved:g}"


STRATEGIES = {
    "allreduce": (lambda: "allreduce", sgd),
    "daso": (lambda: DASO(cycle=(4, 2, 1)), sgd),
    "lioncub": (lambda: LionCub(momentum_every=2), lambda p: Lion(p, lr=0.01)),
}


def case_resume():
    out = []
    for name, (mk, optim) in STRATEGIES.items():
        grid, model, opt = build(2, 2, mk(), optim, nodes=2)
        train(model, opt, grid, 0, 3)
        saved = grid.sync.state_dict()
        train(model, opt, grid, 3, 6)
        ref = replicas_params(grid.sync.state_dict())
        close(grid, model)
        if name == "daso" and saved["pending"] is None:
            raise AssertionError("the DASO checkpoint was meant to hold an exchange in flight")
        grid, model, opt = build(2, 2, mk(), optim, nodes=2)
        grid.sync.load_state_dict(saved)
        train(model, opt, grid, 3, 6)
        err = max_rel(replicas_params(grid.sync.state_dict()), ref)
        close(grid, model)
        grid, model, opt = build(4, 1, mk(), optim, nodes=2)
        grid.sync.load_state_dict(saved)
        again = grid.sync.state_dict()
        back = max_rel(replicas_params(again), [replicas_params(saved)[d % 2]
                                                for d in range(4)])
        same = (again["batch"], again.get("pos"), again.get("pending") is None) == \
            (saved["batch"], saved.get("pos"), saved.get("pending") is None)
        if name == "daso" and saved["pending"]["avg"] is not None:
            back = max(back, max(rel(again["pending"]["avg"][k], v)
                                 for k, v in saved["pending"]["avg"].items()))
        if name == "daso":  # the parameters as sent, per replica (progress merge)
            sent = saved["pending"]["p_sent"]
            if not sent or len(sent) != 2:
                raise AssertionError("daso: the checkpoint holds no p_sent per replica")
            back = max(back, max(rel(a[k], v) for a, b in zip(
                again["pending"]["p_sent"], [sent[d % 2] for d in range(4)])
                for k, v in b.items()))
        if name == "lioncub":
            back = max(back, max(
                rel(a["optimizer"]["state"][k]["exp_avg"], b["optimizer"]["state"][k]["exp_avg"])
                for a, b in zip(again["replicas"], [saved["replicas"][d % 2] for d in range(4)])
                for k in a["optimizer"]["state"]))
        train(model, opt, grid, 3, 6)
        fin = all(bool(torch.isfinite(v).all()) for sd in replicas_params(
            grid.sync.state_dict()) for v in sd.values())
        close(grid, model)
        if not (err <= F64.converged and back == 0.0 and same and fin):
            raise AssertionError(f"{name}: resumed 2x2 differs {err}, 4x1 state {back} "
                                 f"{same}, finite {fin}")
        out.append(f"{name} {err:.1e}")
    return "resume " + " ".join(out)


def case_daso_cooldown():
    """With Adam, the replicas leave DASO's cool-down equal (entering it averages the
    optimizer's state as well as the parameters: with the parameters alone each replica
    kept its own moments and the replicas ended 2-3e-2 apart); and they were apart
    before it (asynchronous exchanges, so the check can fail)."""
    out = []
    for R, L in ((2, 2), (4, 1)):
        grid, model, opt = build(R, L, DASO(cycle=(2,), total_batches=8, cooldown=2,
                                            global_dtype=None),
                                 lambda p: torch.optim.Adam(p, lr=1e-2), nodes=2)
        train(model, opt, grid, 0, 5)
        before = replicas_params(grid.sync.state_dict())
        train(model, opt, grid, 5, 8)
        after = replicas_params(grid.sync.state_dict())
        close(grid, model)
        apart = max(rel(r[k], before[0][k]) for r in before[1:] for k in r)
        equal = max(rel(r[k], after[0][k]) for r in after[1:] for k in r)
        if not (apart > 1e-6 and equal == 0.0):
            raise AssertionError(f"DASO cool-down {R}x{L} with Adam: replicas {apart:.1e} "
                                 f"apart before it, {equal:.1e} after it (want 0)")
        out.append(f"{R}x{L} {apart:.0e}->{equal:.0e}")
    return "daso cooldown " + " ".join(out)


def case_correct():
    return " | ".join(f() for f in (case_daso_equals_allreduce, case_daso_merge,
                                    case_daso_cooldown, case_lioncub, case_zeros,
                                    case_resume))


def case_nan():
    out = []
    names = sys.argv[2].split(",") if len(sys.argv) > 2 else list(STRATEGIES)
    for name in names:
        t0 = time.perf_counter()
        try:
            if name == "unattached":  # DASO without attach(): the first backward raises
                grid = layerpar.ProcessGrid(comm, data=2, layers=2, sync="daso", nodes=2,
                                            timeout=60)
                model = layerpar.LayerParallel(net(), grid=grid, options=EXACT)
                train(model, sgd(model.parameters()), grid, 0, 1)
                raise AssertionError("training without attach() went on")
            mk, optim = STRATEGIES[name]
            grid, model, opt = build(2, 2, mk(), optim, nodes=2, timeout=60)
            t0 = time.perf_counter()
            train(model, opt, grid, 0, 8, poison=lambda k: k == 2 and rank == 2)
            res = "no error"
        except Exception as exc:  # noqa: BLE001 - reported
            res = f"{type(exc).__name__}"
        out.append(f"{name}={res}@{time.perf_counter() - t0:.1f}s")
        print(f"rank {rank} {out[-1]}", file=sys.stderr, flush=True)
    return " ".join(out)


def case_suite():
    """correct, then nan (under torch.distributed a failure leaves the process group
    unusable for further collectives, so nan comes last)."""
    return f"{case_correct()} || {case_nan()}"


if __name__ == "__main__":
    case = sys.argv[1]
    try:
        detail = globals()[f"case_{case}"]()
        print(f"RANK {rank} OK {detail}", flush=True)
    except Exception as exc:  # noqa: BLE001 - reported for the test
        print(f"RANK {rank} {type(exc).__name__}: {exc}", flush=True)
        sys.exit(1)
