"""The fused Triton steps (layerpar/parallel/kernels) against the torch path, on the CPU
with Triton's interpreter (TRITON_INTERPRET=1): every kernel on small odd shapes
(odd channel counts, non-square images, one interval, batch 1), forward, state VJP,
weight and bias gradients, float32 to 1e-5 relative; and a LayerParallel whose batched
steps run the kernels, against the same model on the torch path.  Skipped, with the
reason, where triton is not installed.

The interpreter must be on before `triton` is first imported (triton's own library
functions are decorated at import), and other tests in the same pytest process may have
imported it already; so `test_kernels_under_the_interpreter` runs this file in a fresh
process with TRITON_INTERPRET=1, where the kernel tests run (and are skipped here)."""
from __future__ import annotations

import copy
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tolerances import F32

import layerpar
from layerpar import MGRITOptions
from layerpar.ode import Segment, blocks
from layerpar.parallel import kernels

pytestmark = pytest.mark.skipif(not kernels.triton_available(),
                                reason="triton is not installed (pip install triton)")
TOL = F32.exact
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.skipif(INTERPRETED, reason="this is the interpreter run")
def test_kernels_under_the_interpreter() -> None:
    """Run the kernel tests of this file in a process with TRITON_INTERPRET=1."""
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(Path(__file__).resolve())],
                          env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=root,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout


@pytest.fixture(scope="module")
def ts():
    """The kernels module, in the interpreter run only."""
    if not INTERPRETED:
        pytest.skip("runs in the interpreter process (test_kernels_under_the_interpreter)")
    import triton

    assert triton.knobs.runtime.interpret
    return importlib.import_module("layerpar.parallel.kernels.triton_steps")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / max(float(b.abs().max()), 1e-30))


def check(fused, ref, inputs: list, bias_index: int = 2) -> None:
    """Forward and all gradients of fused(*leaves) against ref(*leaves)."""
    a = [None if t is None else t.clone().requires_grad_() for t in inputs]
    b = [None if t is None else t.clone().requires_grad_() for t in inputs]
    ya, yb = fused(*a), ref(*b)
    assert rel(ya.detach(), yb.detach()) <= TOL
    g = torch.randn_like(yb)
    la = [t for t in a if t is not None]
    lb = [t for t in b if t is not None]
    for name, ga, gb in zip(("state", "weight", "bias"), torch.autograd.grad(ya, la, g),
                            torch.autograd.grad(yb, lb, g)):
        assert rel(ga, gb) <= TOL, name


@pytest.mark.parametrize("shape,act", [((1, 1, 5), a) for a in sorted(blocks.ACTIVATIONS)]
                         + [((3, 2, 7), "sigmoid"), ((2, 33, 17), "tanh")])
def test_dense_step_and_gradients(ts, shape: tuple, act: str) -> None:
    torch.manual_seed(1)
    L, B, W = shape
    f = blocks.ACTIVATIONS[act]
    dt = torch.rand(L) + 0.1
    ins = [torch.randn(L, B, W), torch.randn(L, W, W) * 0.5, torch.randn(L, W)]

    def ref(x, w, b):
        return x + dt.view(-1, 1, 1) * f(torch.baddbmm(b.unsqueeze(1), x, w.transpose(1, 2)))

    check(lambda x, w, b: ts.DenseStep.apply(x, w, b, dt, act), ref, ins)


def test_dense_step_without_bias(ts) -> None:
    torch.manual_seed(2)
    dt = torch.tensor([0.3, 0.7])
    ins = [torch.randn(2, 3, 9), torch.randn(2, 9, 9) * 0.5]
    check(lambda x, w: ts.DenseStep.apply(x, w, None, dt, "tanh"),
          lambda x, w: x + dt.view(-1, 1, 1) * torch.tanh(torch.bmm(x, w.transpose(1, 2))),
          ins)


def conv_ref(dt: torch.Tensor, f):
    def ref(x, w, b=None):
        return torch.stack([x[k] + dt[k] * f(F.conv2d(x[k], w[k], None if b is None else b[k],
                                                      padding="same"))
                            for k in range(x.shape[0])])
    return ref


@pytest.mark.parametrize("shape,ks", [((1, 1, 3, 5, 7), 3), ((2, 2, 5, 4, 3), 3),
                                      ((3, 1, 1, 6, 6), 3), ((1, 1, 3, 5, 7), 1),
                                      ((2, 2, 5, 4, 3), 5), ((1, 2, 3, 6, 5), 2)])
def test_conv_step_and_gradients(ts, shape: tuple, ks: int) -> None:
    torch.manual_seed(3)
    L, B, C, H, W = shape
    dt = torch.rand(L) + 0.1
    ins = [torch.randn(L, B, C, H, W), torch.randn(L, C, C, ks, ks) * 0.3, torch.randn(L, C)]
    check(lambda x, w, b: ts.ConvStep.apply(x, w, b, dt, "relu"), conv_ref(dt, torch.relu),
          ins)


@pytest.mark.parametrize("act", sorted(blocks.ACTIVATIONS))
def test_conv_step_activations_and_no_bias(ts, act: str) -> None:
    torch.manual_seed(4)
    dt = torch.tensor([0.25, 0.5])
    ins = [torch.randn(2, 2, 3, 5, 4), torch.randn(2, 3, 3, 3, 3) * 0.3]
    check(lambda x, w: ts.ConvStep.apply(x, w, None, dt, act),
          conv_ref(dt, blocks.ACTIVATIONS[act]), ins)


def test_kernels_take_float32_only(ts) -> None:
    x = torch.randn(1, 2, 3, dtype=torch.float64)
    with pytest.raises(TypeError, match="float32"):
        ts.dense_step(x, torch.randn(1, 3, 3, dtype=torch.float64), None,
                      torch.ones(1, dtype=torch.float64), "tanh")


@pytest.mark.skipif(INTERPRETED, reason="runs in the parent process")
def test_chooser_declines_what_it_cannot_do(monkeypatch) -> None:
    euler = layerpar.ode.schemes.ForwardEuler()
    assert kernels.fused_step_for(blocks.Dense(4), layerpar.ode.schemes.Heun(),
                                  force=True) is None
    assert kernels.fused_step_for(blocks.Conv(3, batch_norm=True), euler, force=True) is None
    assert kernels.fused_step_for(torch.nn.Linear(3, 3), euler, force=True) is None
    assert kernels.fused_step_for(blocks.Conv(3), euler, force=True) is not None
    if not torch.cuda.is_available():  # on the CPU: the torch path, always
        assert kernels.fused_step_for(blocks.Dense(4), euler) is None
    monkeypatch.setenv("LAYERPAR_TRITON", "0")
    assert not kernels.enabled()
    assert kernels.fused_step_for(blocks.Dense(4), euler, force=True) is None


@pytest.mark.skipif(INTERPRETED, reason="runs in the parent process")
def test_choice_is_measured_once_per_process_and_shape(monkeypatch) -> None:
    """The per-shape choice is the process's, not a segment's: the auto-tuning builds
    a model per candidate, and on a GPU each would otherwise time (and the first
    compile) every shape again.  Measurement counted by a stand-in (it is CUDA-only)."""
    measured: list[tuple] = []

    def measure(self, x, params, dt, fallback, grad):
        measured.append((tuple(x.shape), grad))
        return False  # the torch path: nothing here runs a kernel

    monkeypatch.setattr(kernels, "_applies", lambda x: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(kernels.FusedStep, "_measure", measure)
    monkeypatch.setattr(kernels, "_CHOICES", {})
    p = {"linear.weight": torch.randn(4, 5, 5), "linear.bias": torch.zeros(4, 5)}
    dt = torch.full((4, 1, 1), 0.1)
    x = torch.randn(4, 3, 5)
    one, two = (kernels.FusedStep(*kernels._kind(blocks.Dense(5)), force=False)
                for _ in range(2))
    assert one(x, p, dt, lambda: x + 1).equal(x + 1)
    assert two(x, p, dt, lambda: x + 2).equal(x + 2)  # another segment: no new timing
    assert measured == [((4, 3, 5), False)]
    two(torch.randn(2, 3, 5), {n: t[:2] for n, t in p.items()}, dt[:2], lambda: x)
    trainable = {"linear.weight": torch.randn(4, 5, 5).requires_grad_(),
             "linear.bias": torch.zeros(4, 5)}
    with torch.enable_grad():
        one(x, trainable, dt, lambda: x)  # gradients wanted: a new timing
    assert measured == [((4, 3, 5), False), ((2, 3, 5), False), ((4, 3, 5), True)]
    tanh = kernels.FusedStep("dense", "linear.weight", "linear.bias", "tanh")
    relu = kernels.FusedStep("dense", "linear.weight", "linear.bias", "relu")
    tanh(x, p, dt, lambda: x)  # Dense's default activation: timed above
    assert len(measured) == 3
    relu(x, p, dt, lambda: x)  # another activation: another kernel, timed again
    assert measured[3:] == [((4, 3, 5), False)]


def _conv_net(n: int) -> layerpar.ODENet:
    return layerpar.ODENet(layers=[torch.nn.Conv2d(1, 3, 3, padding=1),
                                   Segment(lambda k: blocks.Conv(3, activation="tanh"), n,
                                           2.0),
                                   torch.nn.Flatten(), torch.nn.Linear(3 * 5 * 4, 4)])


@pytest.mark.parametrize("kind", ["dense", "conv"])
def test_layer_parallel_with_fused_steps_equals_torch_path(ts, monkeypatch, kind: str
                                                           ) -> None:
    """The batched cycle with the kernels forced on (CPU, interpreter) gives the outputs
    and gradients of the same cycle on the torch path."""
    import layerpar.parallel.batched as batched

    torch.manual_seed(5)
    opts = (MGRITOptions(max_levels=2, cfactor=3, max_iter=2, tol=0.0),
            MGRITOptions(max_levels=2, cfactor=3, max_iter=1, tol=0.0))
    if kind == "dense":
        net = layerpar.ODENet(open=torch.nn.Linear(3, 5), steps=lambda k: blocks.Dense(5),
                              n_steps=9, t_final=2.0, close=torch.nn.Linear(5, 4))
        x = torch.randn(3, 3)
    else:
        net = _conv_net(9)
        x = torch.randn(2, 1, 5, 4)
    y = torch.randint(0, 4, (x.shape[0],))
    ref = layerpar.LayerParallel(copy.deepcopy(net), None, *opts, batched=True)
    assert ref._runners[1].vectorised.fast is None  # CPU: torch path
    monkeypatch.setattr(batched, "fused_step_for",
                        lambda block, scheme: kernels.fused_step_for(block, scheme,
                                                                     force=True))
    fused = layerpar.LayerParallel(copy.deepcopy(net), None, *opts, batched=True)
    assert fused._runners[1].vectorised.fast is not None
    outs = []
    for m in (fused, ref):
        out = m(x)
        F.cross_entropy(out, y).backward()
        outs.append((out.detach(), {n: p.grad for n, p in m.named_parameters()}))
    assert rel(outs[0][0], outs[1][0]) <= TOL
    for name, g in outs[1][1].items():
        assert rel(outs[0][1][name], g) <= 10 * TOL, name
