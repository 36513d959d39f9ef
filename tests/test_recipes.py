"""The MNIST-1D architectures with recipes of their own (``layerpar train mnist1d
--model resnet|prenorm``): the recipe table, the nets they build, the pre-norm block's
vectorised evaluation, and LayerParallel against the serial oracle at 2 ranks."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from layerpar.apps import nets, recipes
from layerpar.apps.arguments import problem_defaults
from layerpar.ode import Segment, blocks

WORKERS = Path(__file__).parent / "workers"


def test_each_architecture_has_its_recipe() -> None:
    resnet = recipes.recipe_for("mnist1d", "resnet")
    prenorm = recipes.recipe_for("mnist1d", "prenorm")
    assert resnet.n_layers >= 128 and prenorm.n_layers >= 256 and prenorm.width >= 64
    # the deep narrow nets keep the problem's own recipe (the latency-bound case)
    for arch in (None, "dense", "conv"):
        assert recipes.recipe_for("mnist1d", arch) is recipes.RECIPES["mnist1d"]
    assert recipes.recipe_for("peaks") is recipes.RECIPES["peaks"]
    with pytest.raises(ValueError, match="`arch` must be one of .* for peaks"):
        recipes.recipe_for("peaks", "resnet")
    with pytest.raises(ValueError, match="`model_name` must be one of"):
        recipes.recipe_for("cifar")
    # ``layerpar train --help``'s table: one row per recipe, the default's first
    rows = [line.split() for line in problem_defaults().splitlines()[2:]]
    mnist = [r for r in rows if r[0] == "mnist1d"]
    assert [r[1] for r in mnist] == ["dense|conv", "resnet", "prenorm"]
    assert mnist[1][2:] == [str(resnet.epochs), str(resnet.batch_size), f"{resnet.lr:g}",
                            str(resnet.n_layers), str(resnet.width), f"{resnet.t_final:g}"]


def test_train_takes_the_architectures_recipe() -> None:
    """``--model resnet`` parses, and the checks that read the net's depth read the
    resnet's (its recipe's 128 layers halve 7 times, the dense net's 256 eight; 129
    ranks are too many for 128 layers, not for 256)."""
    from layerpar.apps import cli

    args = cli.parse_args(["train", "mnist1d", "--model", "prenorm", "--serial"])
    assert args.arch == "prenorm"
    layers = recipes.recipe_for("mnist1d", "resnet").n_layers
    k = layers.bit_length()  # one halving more than the depth allows
    with pytest.raises(ValueError, match=f"mnist1d's {layers} layers"):
        cli.parse_args(["train", "mnist1d", "--model", "resnet", "--nested", str(k)])
    with pytest.raises(ValueError, match=f"`--np` must be <= {layers}, the number of "):
        cli.parse_args(["train", "mnist1d", "--model", "resnet", "--np", str(layers + 1)])
    with pytest.raises(ValueError, match="`--model` must be one of"):
        cli.parse_args(["train", "peaks", "--model", "prenorm"])


def test_the_resnet_builds_runs_and_learns() -> None:
    torch.manual_seed(0)
    r = recipes.recipe_for("mnist1d", "resnet")
    full = nets.problem_net("mnist1d", arch="resnet")
    segs = [m for m in full.layers if isinstance(m, Segment)]
    assert [s.n_steps for s in segs] == [43, 43, 42] and sum(s.n_steps for s in segs) \
        == r.n_layers
    assert [s.blocks[0].conv.in_channels for s in segs] == [r.width, 2 * r.width,
                                                             4 * r.width]
    assert all(s.blocks[0].bn is not None for s in segs)
    net = nets.mnist1d_resnet(6, 3, 1.0).double()
    x = torch.randn(5, 40, dtype=torch.float64)
    out = net(x)
    assert out.shape == (5, 10)
    out.square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in net.parameters())
    with pytest.raises(ValueError, match="`n_layers` must be >= 3"):
        nets.mnist1d_resnet(2, 3, 1.0)


def test_the_prenorm_net_builds_and_runs() -> None:
    torch.manual_seed(0)
    r = recipes.recipe_for("mnist1d", "prenorm")
    full = nets.problem_net("mnist1d", arch="prenorm")
    seg = next(m for m in full.layers if isinstance(m, Segment))
    assert seg.n_steps == r.n_layers and isinstance(seg.blocks[0], blocks.PreNorm)
    net = nets.mnist1d_prenorm(5, 6, 2.0).double()
    out = net(torch.randn(4, 40, dtype=torch.float64))
    assert out.shape == (4, 10)
    out.square().sum().backward()
    assert all(p.grad is not None for p in net.parameters())


def test_prenorm_forward_batched_is_its_forward(tol: dict) -> None:
    """n layers' branches in one call equal each layer's own forward (float64)."""
    torch.manual_seed(0)
    layers = [blocks.PreNorm(6, hidden=7).double() for _ in range(3)]
    for b in layers:  # the norm's affine map away from its (1, 0) start
        torch.nn.init.normal_(b.norm.weight)
        torch.nn.init.normal_(b.norm.bias)
    u = torch.randn(3, 4, 6, dtype=torch.float64)
    params = {n: torch.stack([dict(b.named_parameters())[n] for b in layers])
              for n, _ in layers[0].named_parameters()}
    with torch.no_grad():
        got = layers[0].forward_batched(params, {}, u)
        want = torch.stack([b(u[k]) for k, b in enumerate(layers)])
    assert float((got - want).norm() / want.norm()) <= tol[torch.float64].exact


@pytest.mark.mpi
def test_layer_parallel_matches_serial_at_two_ranks(tol: dict) -> None:
    """Both nets under exact (one level) and converged two-level MGRIT: outputs and
    gradients equal the serial oracle's; the pre-norm segment's cycles ran vectorised
    (`forward_batched`), the batch-norm segments' layer by layer."""
    from mpi_util import run_mpi

    proc = run_mpi(WORKERS / "lp_recipes.py", 2, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    pat = re.compile(r"RANK (\d) (\w+) (\w+) out (\S+) x (\S+) params (\S+) batched (\S+) "
                     r"iters (\d+)")
    got = {(int(m[1]), m[2], m[3]): m for m in pat.finditer(proc.stdout)}
    assert len(got) == 8, proc.stdout
    for (rank, arch, setting), m in got.items():
        for err in (m[4], m[5], m[6]):
            assert float(err) <= tol[torch.float64].converged, (rank, arch, setting, m[0])
        if setting == "converged":
            assert int(m[8]) > 1, m[0]  # MGRIT iterated (two levels)
            assert m[7] == ("1" if arch == "prenorm" else "000"), m[0]


def test_tta_cases_train_the_resnets_at_their_recipes() -> None:
    """Cases e and f of ``python -m layerpar.bench tta`` are the recipes, option for
    option; they and their smoke versions pass ``layerpar train --auto --np 2``'s
    checks (what the benchmark checks before it trains)."""
    from layerpar.apps import cli, tta

    for k, arch in (("e", "resnet"), ("f", "prenorm")):
        r = recipes.recipe_for("mnist1d", arch)
        a = cli.parse_args(["train", *tta.CASES[k].train_args()])
        assert (a.model, a.arch, a.epochs, a.batch_size, a.lr, a.layers, a.width,
                a.t_final) == ("mnist1d", arch, r.epochs, r.batch_size, r.lr, r.n_layers,
                               r.width, r.t_final)
        for table in (tta.CASES, tta.SMOKE):
            cli.parse_args(["train", *table[k].train_args(), "--np", "2", "--auto"])
