"""Passes that behave like PyTorch's: several forwards before one backward, a no_grad
forward in between, backwards in any order, dropped outputs freeing their records,
micro-batch accumulation, the output changed in place.  Against the serial ODENet
oracle, float64, converged MGRIT, batched and per-step cycles, at 1 rank in-process and
at 2 and 3 ranks under MPI."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from mpi_util import run_mpi
from tolerances import F64

import layerpar

WORKERS = Path(__file__).parent / "workers"
sys.path.insert(0, str(WORKERS))
import lp_passes  # noqa: E402


def test_passes_match_serial_one_rank() -> None:
    errs = lp_passes.run_cases(None)
    assert len(errs) == 2 * len(lp_passes.CASES)
    for case, err in errs.items():
        assert err <= F64.converged, (case, err)


def test_auto_path_is_measured_and_equals_per_step() -> None:
    (batched, t_vec, t_seq), err = lp_passes.auto_choice(None)
    assert t_vec > 0 and t_seq > 0 and batched == (t_vec <= t_seq)
    assert err <= F64.roundoff


def test_a_parameter_no_block_uses_keeps_no_gradient_as_in_serial() -> None:
    # (timing the cycle paths differentiated it and raised torch's allow_unused error)
    assert lp_passes.unused_parameters(None) <= F64.converged


def test_the_output_changed_in_place_as_in_serial() -> None:
    # (a segment's last state was returned as a view, which autograd refused to change)
    assert lp_passes.segment_last_in_place(None) <= F64.converged


def test_dropped_outputs_hold_no_memory() -> None:
    # 90 more forwards whose outputs are dropped leave no more live tensors behind
    assert lp_passes.dropped_outputs_growth(None) <= 0


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 3])
def test_passes_match_serial_mpi(nprocs: int, tmp_path: Path) -> None:
    out = tmp_path / "passes.json"
    proc = run_mpi(WORKERS / "lp_passes.py", nprocs, str(out), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    errs = json.loads(out.read_text())
    assert errs.pop("tensor growth") <= 0
    assert errs.pop("unused parameters") <= F64.converged
    # (on the ranks receiving the output, it viewed the message's bytes: autograd
    # refused the in-place change there, and the holder went on to wait)
    assert errs.pop("segment last, output changed in place") <= F64.converged
    # batched="auto" decides alike on every rank, and either path gives the same result
    assert errs.pop("auto choices agree") is True
    assert errs.pop("auto vs per-step") <= F64.roundoff
    assert len(errs) == 2 * len(lp_passes.CASES)
    for case, err in errs.items():
        assert err <= F64.converged, (case, err)


# --- blocks that break the residual-block contract are refused, naming the block -------

class Counter(torch.nn.Module):
    """Counts its calls in a buffer (a user's own running statistic)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.tanh(self.lin(u))


class InPlace(torch.nn.Module):
    """Changes its input in place (works serially, where u is not needed afterwards)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(u.mul_(0.5)))


class Narrowing(torch.nn.Module):
    """Maps the state to fewer features (not a residual block's F)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return self.lin(u)


class Pair(torch.nn.Module):
    """Returns a tuple (a user's block that also returns its input, say)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lin(u), u


def _net(block: type) -> layerpar.ODENet:
    torch.manual_seed(0)
    return layerpar.ODENet(open=torch.nn.Linear(3, 4), steps=lambda k: block(), n_steps=8,
                           t_final=1.0, close=torch.nn.Linear(4, 5))


MGRIT = layerpar.MGRITOptions(max_levels=2, cfactor=2, max_iter=2)


@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("grad", [True, False])
def test_block_updating_a_buffer_is_refused(batched: bool, grad: bool) -> None:
    model = layerpar.LayerParallel(_net(Counter), None, MGRIT, batched=batched)
    with torch.set_grad_enabled(grad), \
            pytest.raises(ValueError, match=r"\(Counter\) updates its buffer\(s\) \['calls'\]"):
        model(torch.randn(5, 3))


def test_block_updating_a_buffer_keeps_serial_values_in_direct_mode() -> None:
    net = _net(Counter)
    model = layerpar.LayerParallel(_net(Counter), None)  # one rank, one level: serial
    net(torch.randn(5, 3))
    model(torch.randn(5, 3))
    calls = [int(b.calls) for b in model.layers[1].blocks.values()]
    assert calls == [int(b.calls) for b in net.layers[1].blocks] == [1] * 8


@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("grad", [True, False])
def test_block_changing_its_input_in_place_is_refused(batched: bool, grad: bool) -> None:
    net = _net(InPlace)
    net(torch.randn(5, 3))  # serially it runs
    model = layerpar.LayerParallel(net, None, MGRIT, batched=batched)
    with torch.set_grad_enabled(grad), \
            pytest.raises(ValueError, match=r"\(InPlace\) modified its input in place"):
        model(torch.randn(5, 3))


@pytest.mark.parametrize("levels", [1, 2])
@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("block, says", [
    (Narrowing, r"\(Narrowing\) changed the state's shape from \(5, 4\) to \(5, 3\)"),
    (Pair, r"\(Pair\) returned a tuple")])
def test_block_whose_output_is_not_f_of_u_is_named(block: type, says: str, batched: bool,
                                                   levels: int) -> None:
    """A block's output must be one tensor shaped like the state: otherwise the error
    names the layer and the block and says what F must be (torch's broadcasting error
    from u + h*F(u), or an AttributeError on a tuple, named neither)."""
    opts = layerpar.MGRITOptions(max_levels=levels, cfactor=2, max_iter=2)
    model = layerpar.LayerParallel(_net(block), None, opts, batched=batched)
    with pytest.raises(ValueError, match=says + r".*returns F\(u\), one tensor shaped like u"):
        model(torch.randn(5, 3))


@pytest.mark.parametrize("levels", [1, 2])
def test_plain_layer_returning_a_tuple_is_named(levels: int) -> None:
    """A plain layer hands one tensor on (to the next layer, or out of the model):
    a tuple is named, on every path."""
    net = _net(lambda: layerpar.ode.blocks.Dense(4))
    net.layers[2] = Pair()  # a closing layer giving (logits, features)
    net(torch.randn(5, 3))  # serially it runs
    opts = layerpar.MGRITOptions(max_levels=levels, cfactor=2, max_iter=2)
    model = layerpar.LayerParallel(net, None, opts)
    with pytest.raises(TypeError, match=r"plain layer 2 \(Pair\) returned a tuple"):
        model(torch.randn(5, 3))
