"""What the transports send as small objects (`bcast_object`, `allgather_object`) is
pickled compactly: a segment's per-layer parameters are rows of one tensor per name,
and plain pickling wrote each row's whole storage (a 256-layer state dict pickled to
277 MB for 1 MB of parameters; a 256 x 128 net's broadcast ran out of memory)."""
from __future__ import annotations

import pickle

import torch
from torch import nn

import layerpar
from layerpar.mgrit.transport.base import dumps
from layerpar.ode import blocks


def test_a_state_dict_of_views_pickles_to_its_own_size() -> None:
    torch.manual_seed(0)
    net = layerpar.ODENet(open=nn.Linear(4, 32), steps=lambda k: blocks.Dense(32),
                          n_steps=256, close=nn.Linear(32, 3))
    sd = net.state_dict()
    data = sum(v.numel() * v.element_size() for v in sd.values())
    view = next(v for k, v in sd.items() if k.endswith("weight") and "blocks" in k)
    assert view.untyped_storage().nbytes() > view.numel() * view.element_size()  # a view
    got = dumps(sd)
    assert len(got) < 2 * data + 100_000, (len(got), data)
    back = pickle.loads(got)
    assert list(back) == list(sd) and all(torch.equal(back[k], sd[k]) for k in sd)


def test_other_objects_pickle_as_before() -> None:
    p = nn.Parameter(torch.randn(3, 3))
    q = pickle.loads(dumps(p))
    assert isinstance(q, nn.Parameter) and q.requires_grad and torch.equal(q, p)
    assert pickle.loads(dumps((1, "a", [2.5], None))) == (1, "a", [2.5], None)
    assert torch.equal(pickle.loads(dumps(torch.arange(10.0)[2:4])), torch.tensor([2.0, 3.0]))
