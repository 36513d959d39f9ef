"""Worker: what users write, through the data-parallel and pipeline methods and
`choose_method` (mpi4py; the pipeline initialises gloo from the communicator).

Every case prints ``RANK <r> CASE <case>/<method> <verdict>`` lines, then ``RANK <r>
DONE``.  Verdicts: ``OK <max relative error against serial training>``, ``RAISED
<type>: <message>``, ``STREAMS <digest of the CPU generator>`` (the same on every rank
when the ranks' random streams are in step).

- tied: a weight shared by the first and the last layer, and one block module for
  every step of a segment: data parallelism trains as serial; the pipeline refuses.
- reload: `load_state_dict(..., assign=True)` between steps, then layer 0 frozen at
  the start and unfrozen later: data parallelism (both engines) follows, as serial.
- losses: a sum, class weights, rows ignored (ignore_index), label smoothing: data
  parallelism (both engines) and a pipeline of one micro-batch train as serial; a
  pipeline of 2 micro-batches refuses all but label smoothing (a mean over the rows).
- ragged: batches of 7, 7 and 5 rows (shares of unequal rows, weighted): data
  parallelism trains as serial; batches of 8, 6 and 7 rows through a pipeline of 4
  micro-batches, every schedule (fewer micro-batches where 4 do not divide): as serial.
- bn: batch norm under data parallelism: after training, every rank's state dict and
  evaluation are the same (rank 0's running statistics).
- clip: gradients clipped to a norm each step (`method.clip_grad_norm_`): the
  pipeline's ranks combine their stages' parts; as serial.
- streams: nn.Dropout on stage 0, three steps of each method, then the CPU generator's
  digest (in step on every rank); a block drawing torch.rand itself: the pipeline
  refuses it; `choose_method` on a dropout net leaves the generators as they were.
"""
import hashlib
import sys
from pathlib import Path

import torch
from mpi4py import MPI
from torch import nn

import layerpar
from layerpar.ode import blocks
from layerpar.ode.net import Segment
from layerpar.parallel import choose_method
from layerpar.parallel.baselines import (
    SCHEDULES,
    DataParallelNet,
    PipelineNet,
    SoloMethod,
    process_group_from_mpi,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: tolerances
from tolerances import F64  # noqa: E402

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
torch.set_num_threads(1)
W, B = 4, 8
CE = nn.functional.cross_entropy
GROUP = None


def group():
    global GROUP
    if GROUP is None:
        GROUP = process_group_from_mpi(comm)
    return GROUP


def say(case, method, verdict):
    print(f"RANK {rank} CASE {case}/{method} {verdict}", flush=True)


def net(kind="plain"):
    torch.manual_seed(0)
    first, last = nn.Linear(3, W), nn.Linear(W, 5)

    def step(k):
        return blocks.Dense(W)
    if kind == "tied":  # a square layer before the segment and one after, one weight
        a, b = nn.Linear(W, W), nn.Linear(W, W)
        b.weight = a.weight
        return layerpar.ODENet(layers=[first, a, Segment(step, 8, 1.0), b, last]).double()
    if kind == "shared":
        one = blocks.Dense(W)

        def step(k):
            return one
    if kind == "dropout":
        first = nn.Sequential(nn.Linear(3, W), nn.Dropout(0.3))
    if kind == "rand":
        class Noisy(nn.Module):
            def forward(self, x):
                return x + 0.01 * torch.rand_like(x)
        first = nn.Sequential(nn.Linear(3, W), Noisy())
    if kind == "counter":  # counts its forward calls in a buffer
        class Counter(nn.Linear):
            def __init__(self):
                super().__init__(3, W)
                self.register_buffer("calls", torch.zeros(()))

            def forward(self, x):
                self.calls += 1
                return super().forward(x)
        first = Counter()
    if kind == "spectral":  # its power iteration updates buffers in forward
        from torch.nn.utils.parametrizations import spectral_norm
        first = spectral_norm(nn.Linear(3, W))
    if kind == "shared04":  # blocks 0 and 4: one rank's two stages when looped at 2 ranks
        one = blocks.Dense(W)

        def step(k):
            return one if k in (0, 4) else blocks.Dense(W)
    return layerpar.ODENet(layers=[first, nn.Tanh(), Segment(step, 8, 1.0), last]).double()


def data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(B, 3, generator=g, dtype=torch.float64),
             torch.randint(0, 5, (B,), generator=g)) for _ in range(4)]


def serial_run(n, loss=CE, between=None, clip=None):
    """Serial training of `n` (three SGD steps; `between(n, k)` before step k; the
    gradients clipped to norm `clip`)."""
    opt = torch.optim.SGD(n.parameters(), lr=0.1)
    for k, (x, y) in enumerate(data()[:3]):
        if between is not None:
            opt = between(n, k) or opt
        opt.zero_grad()
        loss(n(x), y).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(n.parameters(), clip)
        opt.step()
    return {k: v.detach().clone() for k, v in n.state_dict().items()}


def method_run(m, loss=CE, between=None, clip=None):
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for k, (x, y) in enumerate(data()[:3]):
        if between is not None and between(m.net, k):
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
        m.train_step(x, y, loss)
        if clip is not None:
            m.clip_grad_norm_(clip)
        opt.step()
    return m.gather_state_dict()


def error(a, b):
    return max(float((a[k].double() - b[k].double()).norm() / max(b[k].double().norm(), 1e-300))
               for k in b)


def attempt(case, name, build, loss=CE, between=None, serial=None, clip=None):
    try:
        m = build()
        try:
            got = method_run(m, loss, between, clip)
        finally:
            m.close()
        err = error(got, serial)
        say(case, name, f"OK {err:.3g}" if err <= F64.roundoff else f"WRONG {err:.3g}")
    except Exception as exc:  # noqa: BLE001
        say(case, name, f"RAISED {type(exc).__name__}: {str(exc)[:160]}")


def case_tied():
    for kind in ("tied", "shared"):
        ref = serial_run(net(kind))
        attempt(kind, "data", lambda kind=kind: DataParallelNet(net(kind), comm), serial=ref)
        attempt(kind, "pipeline", lambda kind=kind: PipelineNet(
            net(kind), group(), schedule="gpipe", microbatches=2), serial=ref)


def case_reload():
    path = Path(f"/tmp/lp_baseline_users_{comm.bcast(str(id(comm)), 0)}.pt")
    if rank == 0:
        torch.save(net().state_dict(), path)
    comm.Barrier()

    def reload(n, k):
        if k == 1:
            n.load_state_dict(torch.load(path), assign=True)
            return True

    ref = serial_run(net(), between=lambda n, k: torch.optim.SGD(n.parameters(), lr=0.1)
                     if reload(n, k) else None)
    for engine in ("allreduce", "ddp"):
        attempt("reload", engine, lambda engine=engine: DataParallelNet(
            net(), group() if engine == "ddp" else comm, engine=engine),
            between=reload, serial=ref)

    def unfreeze(n, k):
        if k in (0, 2):
            for p in n.layers[0].parameters():
                p.requires_grad_(k == 2)
            return True

    ref = serial_run(net(), between=lambda n, k: torch.optim.SGD(
        [p for p in n.parameters() if p.requires_grad], lr=0.1) if unfreeze(n, k) else None)
    for engine in ("allreduce", "ddp"):
        attempt("unfreeze", engine, lambda engine=engine: DataParallelNet(
            net(), group() if engine == "ddp" else comm, engine=engine),
            between=unfreeze, serial=ref)
    comm.Barrier()
    if rank == 0:
        path.unlink()


LOSSES = {  # a loss that is not a mean over the rows, by kind; and one that is
    "sum": lambda o, t: CE(o, t, reduction="sum"),
    "weighted": lambda o, t: CE(o, t, weight=torch.arange(1.0, 6.0, dtype=o.dtype)),
    "ignored": lambda o, t: CE(o, torch.where(t == 0, -100, t)),  # (class 0's rows)
    "smoothed": lambda o, t: CE(o, t, label_smoothing=0.1),
}


def case_losses():
    for kind, loss in LOSSES.items():
        ref = serial_run(net(), loss)
        attempt(kind, "data", lambda: DataParallelNet(net(), comm), loss, serial=ref)
        attempt(kind, "ddp", lambda: DataParallelNet(net(), group(), engine="ddp"), loss,
                serial=ref)
        attempt(kind, "pipeline-m2", lambda: PipelineNet(net(), group(), schedule="gpipe",
                                                        microbatches=2), loss, serial=ref)
        attempt(kind, "pipeline-m1", lambda: PipelineNet(net(), group(), schedule="gpipe",
                                                        microbatches=1), loss, serial=ref)


def case_clip():
    ref = serial_run(net(), clip=0.05)
    attempt("clip", "data", lambda: DataParallelNet(net(), comm), serial=ref, clip=0.05)
    for schedule in ("gpipe", "interleaved"):
        attempt("clip", schedule, lambda schedule=schedule: PipelineNet(
            net(), group(), schedule=schedule, microbatches=2), serial=ref, clip=0.05)


def case_optstate():
    """Two SGD-momentum steps, rank 0's ``optimizer.state_dict()`` loaded into a new
    optimizer on every rank (the DistributedDataParallel habit), one more step: right
    for data parallelism (every rank holds the whole net), refused for a pipeline
    (each rank holds its stages), on every rank."""
    def run(m):
        batches = data()
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        for x, y in batches[:2]:
            opt.zero_grad()
            m.train_step(x, y, CE)
            opt.step()
        state = comm.bcast(opt.state_dict() if rank == 0 else None, root=0)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        opt.load_state_dict(state)
        opt.zero_grad()
        m.train_step(*batches[2], CE)
        opt.step()
        m.train_step(*batches[3], CE)  # (a rank that refused tells the others)

    for name, build in (("data", lambda: DataParallelNet(net(), comm)),
                        ("pipeline", lambda: PipelineNet(net(), group(), schedule="gpipe",
                                                         microbatches=2))):
        m = build()
        try:
            run(m)
            say("optstate", name, "RAN")
        except Exception as exc:  # noqa: BLE001
            said = "REFUSED" if "was loaded from the optimizer of rank 0 of" in str(exc) \
                else f"RAISED {type(exc).__name__}: {str(exc)[:160]}"
            say("optstate", name, said)
        finally:
            m.close()


def case_bn():
    def bn_net():
        torch.manual_seed(0)
        return layerpar.ODENet(layers=[nn.Linear(3, W), nn.BatchNorm1d(W), nn.Tanh(),
                                       Segment(lambda k: blocks.Dense(W), 8, 1.0),
                                       nn.Linear(W, 5)]).double()
    x = data()[3][0]
    for engine in ("allreduce", "ddp"):
        m = DataParallelNet(bn_net(), group() if engine == "ddp" else comm, engine=engine)
        method_run(m)
        state = m.gather_state_dict()
        out = m.eval().eval_forward(x)
        m.close()
        seen = hashlib.sha1(b"".join(v.numpy().tobytes() for v in state.values())
                            + out.numpy().tobytes()).hexdigest()[:8]
        say("bn", engine, f"STATE {seen}")


def ragged_run(sizes):
    """Serial SGD over batches of `sizes` rows: the batches and the final state."""
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(n, 3, generator=g, dtype=torch.float64),
                torch.randint(0, 5, (n,), generator=g)) for n in sizes]
    n = net()
    opt = torch.optim.SGD(n.parameters(), lr=0.1)
    for x, y in batches:
        opt.zero_grad()
        CE(n(x), y).backward()
        opt.step()
    return batches, n.state_dict()


def trained(case, name, build, batches, ref, loss_of=lambda m: CE):
    """Say how `build()`'s method, trained by SGD over `batches` with the loss
    `loss_of(method)`, compares with the state `ref` (or what it raised)."""
    try:
        m = build()
        try:
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            for x, y in batches:
                m.train_step(x, y, loss_of(m))
                opt.step()
            err = error(m.gather_state_dict(), ref)
        finally:
            m.close()
        say(case, name, f"OK {err:.3g}" if err <= F64.roundoff else f"WRONG {err:.3g}")
    except Exception as exc:  # noqa: BLE001
        say(case, name, f"RAISED {type(exc).__name__}: {str(exc)[:160]}")


def ragged_attempt(name, build, sizes):
    trained("ragged", name, build, *ragged_run(sizes))


def case_ragged():
    for engine in ("allreduce", "ddp"):
        ragged_attempt(engine, lambda engine=engine: DataParallelNet(
            net(), group() if engine == "ddp" else comm, engine=engine), (7, 7, 5))
    # 4 micro-batches asked; 6 rows run as 3 (1F1B at 4 ranks: as GPipe), 7 as 1
    for schedule in SCHEDULES:
        ragged_attempt(schedule, lambda schedule=schedule: PipelineNet(
            net(), group(), schedule=schedule, microbatches=4), (8, 6, 7))


def digest():
    return hashlib.sha1(torch.get_rng_state().numpy().tobytes()).hexdigest()[:8]


def case_streams():
    for name, build in (("data", lambda: DataParallelNet(net("dropout"), comm)),
                        ("pipeline", lambda: PipelineNet(net("dropout"), group(),
                                                         schedule="1f1b", microbatches=2))):
        torch.manual_seed(5)
        m = build()
        masks = []  # (this rank's dropout masks, where its stages or share hold them)
        drop = m.net.layers[0][1]
        hook = drop.register_forward_hook(lambda mod, i, o, masks=masks: masks.append(o == 0))
        for x, y in data()[:3]:
            m.train_step(x, y, CE)
        hook.remove()
        m.close()
        mine = torch.cat(masks).flatten() if masks else torch.zeros(0, dtype=torch.bool)
        every = comm.allgather(mine)
        # data parallelism: each rank's share masked by its own draws, not one mask
        # repeated on every share (4 x 4 masks of p = 0.3, three steps)
        distinct = all(not torch.equal(every[0], e) for e in every[1:])
        say("streams", name, f"STREAMS {digest()} distinct={distinct}")
    attempt("streams", "rand", lambda: PipelineNet(net("rand"), group(), schedule="gpipe",
                                                   microbatches=2), serial={})
    n, (x, y) = net("dropout"), data()[0]
    before = digest()
    m = choose_method(n, comm, x, y, CE, steps=1, microbatches=(1, 2))
    m.close()
    say("streams", "choose", f"STREAMS {digest()} kept={digest() == before}")


def case_stages():
    ref = serial_run(net("counter"))
    for m in (1, 2):
        attempt("stages", f"counter-m{m}", lambda m=m: PipelineNet(
            net("counter"), group(), schedule="gpipe", microbatches=m), serial=ref)
    attempt("stages", "spectral-m2", lambda: PipelineNet(
        net("spectral"), group(), schedule="gpipe", microbatches=2), serial={})
    attempt("stages", "shared04", lambda: PipelineNet(
        net("shared04"), group(), schedule="interleaved", microbatches=2), serial={})
    ref = serial_run(net(), lambda o, t: CE(o, torch.where(torch.arange(len(t)) < 4, -100, t)))
    attempt("stages", "ignored-part", lambda: PipelineNet(net(), group(), schedule="gpipe",
                                                          microbatches=2),
            lambda o, t: CE(o, torch.where(torch.arange(len(t)) < 4, -100, t)), serial=ref)


def case_penalty():
    """A loss with a penalty on the net's own parameters (each method's copy)."""
    def penalised(n):
        return lambda o, t: CE(o, t) + 0.05 * sum((p ** 2).sum() for p in n.parameters())
    n = net()
    ref = serial_run(n, penalised(n))
    for name, build in (("data", lambda: DataParallelNet(net(), comm)),
                        ("ddp", lambda: DataParallelNet(net(), group(), engine="ddp")),
                        ("pipeline", lambda: PipelineNet(net(), group(), schedule="gpipe",
                                                         microbatches=1))):
        trained("penalty", name, build, data()[:3], ref, lambda m: penalised(m.net))


def case_usage():
    """Inputs and calls a method refuses by name: an input that requires grad, targets
    the pipeline cannot cut, autocast around a pipeline, a closed method; and
    `eval_forward` of a dropout pipeline in training mode keeps the generators in step."""
    x, y = data()[0]
    calls = {
        "grad-x/data": lambda: DataParallelNet(net(), comm).train_step(
            x.clone().requires_grad_(), y, CE),
        "grad-x/pipeline": lambda: PipelineNet(net(), group(), schedule="gpipe",
                                               microbatches=2).train_step(
            x.clone().requires_grad_(), y, CE),
        "tuple-y/pipeline": lambda: PipelineNet(net(), group(), schedule="gpipe",
                                                microbatches=1).train_step(
            x, (y,), lambda o, t: CE(o, t[0])),
        "closed/data": lambda: closed(DataParallelNet(net(), comm)).train_step(x, y, CE),
        "closed/pipeline": lambda: closed(PipelineNet(net(), group())).train_step(x, y, CE),
    }

    def autocast():
        m = PipelineNet(net().float(), group(), schedule="gpipe", microbatches=2)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            m.train_step(x.float(), y, CE)
    calls["autocast/pipeline"] = autocast
    for name, call in calls.items():
        try:
            call()
            say("usage", name, "NORAISE")
        except Exception as exc:  # noqa: BLE001
            say("usage", name, f"RAISED {type(exc).__name__}: {str(exc)[:160]}")
    torch.manual_seed(5)
    m = PipelineNet(net("dropout"), group(), schedule="gpipe", microbatches=2)
    for _ in range(2):
        m.eval_forward(x)
    m.close()
    say("usage", "eval-dropout", f"STREAMS {digest()}")


def case_failure():
    """A failure on one rank inside a step (a block raising in forward or in backward
    there, caught by the user): every rank raises its message within seconds (the
    failing rank its own exception, the others RemoteError naming it), later calls
    raise that the method stopped, and the user's group and communicator still work.
    Verdicts ``STOPPED <message> | <later call's error type> | <prompt or SLOW>``."""
    import time

    from layerpar.mgrit.errors import RemoteError

    def armed(m, where, who):
        """`m`'s Dense blocks raise on rank `who` in `where` ("forward", "backward")."""
        def forward_hook(mod, inp, out):
            if rank == who:
                if where == "forward":
                    raise RuntimeError(f"boom in forward on rank {who}")
                if out.requires_grad:  # (not in the pipeline's shape probe)
                        out.register_hook(lambda g: (_ for _ in ()).throw(
                        RuntimeError(f"boom in backward on rank {who}")))
        for mod in m.net.modules():
            if isinstance(mod, blocks.Dense):
                mod.register_forward_hook(forward_hook)
        return m

    def penalised(m):
        return lambda o, t: CE(o, t) + 0.05 * sum((p ** 2).sum() for p in m.parameters())

    x, y = data()[0]
    last = size - 1
    builds = {f"{engine}/{where}": (lambda e=engine, w=where: armed(DataParallelNet(
        net(), comm if e == "allreduce" else group(), engine=e), w, last), CE)
        for engine in ("allreduce", "ddp") for where in ("forward", "backward")}
    for name in SCHEDULES:
        mb = 2 * size if name in ("1f1b", "zbv") else 2
        builds[f"{name}/forward"] = (lambda n=name, mb=mb: armed(PipelineNet(
            net(), group(), schedule=n, microbatches=mb), "forward", last), CE)
    builds["gpipe/backward"] = (lambda: armed(PipelineNet(
        net(), group(), schedule="gpipe", microbatches=2), "backward", 0), CE)
    for name in ("zero-bubble", "zbv"):
        builds[f"{name}/penalty"] = (lambda n=name: PipelineNet(
            net(), group(), schedule=n, microbatches=2 * size), penalised)
    builds["solo/forward"] = (lambda: armed(SoloMethod(net(), comm), "forward", 0), CE)
    builds["eval/pipeline"] = (lambda: armed(PipelineNet(
        net(), group(), schedule="gpipe", microbatches=2), "forward", last), None)
    for name, (build, loss) in builds.items():
        m = build()
        start = time.monotonic()
        try:
            if loss is None:
                m.eval_forward(x)
            else:
                m.train_step(x, y, loss(m) if loss is penalised else loss)
            say("failure", name, "NORAISE")
            continue
        except BaseException as exc:  # noqa: BLE001
            text = exc.remote_message if isinstance(exc, RemoteError) else \
                f"{type(exc).__name__}: {exc}"
        took = time.monotonic() - start
        try:
            m.train_step(x, y, CE)
            later = "NORAISE"
        except Exception as exc:  # noqa: BLE001
            later = f"{type(exc).__name__} {'stopped' in str(exc)}"
        m.close()
        say("failure", name, f"STOPPED {text[:90]} | {later} | "
            f"{'prompt' if took < 20 else 'SLOW'}")
    whole = torch.ones(1)
    torch.distributed.all_reduce(whole, group=group())
    say("failure", "world", f"SUM {whole.item():g} {comm.allreduce(1)}")


def case_stall():
    """A stage whose forward outlasts the method's `timeout` once (the last rank sleeps
    in its first micro-batch): the schedule's receives on the other ranks wait in
    torch's own messages, in the method's own group, whose timeout is the method's, so
    every rank raises the timeout within seconds of it instead of waiting for the
    stage.  Verdict ``STOPPED <message> | <seconds to raise, rounded down, by rank 0's
    clock>``."""
    import time

    from layerpar.mgrit.errors import RemoteError

    x, y = data()[0]
    last = size - 1
    slept = []

    def slow(mod, inp, out):
        if rank == last and out.requires_grad and not slept:  # (not the shape probe)
            slept.append(1)
            time.sleep(9)
    for name in ("gpipe", "1f1b"):
        m = PipelineNet(net(), group(), schedule=name, microbatches=2 * size, timeout=3)
        slept.clear()
        for mod in m.net.modules():
            if isinstance(mod, blocks.Dense):
                mod.register_forward_hook(slow)
        start = time.monotonic()
        try:
            m.train_step(x, y, CE)
            text = "NORAISE"
        except BaseException as exc:  # noqa: BLE001
            text = exc.remote_message if isinstance(exc, RemoteError) else \
                f"{type(exc).__name__}: {exc}"
        took = comm.bcast(time.monotonic() - start, root=0)
        m.close()
        comm.Barrier()  # (rank 0 holds the rendezvous store: it waits for the sleeper)
        said = "gloo timed out" if "Timed out" in text else " ".join(text.split())[:90]
        say("stall", name, f"STOPPED {said} | {int(took)}")


def case_late():
    """A failure posted after a collective this rank took part in was finished by every
    rank, read before this rank saw the collective done (descheduled: its work reports
    unfinished until the transport has read the failure): the collective returns its result,
    and the next wait, which the failed rank never joins, raises the failure.
    Verdicts ``GOT <the gathered ranks>`` and ``NEXT <what the next wait raised>``."""
    import torch.distributed as dist

    from layerpar.mgrit.errors import RemoteError
    from layerpar.mgrit.transport import make_transport
    from layerpar.mgrit.transport.torchdist import sever

    group()  # (torch.distributed initialised from the communicator)
    t = make_transport(dist.new_group(list(range(size))))
    gather = dist.all_gather

    class Unseen:  # the work as a rank descheduled until the failure was posted sees it
        def __init__(self, work):
            self.work = work

        def is_completed(self):  # (unfinished until the transport has read the failure)
            return self.work.is_completed() and t.errors.broken is not None

        def wait(self, *args):
            return self.work.wait(*args)

    calls = []

    def late_gather(*a, **k):  # allgather_object's second gather (its bytes)
        calls.append(1)
        work = gather(*a, **k)
        return Unseen(work) if len(calls) == 2 else work
    if rank:
        dist.all_gather = late_gather
    try:
        got = t.allgather_object(rank, "the ranks")
    except RemoteError as exc:
        got = f"RAISED {exc.remote_message}"
    dist.all_gather = gather
    say("late", "gathered", f"GOT {got}")
    if rank == 0:
        t.stopped_by(RuntimeError("late failure on rank 0"))
        say("late", "next", f"NEXT {t.failure.remote_message}")  # (what it posted)
    else:
        try:
            t.allgather_object(rank, "a gather rank 0 never joins")
            say("late", "next", "NEXT NORAISE")
        except RemoteError as exc:
            say("late", "next", f"NEXT {exc.remote_message}")
    sever(t.group)  # (ends the gather rank 0 never joined)
    comm.Barrier()


def closed(m):
    m.close()
    return m


if __name__ == "__main__":
    {"tied": case_tied, "reload": case_reload, "losses": case_losses, "clip": case_clip,
     "optstate": case_optstate, "bn": case_bn, "ragged": case_ragged,
     "streams": case_streams, "stages": case_stages,
     "penalty": case_penalty, "usage": case_usage, "failure": case_failure,
     "late": case_late, "stall": case_stall}[sys.argv[1]]()
    print(f"RANK {rank} DONE", flush=True)
