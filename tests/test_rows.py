"""`probe_rows`: what splitting a batch assumes of a net (each row computed on its own,
no buffer moved in forward, no random numbers drawn outside torch's dropout modules),
found on a few of the batch's rows where no type tells.

Splitting a batch over ranks, or into a pipeline's micro-batches, is exact only for such
a net; batch norm is known by its type, a user's block that centres by the batch mean
or keeps a running mean is not.  The probe must name those, leave the net as it found
it, and find nothing in any block or net layerpar ships (whose types it then trusts
without running them: checked here by running them anyway).
"""
from __future__ import annotations

from typing import Callable

import pytest
import torch
from torch import nn
from user_blocks import WIDTH, Centred, Drawing, Tracker, user_net

import layerpar
from layerpar.apps.nets import problem_net
from layerpar.ode import blocks
from layerpar.ode.net import Segment
from layerpar.parallel import replicated
from layerpar.parallel.replicated import probe_rows

W = WIDTH


class AtLeastFive(nn.Module):
    """Refuses batches of fewer than five rows (as batch norm refuses one row)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(W, W)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        if u.shape[0] < 5:
            raise ValueError("at least five rows")
        return torch.tanh(self.lin(u))


class Plain(nn.Module):
    """Row by row, of a type the probe does not know: it must run it and find nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(W, W)
        self.drop = nn.Dropout(0.5)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return self.drop(torch.tanh(self.lin(u)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_block_that_centres_by_the_batch_mean_is_named(dtype: torch.dtype) -> None:
    got = probe_rows(user_net(Centred, dtype), torch.randn(16, 3, dtype=dtype))
    assert got.coupled is not None and got.coupled.startswith(
        "layers.1.blocks.0 (Centred) gives a row another output"), got
    assert got.buffers is None


def test_a_buffer_moved_in_forward_is_named_and_the_net_left_as_it_was() -> None:
    net = user_net(Tracker, torch.float32).eval()
    state = {k: v.clone() for k, v in net.state_dict().items()}
    x = torch.randn(16, 3)
    rng = torch.get_rng_state()
    got = probe_rows(net, x)
    assert got.coupled is None
    assert got.buffers is not None and "['layers.1.blocks.0.seen'" in got.buffers \
        and "and 5 more" in got.buffers, got
    assert not any(m.training for m in net.modules())  # its flags put back
    assert all(torch.equal(v, net.state_dict()[k]) for k, v in state.items())
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_block_that_fails_on_fewer_rows_is_coupled_saying_why() -> None:
    got = probe_rows(user_net(AtLeastFive, torch.float32), torch.randn(16, 3))
    assert got.coupled is not None and "raised ValueError: at least five rows" in got.coupled


def test_a_row_wise_block_of_the_users_is_run_and_passes() -> None:
    net = user_net(Plain, torch.float32)
    assert not replicated._row_wise_by_type(net)
    assert probe_rows(net, torch.randn(16, 3)) == (None, None, None)
    # a batch of one row cannot be split: nothing to find
    assert probe_rows(user_net(Centred, torch.float32), torch.randn(1, 3)) == (None, None, None)


def test_a_flatten_over_the_rows_is_not_trusted_by_type() -> None:
    def net(*plain: nn.Module) -> layerpar.ODENet:
        return layerpar.ODENet(layers=[*plain, nn.Linear(3, W),
                                       Segment(lambda k: blocks.Dense(W), 2, 1.0)])

    assert not replicated._row_wise_by_type(net(nn.Flatten(0), nn.Unflatten(0, (-1, 3))))
    assert replicated._row_wise_by_type(net(nn.Flatten()))


def _shipped() -> list[tuple[str, Callable[[], nn.Module], tuple[int, ...]]]:
    """Every net `layerpar train` builds and a net of each of layerpar's blocks (small)."""
    def net_of(block: Callable[[], nn.Module]) -> layerpar.ODENet:
        return layerpar.ODENet(steps=lambda k: block(), n_steps=4)

    return [
        ("peaks", lambda: problem_net("peaks", 8, 8), (2,)),
        ("digits", lambda: problem_net("digits", 4, 4), (1, 8, 8)),
        ("mnist1d dense", lambda: problem_net("mnist1d", 16, 8, arch="dense"), (40,)),
        ("mnist1d conv", lambda: problem_net("mnist1d", 8, 4, arch="conv"), (40,)),
        ("mnist1d resnet", lambda: problem_net("mnist1d", 12, 4, arch="resnet"), (40,)),
        ("mnist1d prenorm", lambda: problem_net("mnist1d", 8, 8, arch="prenorm"), (40,)),
        ("Dense", lambda: net_of(lambda: blocks.Dense(W)), (W,)),
        ("Conv", lambda: net_of(lambda: blocks.Conv(W)), (W, 5, 5)),
        ("Conv1d", lambda: net_of(lambda: blocks.Conv1d(W)), (W, 7)),
        ("PreNorm", lambda: net_of(lambda: blocks.PreNorm(W)), (W,)),
        ("Transformer", lambda: net_of(lambda: blocks.Transformer(8, heads=2)), (5, 8)),
        ("causal Transformer",
         lambda: net_of(lambda: blocks.Transformer(8, heads=2, causal=True)), (5, 8)),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", _shipped(), ids=lambda c: c[0])
def test_what_layerpar_ships_is_trusted_by_type_and_keeps_rows_apart(
        case: tuple[str, Callable[[], nn.Module], tuple[int, ...]], dtype: torch.dtype,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Trusted without a run; run anyway (types not trusted), nothing found but batch
    norm, which the conv ResNet holds: the trust is earned."""
    name, make, shape = case
    torch.manual_seed(0)
    net = make().to(dtype)
    x = torch.randn(32, *shape, dtype=dtype)
    has_bn = name == "mnist1d resnet"
    assert replicated._row_wise_by_type(net)
    trusted = probe_rows(net, x)
    monkeypatch.setattr(replicated, "_row_wise_by_type", lambda net: False)
    ran = probe_rows(net, x)
    assert ran.buffers is None and trusted.buffers is None
    if has_bn:
        assert trusted.coupled is not None and "batch norm" in trusted.coupled
        assert ran.coupled is not None and "(BatchNorm1d)" in ran.coupled, ran
    else:
        assert trusted.coupled is None and ran.coupled is None, ran


def test_compiled_blocks_are_seen_through_and_run_eagerly() -> None:
    """A `torch.compile`d block: its original's type is what counts, and the probe's
    batches compile nothing."""
    from torch._dynamo.utils import counters

    compiled_dense = user_net(lambda: torch.compile(blocks.Dense(W)), torch.float32)
    assert replicated._row_wise_by_type(compiled_dense)
    before = sum(counters["frames"].values())
    got = probe_rows(user_net(lambda: torch.compile(Centred()), torch.float32),
                     torch.randn(16, 3))
    assert got.coupled is not None and "(Centred) gives a row another output" in got.coupled
    assert sum(counters["frames"].values()) == before


def test_a_block_drawing_random_numbers_itself_is_named_and_the_streams_kept() -> None:
    net = user_net(Drawing, torch.float32)
    x = torch.randn(16, 3)
    rng = torch.get_rng_state()
    got = probe_rows(net, x)
    assert got.random is not None and got.random.startswith(
        "layers.1.blocks.0 (Drawing) draws random numbers"), got
    assert got.coupled is None  # (its draws differ with the rows: not compared)
    assert torch.equal(torch.get_rng_state(), rng)
    # torch's dropout modules are not drawing "itself": they are off in the probe
    assert probe_rows(user_net(Plain, torch.float32), x).random is None
