"""Auto's serial choice at one rank: a training step through direct mode (the path it
replaced) against the net itself as auto now runs it (`autotune.plain_serial`: the
layers in order, `ODENet.forward_seeded` with no dropout seed), on blocks the project
does not ship (a user's two-convolution step, a pre-norm MLP;
`layerpar.apps.pathbench`) and on digits; and the gradients of the two, which must be
equal.

    python docs/tta/ceilings/plain_serial_ab.py

One thread, fused Adam, each model's median step over 60 steps (after 10), the two
models taking turns five times; output in `plain_serial_ab.txt`.
"""
import argparse
import statistics
import time

import torch
from torch import nn

from layerpar.apps.loop import adam
from layerpar.apps.nets import RECIPES
from layerpar.apps.pathbench import PreNormMLP, two_conv
from layerpar.apps.train import add_arguments, build_net, load_data
from layerpar.mgrit.options import MGRITOptions
from layerpar.ode.net import ODENet, Segment
from layerpar.parallel import LayerParallel

torch.set_num_threads(1)


def digits() -> tuple[ODENet, torch.Tensor, torch.Tensor]:
    p = argparse.ArgumentParser()
    add_arguments(p)
    p.add_argument("problem")
    a = p.parse_args(["digits"])
    x, y, _, _ = load_data("digits", 0, torch.float32)
    bs = RECIPES["digits"].batch_size
    return build_net("digits", a.layers, a.width, arch=a.arch, t_final=a.t_final), \
        x[:bs], y[:bs]


def conv() -> tuple[ODENet, torch.Tensor, torch.Tensor]:
    net = ODENet(layers=[nn.Conv2d(1, 4, 3, padding=1), Segment(lambda k: two_conv(4), 16, 1.0),
                         nn.Flatten(), nn.Linear(4 * 28 * 28, 10)])
    return net, torch.randn(50, 1, 28, 28), torch.randint(0, 10, (50,))


def mlp() -> tuple[ODENet, torch.Tensor, torch.Tensor]:
    net = ODENet(open=nn.Linear(8, 32), steps=lambda k: PreNormMLP(32), n_steps=128,
                 t_final=1.0, close=nn.Linear(32, 10))
    return net, torch.randn(64, 8), torch.randint(0, 10, (64,))


def median_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    opt = adam(model.parameters(), lr=1e-4)
    ts = []
    for _ in range(70):
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts[10:])


class Plain(nn.Module):
    """The net as auto's serial choice runs it (a net without dropout)."""

    def __init__(self, net: ODENet) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ODENet.forward_seeded(self.net, x, None)


def main() -> None:
    one = MGRITOptions(max_levels=1)
    for name, make in (("two-conv 16 layers b50", conv), ("pre-norm MLP 128 x 32 b64", mlp),
                       ("digits (bundled)", digits)):
        torch.manual_seed(0)
        net, x, y = make()
        direct = LayerParallel(net, None, one, one)
        plain = Plain(net)
        params = list(net.parameters())
        g_direct = torch.autograd.grad(nn.functional.cross_entropy(direct(x), y), params)
        g_plain = torch.autograd.grad(nn.functional.cross_entropy(plain(x), y), params)
        same = all(torch.equal(a, b) for a, b in zip(g_direct, g_plain))
        d, p = [], []
        for _ in range(5):
            d.append(median_step(direct, x, y))
            p.append(median_step(plain, x, y))
        print(f"{name}: direct mode {min(d) * 1e3:.3f}-{max(d) * 1e3:.3f} ms, the net itself "
              f"{min(p) * 1e3:.3f}-{max(p) * 1e3:.3f} ms a step (ratio of medians "
              f"{statistics.median(p) / statistics.median(d):.3f}); gradients equal: {same}",
              flush=True)
        direct.close()


if __name__ == "__main__":
    main()
