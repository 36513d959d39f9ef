"""Randomness, autocast, empty batches and compiled blocks under LayerParallel.

- The global generator advances on every rank as serial training advances it (the
  dropout seed is drawn on every rank; a plain layer's dropout draws from its own
  generator), so a shuffling DataLoader gives every rank the same batches.
- A block drawing random numbers outside a dropout module (from the global generator
  or from one it holds) is refused by name under MGRIT (forward and adjoint would see
  other noise), and runs as serial autograd in direct mode.
- Under ``torch.autocast`` the adjoint's steps run in the forward's dtypes.
- An empty batch gives an empty output and zero gradients, as serial does.
- `torch.compile`d blocks digest by their original module, the same in every process.
At one rank in-process (`lp_rng.run_all(None)`) and at two under MPI.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from mpi_util import run_mpi
from tolerances import F64

from layerpar.parallel.agree import fingerprint

WORKERS = Path(__file__).parent / "workers"
sys.path.insert(0, str(WORKERS))
import lp_rng  # noqa: E402

#: a float32 net's gradients under bfloat16 autocast, two-level MGRIT against serial
#: stepping: a few roundings to bfloat16's 8 bits (unit roundoff 3.9e-3) apart
BF16 = 2e-2


def check_autocast(results: dict[str, list[Any]]) -> None:
    """The autocast cases (`lp_rng.autocast_cases`): serial's output and gradients
    within bfloat16's roundings, on the path asked for, or (a block returning float32
    for a bfloat16 state) refused by name on every rank."""
    for name in (n for n in results if n.startswith("autocast, ")):
        for r in results[name]:
            if ", widening, " in name:
                # (each rank names the first layer of its own it found so)
                assert "(_Widening) returned F(u) in torch.float32 for a state in " \
                    "torch.bfloat16" in r.get("error", ""), (name, r)
                continue
            assert "error" not in r, (name, r)
            assert r["dtypes"] == ["torch.bfloat16"] * 2, (name, r)
            assert r["output"] <= BF16 and r["grads"] <= BF16, (name, r)
            assert r["vectorised"] == [name.endswith("batched")], (name, r)


def check(results: dict[str, list[Any]], ranks: int) -> None:
    """Every case's result on every rank (`lp_rng.run_all`), as lists over the ranks."""
    shuffled = results["shuffled epochs"]
    assert all(r["seen"] == shuffled[0]["seen"] for r in shuffled), \
        "the ranks' DataLoaders shuffled differently"
    for r in shuffled:
        assert r["same as serial"] and r["generator as serial's"], r
        assert r["params"] <= F64.converged, r
    for r in results["random block, MGRIT"]:
        assert "grads" not in r, "a block drawing randn_like ran under MGRIT"
        assert "layer 0 of segment 0 (_Noisy) draws random numbers" in r["error"], r
    for r in results["private generator, MGRIT"]:  # not the global one: still refused
        assert "grads" not in r, "a block drawing from its own generator ran under MGRIT"
        assert "layer 0 of segment 0 (_PrivateNoise) draws random numbers in forward() " \
            "from a torch.Generator of its own (`g`)" in r["error"], r
    for r in results.get("random block, direct", []):
        assert r.get("grads", 1.0) <= F64.roundoff, r
    check_autocast(results)
    for name in ("empty batch, MGRIT", "empty batch, auto"):
        for r in results[name]:
            assert "error" not in r, (name, r)
            assert r["shape"] == [0, 5] and r["x grad"] == [0, 3], (name, r)
            assert r["largest grad"] == 0.0, (name, r)
            assert r["grads"] <= F64.converged, (name, r)  # the next batch
    # nothing to time in an empty batch: the tuning waits for one with samples
    assert all(r["tuned"] is False for r in results["empty batch, auto"])
    assert results["compiled blocks"] == [{"built": True}] * ranks
    for name in ("inference mode", "inference mode, auto"):  # (inference tensors have
        for r in results[name]:  # no version counter, which a pass reads)
            assert "error" not in r, (name, r)
            assert r["outputs"] <= F64.converged and r["params"] <= F64.converged, (name, r)
    for r in results["compiled model"]:  # (it named an in-place change that was none)
        assert "error" not in r, r
        assert r["output"] <= F64.converged and r["grads"] <= F64.converged, r
        assert r["blocks compiled"], r
    for name in ("dropout modules in eval", "dropout switched by its owner"):
        for r in results[name]:  # no seed drawn, as serial draws none
            assert r["same as serial"] and r["generator as serial's"], (name, r)
            assert r["params"] <= F64.converged, (name, r)
    for name in ("hooked parameter", "hooked parameter, per-step"):
        for r in results[name]:  # each hook once per backward, as in serial autograd
            assert r["post hooks per parameter"] == 1.0, (name, r)
            assert r["grads"] <= F64.converged, (name, r)
    if ranks > 1:
        for r in results["random plain layer"]:
            assert "plain layer 0 (_FunctionalDropout) draws random numbers" in \
                r.get("error", ""), r
        masks = results["replicas' masks"]
        assert masks[0]["output"] != masks[1]["output"], "replicas drew the same masks"
        assert all(r["state"] == masks[0]["state"] for r in masks), masks


def test_one_rank() -> None:
    check({k: [v] for k, v in lp_rng.run_all(None).items()}, 1)


@pytest.mark.mpi
def test_two_ranks(tmp_path: Path) -> None:
    out = tmp_path / "rng.json"
    proc = run_mpi(WORKERS / "lp_rng.py", 2, str(out), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    check(json.loads(out.read_text()), 2)


@pytest.mark.mpi
def test_autocast_at_four_ranks(tmp_path: Path) -> None:
    out = tmp_path / "autocast.json"
    proc = run_mpi(WORKERS / "lp_rng.py", 4, str(out), "autocast", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_autocast(json.loads(out.read_text()))


def test_compiled_block_digest_is_its_modules() -> None:
    # two compiled wrappers of equal modules (never run): their digests hold no
    # address of the compiler's objects, so they are equal, as in two processes
    def block() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())

    a, b = torch.compile(block()), torch.compile(block())
    assert fingerprint(a) == fingerprint(b)
    assert fingerprint(a) != fingerprint(torch.compile(torch.nn.Linear(4, 4)))


class _NoisyHead(torch.nn.Module):
    """A plain (non-segment) layer adding noise from a generator it holds: allowed (it
    runs once per pass, on its owner, as in serial training)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 5)
        self.g = torch.Generator().manual_seed(7)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return self.linear(u) + 0.1 * torch.randn(u.shape[0], 5, generator=self.g,
                                                  dtype=u.dtype)


def test_measuring_passes_leave_a_layers_own_generator_alone() -> None:
    """A gradient check's passes and the auto-tuning's put back the generators the
    net's layers hold, as they put back the global one: the check's two passes draw the
    same noise (its error is roundoff, not the noise's), and the training's random
    streams after a check or a tuning are serial's."""
    from layerpar import LayerParallel, ODENet
    from layerpar.ode import blocks

    torch.manual_seed(3)
    net = ODENet(open=torch.nn.Linear(3, 4), steps=lambda k: blocks.Dense(4, activation="tanh"),
                 n_steps=8, close=_NoisyHead()).double()
    head = net.layers[-1]
    x = torch.randn(6, 3, dtype=torch.float64)
    y = torch.randint(0, 5, (6,))
    model = LayerParallel(net, None, lp_rng.CONVERGED)
    before = head.g.get_state()
    check = model.check_gradients(x, y, torch.nn.functional.cross_entropy)
    assert torch.equal(head.g.get_state(), before)
    assert check.param_grad_error <= F64.converged, check
    model.close()
    model = LayerParallel(net, None, "auto")
    model.tune(x, y, torch.nn.functional.cross_entropy)
    assert torch.equal(head.g.get_state(), before)
    model.close()
