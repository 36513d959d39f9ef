"""MPI worker: randomness, autocast, empty batches and compiled blocks, against serial.

Run: mpiexec -n P python -m mpi4py tests/workers/lp_rng.py OUT.json
Each case runs the serial ODENet oracle and LayerParallel over `comm` (also importable:
each function takes comm=None for one rank in-process) and returns what every rank
saw; rank 0 writes the cases' per-rank results to OUT.json as {case: [rank 0's,
rank 1's, ...]}.

- `shuffled_epochs`: three epochs of a shuffling DataLoader (more batches per epoch
  than `check_inputs` covers), dropout in the blocks and in the closing layer: the
  batches each rank saw, the global generator's state after, and the parameters
  against serial training from the same seed.
- `random_block`: a block that draws `torch.randn_like` in forward: refused by name
  under MGRIT; in direct mode (one rank, sequential) it is serial autograd.
- `autocast_grads`: a float32 net under ``torch.autocast("cpu", bfloat16)``: output
  and parameter gradients against the serial net's under the same autocast (layerpar's
  block and a user's, per-step and vectorised), or the refusal of a block that would
  widen the state's dtype.  ``lp_rng.py OUT.json autocast`` runs these cases alone.
- `empty_batch`: a batch of no samples, under MGRIT options and ``options="auto"``.
- `compiled_blocks`: blocks wrapped in `torch.compile`: the model builds on every rank.
- `compiled_model`: ``torch.compile(model)`` over compiled blocks: serial's output and
  gradients (the pass runs eagerly, the blocks compiled).
- `inference_mode`: validation under ``torch.inference_mode()`` between training
  steps: serial's outputs and parameters.
"""
from __future__ import annotations

import copy
import functools
import hashlib
import sys
import warnings
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import layerpar
from layerpar.mgrit import MGRITOptions
from layerpar.ode import blocks

CONVERGED = MGRITOptions(max_levels=3, cfactor=2, tol=1e-13, max_iter=50)
ce = nn.functional.cross_entropy


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / max(float(b.norm()), 1e-300))


def _rank(comm: Any) -> int:
    return 0 if comm is None else comm.Get_rank()


def _grad_error(model: layerpar.LayerParallel, serial: nn.Module) -> float:
    """The worst relative error of this rank's parameter gradients against serial's."""
    ref = dict(serial.named_parameters())
    return max(rel(p.grad, ref[n].grad) for n, p in model.named_parameters())


# --- dropout and a shuffling DataLoader over several epochs -------------------------------

class _Noisy(nn.Module):
    """F(u) = tanh(W u) + 0.1 noise: randomness that is not a dropout module."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(u)) + 0.1 * torch.randn_like(u)


class _PrivateNoise(nn.Module):
    """F(u) = tanh(W u) + 0.1 noise drawn from a generator the block holds: each
    evaluation advances it, so MGRIT's evaluations would draw other noise than
    serial's one."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.g = torch.Generator().manual_seed(3)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        noise = torch.randn(u.shape, generator=self.g, dtype=u.dtype)
        return torch.tanh(self.linear(u)) + 0.1 * noise


def _dropout_net() -> layerpar.ODENet:
    torch.manual_seed(5)
    return layerpar.ODENet(
        open=nn.Linear(3, 4),
        steps=lambda k: nn.Sequential(blocks.Dense(4, activation="tanh"), nn.Dropout(0.2)),
        n_steps=8, t_final=1.0,
        close=nn.Sequential(nn.Dropout(0.3), nn.Linear(4, 5))).double()


def _epochs(model: nn.Module, switch: bool = False) -> tuple[list[list[int]], torch.Tensor]:
    """Three epochs of SGD over a shuffled loader from the global seed 7: the sample
    indices of every batch, and the global generator's state after.  `switch`: the
    dropout modules among ``model.modules()`` in eval mode for the first two batches
    (a warm-up without dropout), then training."""
    g = torch.Generator().manual_seed(0)
    n = 24
    data = TensorDataset(torch.arange(n), torch.randn(n, 3, generator=g, dtype=torch.float64),
                         torch.randint(0, 5, (n,), generator=g))
    loader = DataLoader(data, batch_size=4, shuffle=True)  # 6 batches an epoch
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(7)
    seen = []
    for _ in range(3):
        for i, x, y in loader:
            if switch:
                for m in model.modules():
                    if isinstance(m, nn.Dropout):
                        m.train(len(seen) >= 2)
            seen.append(i.tolist())
            opt.zero_grad()
            ce(model(x), y).backward()
            opt.step()
    return seen, torch.get_rng_state()


def _epochs_against_serial(comm: Any, serial: nn.Module, switch: bool = False
                           ) -> dict[str, Any]:
    """`_epochs` of `serial` and of a LayerParallel of a copy: the batches the model saw,
    whether they and the generator after are serial's, and the parameters' error."""
    model = layerpar.LayerParallel(copy.deepcopy(serial), comm, CONVERGED, check_inputs=2)
    want, want_state = _epochs(serial, switch)
    got, got_state = _epochs(model, switch)
    full = model.gather_state_dict()
    ref = serial.state_dict()
    model.close()
    return {"seen": got, "same as serial": got == want,
            "generator as serial's": bool(torch.equal(got_state, want_state)),
            "params": max(rel(full[k], ref[k]) for k in ref)}


def shuffled_epochs(comm: Any) -> dict[str, Any]:
    return _epochs_against_serial(comm, _dropout_net())


# --- a block that draws random numbers outside a dropout module ---------------------------

def random_block(comm: Any, options: Optional[MGRITOptions],
                 block: Callable[[], nn.Module] = _Noisy) -> dict[str, Any]:
    """MGRIT: the error each rank raised.  Direct mode (options None, one rank): the
    input and parameter gradients against serial's, from the same global seed."""
    torch.manual_seed(2)
    serial = layerpar.ODENet(open=nn.Linear(3, 4), steps=lambda k: block(), n_steps=8,
                             close=nn.Linear(4, 5)).double()
    model = layerpar.LayerParallel(copy.deepcopy(serial), comm, options)
    x = torch.randn(6, 3, dtype=torch.float64)
    y = torch.randint(0, 5, (6,))
    out: dict[str, Any] = {}
    torch.manual_seed(11)
    ce(serial(x), y).backward()
    torch.manual_seed(11)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (not vectorised: vmap refuses randomness)
            ce(model(x), y).backward()
        out["grads"] = _grad_error(model, serial)
    except Exception as exc:  # noqa: BLE001 - reported for the test to read
        out["error"] = f"{type(exc).__name__}: {exc}"
    if options is None or comm is None:
        model.close()
    return out


# --- autocast -----------------------------------------------------------------------------

class _UserMLP(nn.Module):
    """A user's block of two biased linear layers: vectorised through `torch.vmap`,
    whose linear with a bias returns float32 under autocast."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(u)))


class _Widening(nn.Module):
    """A block returning F(u) in float32 whatever the state's dtype (as CUDA autocast's
    layer_norm does): it would widen a bfloat16 state."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(u)).float()


#: the residual blocks of the autocast cases: layerpar's, a user's, and one widening
#: the state's dtype
AUTOCAST_BLOCKS: dict[str, Callable[[], nn.Module]] = {
    "dense": lambda: blocks.Dense(4, activation="tanh"),
    "user": lambda: _UserMLP(4),
    "widening": lambda: _Widening(4),
}


def autocast_grads(comm: Any, batched: bool, block: str = "dense") -> dict[str, Any]:
    """Two-level MGRIT run to exactness (N/cf iterations), float32 under bf16 autocast
    (the opening makes the state bfloat16): the output and this rank's parameter
    gradients against serial's under autocast."""
    torch.manual_seed(4)
    serial = layerpar.ODENet(open=nn.Linear(3, 4), steps=lambda k: AUTOCAST_BLOCKS[block](),
                             n_steps=8, close=nn.Linear(4, 5))
    exact = MGRITOptions(max_levels=2, cfactor=2, max_iter=4, tol=0.0)
    model = layerpar.LayerParallel(copy.deepcopy(serial), comm, exact, batched=batched)
    x = torch.randn(6, 3)
    y = torch.randint(0, 5, (6,))
    out: dict[str, Any] = {}
    try:
        for m in (serial, model):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                z = m(x)
            ce(z.float(), y).backward()
            out.setdefault("dtypes", []).append(str(z.dtype))
            out.setdefault("outputs", []).append(z.float())
        want, got = out.pop("outputs")
        out["output"] = rel(got, want)
        out["grads"] = _grad_error(model, serial)
        out["vectorised"] = [c.batched for c in model.cycle_paths[0].values()]
    except Exception as exc:  # noqa: BLE001 - reported for the test to read
        out["error"] = f"{type(exc).__name__}: {exc}"
    out.pop("outputs", None)
    model.close()
    return out


def autocast_cases(comm: Any) -> dict[str, Callable[[], dict[str, Any]]]:
    """The autocast cases by name: each block per-step and vectorised."""
    return {f"autocast, {block}, {path}": functools.partial(
                autocast_grads, comm, path == "batched", block)
            for block in AUTOCAST_BLOCKS for path in ("per-step", "batched")}


# --- an empty batch -----------------------------------------------------------------------

def empty_batch(comm: Any, options: Any) -> dict[str, Any]:
    """A batch of no samples, then one of four: output shape, input gradient shape, the
    largest parameter gradient of the empty batch, and the second batch's gradients
    against serial's."""
    torch.manual_seed(6)
    serial = layerpar.ODENet(open=nn.Linear(3, 4),
                             steps=lambda k: nn.Sequential(nn.Linear(4, 4), nn.Tanh()),
                             n_steps=8, close=nn.Linear(4, 5)).double()
    model = layerpar.LayerParallel(copy.deepcopy(serial), comm, options)
    out: dict[str, Any] = {}
    try:
        x = torch.zeros(0, 3, dtype=torch.float64, requires_grad=True)
        z = model(x)
        z.sum().backward()
        out["shape"], out["x grad"] = list(z.shape), list(x.grad.shape)
        out["largest grad"] = max(float(p.grad.abs().max()) for p in model.parameters())
        if model.tuner is not None:
            out["tuned"] = model.tuner.tuned
        model.zero_grad()
        x = torch.randn(4, 3, dtype=torch.float64)
        y = torch.tensor([0, 1, 2, 3])
        for m in (serial, model):
            ce(m(x), y).backward()
        out["grads"] = _grad_error(model, serial)
    except Exception as exc:  # noqa: BLE001 - reported for the test to read
        out["error"] = f"{type(exc).__name__}: {exc}"
    model.close()
    return out


# --- torch.compile ------------------------------------------------------------------------

def compiled_blocks(comm: Any) -> dict[str, Any]:
    """Blocks wrapped in `torch.compile` (never run here: compiling is slow on a CPU):
    whether the model builds, else the error."""
    torch.manual_seed(8)
    net = layerpar.ODENet(open=nn.Linear(3, 4),
                          steps=lambda k: torch.compile(nn.Sequential(nn.Linear(4, 4),
                                                                      nn.Tanh())),
                          n_steps=8, close=nn.Linear(4, 5)).double()
    try:
        model = layerpar.LayerParallel(net, comm, CONVERGED)
    except Exception as exc:  # noqa: BLE001 - reported for the test to read
        return {"error": f"{type(exc).__name__}: {exc}"}
    model.close()
    return {"built": True}


class _Counting:
    """A `torch.compile` backend running the traced graph as is, counting its runs."""

    def __init__(self) -> None:
        self.runs = 0

    def __call__(self, gm: Any, example: Any) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            self.runs += 1
            return gm(*args)
        return run


def compiled_model(comm: Any) -> dict[str, Any]:
    """``torch.compile(model)`` of a model whose blocks are compiled too: the output
    and this rank's gradients against serial's (the pass runs eagerly; the blocks'
    compiled graphs still run, counted)."""
    torch.manual_seed(8)
    counting = _Counting()
    net = layerpar.ODENet(
        open=nn.Linear(3, 4), n_steps=8, close=nn.Linear(4, 5),
        steps=lambda k: torch.compile(nn.Sequential(nn.Linear(4, 4), nn.Tanh()),
                                      backend=counting)).double()
    serial = copy.deepcopy(net)
    model = layerpar.LayerParallel(net, comm, CONVERGED)
    x = torch.randn(6, 3, dtype=torch.float64)
    y = torch.randint(0, 5, (6,))
    out: dict[str, Any] = {}
    try:
        compiled = torch.compile(model, backend="eager")
        zs = [m(x) for m in (serial, compiled)]
        for z in zs:
            ce(z, y).backward()
        out["output"] = rel(zs[1], zs[0])
        out["grads"] = _grad_error(model, serial)
        out["blocks compiled"] = counting.runs > 0
    except Exception as exc:  # noqa: BLE001 - reported for the test to read
        out["error"] = f"{type(exc).__name__}: {exc}"
    model.close()
    return out


def inference_mode(comm: Any, options: Any) -> dict[str, Any]:
    """Three SGD steps, each followed by the batch evaluated under
    ``torch.inference_mode()`` (validation between steps): the largest difference of
    those outputs from serial's, and of the parameters after."""
    torch.manual_seed(9)
    serial = layerpar.ODENet(open=nn.Linear(3, 4), n_steps=8, close=nn.Linear(4, 5),
                             steps=lambda k: blocks.Dense(4, activation="tanh")).double()
    model = layerpar.LayerParallel(copy.deepcopy(serial), comm, options)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (serial, model)]
    g = torch.Generator().manual_seed(2)
    out: dict[str, Any] = {"outputs": 0.0}
    try:
        for _ in range(3):
            x = torch.randn(6, 3, dtype=torch.float64, generator=g)
            y = torch.randint(0, 5, (6,), generator=g)
            for m, opt in zip((serial, model), opts):
                opt.zero_grad()
                ce(m(x), y).backward()
                opt.step()
            with torch.inference_mode():
                x = torch.randn(6, 3, dtype=torch.float64, generator=g)  # an inference tensor
                a, b = serial(x), model(x)
            out["outputs"] = max(out["outputs"], float((a - b).abs().max()))
        ref = dict(serial.named_parameters())
        out["params"] = max(float((p - ref[n]).abs().max()) for n, p in model.named_parameters())
    except Exception as exc:  # noqa: BLE001 - reported for the test to read
        out["error"] = f"{type(exc).__name__}: {exc}"
    model.close()
    return out


# --- dropout switched off by its own eval(), randomness in a plain layer, tensor hooks ----

def dropout_modules_in_eval(comm: Any) -> dict[str, Any]:
    """The model trains, its dropout modules were put in eval mode one by one: serial
    draws no seed then, and neither may layerpar (the shuffling loader's order and the
    generator after three epochs as serial's)."""
    serial = _dropout_net()
    for m in serial.modules():
        if isinstance(m, nn.Dropout):
            m.eval()
    return _epochs_against_serial(comm, serial)


def dropout_switched_by_owner(comm: Any) -> dict[str, Any]:
    """Dropout switched off for two batches through ``model.modules()``, which at 2+
    ranks holds this rank's own layers only, then on again: serial draws no seed while
    it is off, and neither may layerpar (it drew one where this rank's copies of the
    others' dropout modules still trained, and every later random number differed)."""
    return _epochs_against_serial(comm, _dropout_net(), switch=True)


class _FunctionalDropout(nn.Module):
    """An opening layer drawing its own randomness (`F.dropout`, no dropout module)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(self.linear(x), 0.3, self.training)


def random_plain_layer(comm: Any) -> dict[str, Any]:
    """At 2+ ranks the opening layer runs on rank 0 alone: its own randomness would
    advance rank 0's generator only.  Refused by name (every rank stops)."""
    torch.manual_seed(3)
    net = layerpar.ODENet(open=_FunctionalDropout(), steps=lambda k: blocks.Dense(4),
                          n_steps=8, close=nn.Linear(4, 5)).double()
    model = layerpar.LayerParallel(net, comm, CONVERGED)
    x = torch.randn(6, 3, dtype=torch.float64)
    try:
        model(x)
        return {"ran": True}
    except Exception as exc:  # noqa: BLE001 - reported for the test to read
        return {"error": f"{type(exc).__name__}: {exc}"}


def hooked_parameter(comm: Any, options: Any = CONVERGED) -> dict[str, Any]:
    """Hooks on the parameters run once per backward, as in serial autograd: a
    post-accumulate-grad hook (counted), and a tensor hook scaling the gradient by 0.5
    (the gradients against the serial net's with the same hooks)."""
    torch.manual_seed(4)
    serial = layerpar.ODENet(open=nn.Linear(3, 4), steps=lambda k: blocks.Dense(4),
                             n_steps=8, close=nn.Linear(4, 5)).double()
    model = layerpar.LayerParallel(copy.deepcopy(serial), comm, options)
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randint(0, 5, (6,))
    out: dict[str, Any] = {}
    calls: list[int] = []
    posts = [p.register_post_accumulate_grad_hook(lambda p: calls.append(1))
             for p in model.parameters()]
    ce(model(x), y).backward()
    out["post hooks per parameter"] = len(calls) / max(1, len(posts))
    for h in posts:
        h.remove()
    model.zero_grad()
    for m in (serial, model):
        for p in m.parameters():
            p.register_hook(lambda g: 0.5 * g)
        ce(m(x), y).backward()
    out["grads"] = _grad_error(model, serial)
    model.close()
    return out


def replicas_draw_their_own_masks(comm: Any) -> dict[str, Any]:
    """A 2 x 1 grid (two data replicas of one layer rank), dropout in the blocks, the
    same input on both replicas: the outputs differ (each replica its own masks),
    and the ranks' generators stay in step."""
    torch.manual_seed(6)
    net = _dropout_net()
    grid = layerpar.ProcessGrid(comm, data=comm.Get_size(), layers=1)
    model = layerpar.LayerParallel(net, grid=grid)
    x = torch.randn(4, 3, dtype=torch.float64)
    y = model(x)
    state = torch.get_rng_state()
    model.close()
    return {"output": y.detach().flatten().tolist(),
            "state": hashlib.sha1(state.numpy().tobytes()).hexdigest()}


def run_all(comm: Any) -> dict[str, Any]:
    direct = comm is None or comm.Get_size() == 1
    cases = {
        "shuffled epochs": lambda: shuffled_epochs(comm),
        "random block, MGRIT": lambda: random_block(comm, CONVERGED),
        "private generator, MGRIT": lambda: random_block(comm, CONVERGED, _PrivateNoise),
        **({"random block, direct": lambda: random_block(comm, None)} if direct else {}),
        **autocast_cases(comm),
        "empty batch, MGRIT": lambda: empty_batch(comm, CONVERGED),
        "empty batch, auto": lambda: empty_batch(comm, "auto"),
        "compiled blocks": lambda: compiled_blocks(comm),
        "compiled model": lambda: compiled_model(comm),
        "inference mode": lambda: inference_mode(comm, CONVERGED),
        "inference mode, auto": lambda: inference_mode(comm, "auto"),
        "dropout modules in eval": lambda: dropout_modules_in_eval(comm),
        "dropout switched by its owner": lambda: dropout_switched_by_owner(comm),
        "hooked parameter": lambda: hooked_parameter(comm),
        "hooked parameter, per-step": lambda: hooked_parameter(
            comm, MGRITOptions(max_levels=1)),
        **({} if direct else {
            "random plain layer": lambda: random_plain_layer(comm),
            "replicas' masks": lambda: replicas_draw_their_own_masks(comm)}),
    }
    return {name: case() for name, case in cases.items()}


if __name__ == "__main__":
    from by_case import write_by_case
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    results = run_all(world) if len(sys.argv) < 3 else \
        {name: case() for name, case in autocast_cases(world).items()}
    write_by_case(world, results, sys.argv[1])
