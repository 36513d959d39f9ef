"""LayerParallel on a CUDA device (skipped without one; `make bench-gpu` runs these).

CUDA results equal CPU results to float32 round-off, and a fixed-iteration training
step with `check_finite=False` makes no host-device synchronisation at all.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch

import layerpar
from layerpar import MGRITOptions
from layerpar.ode import Segment, blocks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
FIXED = (MGRITOptions(max_levels=3, cfactor=4, max_iter=2, tol=0.0),
         MGRITOptions(max_levels=3, cfactor=4, max_iter=1, tol=0.0))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double().cpu() - b.double().cpu()).norm() / b.double().norm())


def nets() -> dict:
    return {
        "dense": (lambda: layerpar.ODENet(open=torch.nn.Linear(8, 16),
                                          steps=lambda k: blocks.Dense(16), n_steps=64,
                                          t_final=4.0, close=torch.nn.Linear(16, 5)),
                  (32, 8)),
        "conv": (lambda: layerpar.ODENet(layers=[
            torch.nn.Conv2d(3, 8, 3, padding=1), Segment(lambda k: blocks.Conv(8), 64, 4.0),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 5)]),
            (8, 3, 16, 16)),
    }


@pytest.mark.parametrize("name", ["dense", "conv"])
def test_cuda_equals_cpu(name: str) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    make, shape = nets()[name]
    torch.manual_seed(0)
    net = make()
    x, y = torch.randn(*shape), torch.randint(0, 5, (shape[0],))
    got = {}
    for dev in ("cpu", "cuda"):
        model = layerpar.LayerParallel(copy.deepcopy(net).to(dev), None, *FIXED,
                                       batched=True)
        assert model._runners[1].vectorised is not None
        xp = x.detach().clone().to(dev).requires_grad_()
        out = model(xp)
        torch.nn.functional.cross_entropy(out, y.to(dev)).backward()
        got[dev] = (out.detach(), xp.grad, {n: p.grad for n, p in model.named_parameters()})
    assert rel(got["cuda"][0], got["cpu"][0]) <= 1e-5
    assert rel(got["cuda"][1], got["cpu"][1]) <= 1e-5
    for n in got["cpu"][2]:
        assert rel(got["cuda"][2][n], got["cpu"][2][n]) <= 1e-4, n


def test_fixed_iteration_training_step_does_not_synchronise() -> None:
    make, shape = nets()["dense"]
    torch.manual_seed(0)
    model = layerpar.LayerParallel(make().cuda(), None, *FIXED, check_finite=False)
    x, y = torch.randn(*shape, device="cuda"), torch.randint(0, 5, (shape[0],), device="cuda")
    opt = torch.optim.SGD(model.parameters(), lr=0.01, foreach=True)

    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    step()  # first pass: shape checks and the vmap probe read values back, once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    hist = model.last_forward[0].residual_history  # read back now, on request
    assert len(hist) == 1 and hist[0] > 0


def test_captured_step_trains_like_the_eager_step() -> None:
    from layerpar.parallel import capture_step

    make, shape = nets()["dense"]
    torch.manual_seed(0)
    net = make().cuda()
    x, y = torch.randn(*shape, device="cuda"), torch.randint(0, 5, (shape[0],), device="cuda")
    losses = {}
    for mode in ("eager", "captured"):
        model = layerpar.LayerParallel(copy.deepcopy(net), None, *FIXED, check_finite=False)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, foreach=True)
        if mode == "eager":
            out = []
            for _ in range(6):
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                out.append(float(loss))
        else:
            step = capture_step(model, opt, torch.nn.functional.cross_entropy, x, y, warmup=3)
            out = []
            for _ in range(3):
                out.append(float(step(x, y)))
        losses[mode] = out
    # the 3 warm-up steps are eager; replays 4..6 continue the same training
    for a, b in zip(losses["eager"][3:], losses["captured"]):
        assert abs(a - b) <= 1e-5 * abs(a), losses
    with pytest.raises(ValueError, match="captured for"):
        step(x[:3], y[:3])


def test_auto_captured_step_trains_like_its_setting_eagerly() -> None:
    """Auto's setting captured (`AutoCapturedStep`): replays continue the training as
    eager steps of a plain model with the same fixed settings would; a change of the
    controller's iterations captures again."""
    from layerpar.parallel import AutoCapturedStep
    from layerpar.parallel.capture import fixed_settings

    make, shape = nets()["dense"]
    torch.manual_seed(0)
    net = make().cuda()
    x, y = torch.randn(*shape, device="cuda"), torch.randint(0, 5, (shape[0],), device="cuda")
    ce = torch.nn.functional.cross_entropy
    model = layerpar.LayerParallel(net, None, "auto")
    model.tune(x, y, ce)
    chosen, fwd, bwd = fixed_settings(model)
    reference = copy.deepcopy(net)
    plain = chosen.like(net=reference, options=fwd, backward_options=bwd, accuracy=None,
                        check_finite=False)
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(1e-2, device="cuda"),
                           capturable=True)
    ref_opt = torch.optim.Adam(plain.parameters(), lr=torch.tensor(1e-2, device="cuda"),
                               capturable=True)
    step = AutoCapturedStep(model, opt, ce, x, y, warmup=3)
    assert step.captured, step.why_eager
    ref = []
    for _ in range(6):
        ref_opt.zero_grad(set_to_none=True)
        loss = ce(plain(x), y)
        loss.backward()
        ref_opt.step()
        ref.append(float(loss))
    got = [float(step(x, y)) for _ in range(3)]
    for a, b in zip(ref[3:], got):  # the 3 warm-up steps were eager
        assert abs(a - b) <= 1e-5 * abs(a), (ref, got)
    if model.accuracy.controller is not None:  # MGRIT chosen: its controller can move it
        model.accuracy.fwd_iters += 1
        assert step.refresh(x, y) and step.captures == 2 and step.captured
    step.close()
    model.close()


def test_captured_training_loop_does_not_synchronise() -> None:
    """``layerpar train``'s loop over captured replays (`_captured_steps`: batches
    gathered on the device, the schedule's step, the replay, each step's time as CUDA
    events) waits for the GPU nowhere after the epoch's first batch, which sends the
    epoch's indices in one copy; the events time every step once read."""
    from layerpar.apps.loop import Batches
    from layerpar.apps.train import _captured_steps
    from layerpar.parallel import capture_step
    from layerpar.parallel.timing import SpanTimer

    make, shape = nets()["dense"]
    torch.manual_seed(0)
    model = layerpar.LayerParallel(make().cuda(), None, *FIXED, check_finite=False)
    x = torch.randn(4 * shape[0], shape[1], device="cuda")
    y = torch.randint(0, 5, (4 * shape[0],), device="cuda")
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(1e-2, device="cuda"),
                           capturable=True)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=8)
    step = capture_step(model, opt, torch.nn.functional.cross_entropy, x[:shape[0]],
                        y[:shape[0]])
    loader = Batches(x, y, batch_size=shape[0], generator=torch.Generator().manual_seed(0))
    timer = SpanTimer(torch.device("cuda"))
    steps = _captured_steps(step, loader, schedule, None, timer)
    first = next(steps)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rest = list(steps)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    seconds, count = timer.total()
    assert len(rest) == 3 and count == 4 and seconds > 0
    assert all(torch.isfinite(s.loss) for s in (first, *rest))


@pytest.mark.parametrize("levels", [1, 3])
def test_capture_after_eager_steps_on_the_default_stream(levels: int) -> None:
    """A user's eager steps before the capture (and auto's tuning, which runs
    eagerly): the parameters' AccumulateGrad nodes they made on the default stream
    must not outlive them, or the captured backward makes the default stream wait on
    the capturing one (`cudaErrorStreamCaptureImplicit`: on the H100 and the H200 the
    nodes were kept by direct mode's states in the engine, by another model's cache
    and by a reference cycle in the plain layers' records)."""
    from layerpar.parallel import capture_step

    make, shape = nets()["dense"]
    torch.manual_seed(0)
    opts = (MGRITOptions(max_levels=1, tol=0.0),) * 2 if levels == 1 else FIXED
    net = make().cuda()
    model = layerpar.LayerParallel(net, None, *opts, check_finite=False)
    other = model.like()  # another model over the same parameters, trained too
    x, y = torch.randn(*shape, device="cuda"), torch.randint(0, 5, (shape[0],), device="cuda")
    ce = torch.nn.functional.cross_entropy
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(1e-2, device="cuda"),
                           capturable=True)
    for m in (model, other, model):
        opt.zero_grad(set_to_none=True)
        ce(m(x), y).backward()
        opt.step()
    step = capture_step(model, opt, ce, x, y)
    losses = [float(step(x, y)) for _ in range(3)]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses
    other.close()
    model.close()


def test_capture_refuses_what_a_graph_cannot_do() -> None:
    from layerpar.parallel import capture_step

    make, shape = nets()["dense"]
    x, y = torch.randn(*shape, device="cuda"), torch.randint(0, 5, (shape[0],), device="cuda")
    ce = torch.nn.functional.cross_entropy
    tol = MGRITOptions(max_levels=3, cfactor=4, max_iter=5, tol=1e-6)
    model = layerpar.LayerParallel(make().cuda(), None, tol, FIXED[1], check_finite=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(ValueError, match="`options` has tol=1e-06"):
        capture_step(model, opt, ce, x, y)
    model = layerpar.LayerParallel(make().cuda(), None, *FIXED)
    with pytest.raises(ValueError, match="check_finite"):
        capture_step(model, torch.optim.SGD(model.parameters(), lr=0.01), ce, x, y)
    model = layerpar.LayerParallel(make().cuda(), None, *FIXED, check_finite=False)
    with pytest.raises(ValueError, match="`x` must be a CUDA tensor"):
        capture_step(model, torch.optim.SGD(model.parameters(), lr=0.01), ce, x.cpu(), y)


def test_nccl_single_rank_step_keeps_cuda_tensors_on_the_device(tmp_path) -> None:
    """torch.distributed with NCCL (one process, one GPU): a fixed-iteration training
    step over the NCCL group makes no host-device synchronisation, and the transport's
    device collectives (gradient reduction, broadcast) run on the device."""
    import torch.distributed as dist

    if not dist.is_nccl_available():
        pytest.skip("torch built without NCCL")
    dist.init_process_group("nccl", store=dist.FileStore(str(tmp_path / "store"), 1),
                            rank=0, world_size=1)
    try:
        from layerpar.mgrit.transport import make_transport

        make, shape = nets()["dense"]
        torch.manual_seed(0)
        net = make().cuda()
        ref = layerpar.LayerParallel(copy.deepcopy(net), None, *FIXED, check_finite=False)
        model = layerpar.LayerParallel(net, dist.group.WORLD, *FIXED, check_finite=False)
        assert model.transport.backend == "nccl"
        x = torch.randn(*shape, device="cuda")
        assert rel(model(x).detach(), ref(x).detach()) <= 1e-6  # the same model
        y = torch.randint(0, 5, (shape[0],), device="cuda")
        opt = torch.optim.SGD(model.parameters(), lr=0.01, foreach=True)

        def step() -> None:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

        step()
        torch.cuda.synchronize()
        tr = make_transport(dist.group.WORLD)
        g = torch.ones(1000, device="cuda")
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
            tr.allreduce_start(g).wait()
            got = tr.bcast_tensor(g, 0, g.shape, g.dtype, g.device)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert got.device.type == "cuda" and float(got.sum()) == 1000.0
    finally:
        dist.destroy_process_group()
