"""MPI worker: a user's nets that the bundled ones do not cover.

1. `options="auto"` on a batch-norm net leaves the running statistics as serial
training leaves them (its tuning passes are measurements, not training).
2. Token ids (an integer input into an `nn.Embedding` opening layer) train under
exact, MGRIT and auto settings (``requires_grad_`` refused integer inputs).
3. `LayerParallel.clip_grad_norm_` clips by the whole network's norm, as
`torch.nn.utils.clip_grad_norm_` does on the serial net (``RANK <r> clip <norm type>
norm <relative difference of the norms> params <difference after 3 SGD steps>
smallest <the smallest norm, above the 0.05 clipped to>``).

Usage: mpiexec -n P python -m mpi4py tests/workers/lp_user_nets.py
A float64 ODE-net of a user's two-convolution blocks with batch norms (not a bundled
block) and its serial copy train three SGD steps side by side; `LayerParallel(...,
"auto")` tunes on its first training forward (no `tune` call).  Each rank then reports
``RANK <r> buffers <largest relative difference> counts <auto's> <serial's>`` over the
gathered state dict's buffers, ``RANK <r> params <difference>`` and
``RANK <r> eval <difference>`` of an evaluation pass, and ``RANK <r> tuned <n>`` with
the number of candidates the tuning measured (so the test knows passes ran).
Then per setting ``RANK <r> tokens <setting> loss <difference> grads <difference>
check <param error> <input error>`` against the serial copy (grads: exact settings
only; the check is `check_gradients` on the token batch).
"""

import copy
import sys
import warnings

import torch
from mpi4py import MPI
from torch import nn

import layerpar
from layerpar import MGRITOptions

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
warnings.filterwarnings("ignore", "layerpar: residual block")  # (not vectorised: BN)


def say(text: str) -> None:
    sys.stdout.write(f"RANK {rank} {text}\n")
    sys.stdout.flush()


class ConvBN(nn.Module):
    """Conv -> BN -> ReLU -> Conv -> BN: F(u) of one residual layer."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv1d(c, c, 3, padding=1), nn.BatchNorm1d(c)
        self.c2, self.b2 = nn.Conv1d(c, c, 3, padding=1), nn.BatchNorm1d(c)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return self.b2(self.c2(torch.relu(self.b1(self.c1(u)))))


torch.manual_seed(0)
net = layerpar.ODENet(open=nn.Conv1d(1, 4, 3, padding=1),
                      steps=lambda n: ConvBN(4), n_steps=8, t_final=1.0,
                      close=nn.Sequential(nn.Flatten(), nn.Linear(4 * 12, 3))).double()
serial = copy.deepcopy(net)
model = layerpar.LayerParallel(net, comm, "auto")
opt = torch.optim.SGD(model.parameters(), lr=0.05)
opt_s = torch.optim.SGD(serial.parameters(), lr=0.05)
loss_fn = nn.functional.cross_entropy
g = torch.Generator().manual_seed(1)
for _ in range(3):
    x = torch.randn(16, 1, 12, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (16,), generator=g)
    for m, o in ((model, opt), (serial, opt_s)):
        o.zero_grad()
        loss_fn(m(x), y).backward()
        o.step()
full = model.gather_state_dict()
ref = serial.state_dict()
buffers = dict(serial.named_buffers())
worst = max(float((full[k].double() - ref[k].double()).abs().max()
                  / max(float(ref[k].double().abs().max()), 1e-300))
            for k in buffers if k in full)
counts = sorted({int(full[k]) for k in buffers if k.endswith("num_batches_tracked")})
counts_s = sorted({int(ref[k]) for k in buffers if k.endswith("num_batches_tracked")})
say(f"buffers {worst:.3e} counts {counts} {counts_s}")
params = dict(serial.named_parameters())
diff = max(float((full[k] - p.detach()).abs().max()) for k, p in params.items())
say(f"params {diff:.3e}")
model.eval()
serial.eval()
x = torch.randn(16, 1, 12, generator=g, dtype=torch.float64)
with torch.no_grad():
    say(f"eval {float((model(x) - serial(x)).abs().max()):.3e}")
say(f"tuned {len(model.tuner.results[0].table) if model.tuner.results else 0}")
model.close()


class PreNorm(nn.Module):
    """LayerNorm -> Linear -> GELU -> Linear: F(u) of a pre-norm MLP layer."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.n, self.a, self.b = nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return self.b(nn.functional.gelu(self.a(self.n(u))))


settings = {"exact": MGRITOptions(max_levels=1),
            "mgrit": MGRITOptions(max_levels=2, cfactor=2, max_iter=2, tol=0.0),
            "auto": "auto"}
for name, options in settings.items():
    torch.manual_seed(0)
    net = layerpar.ODENet(open=nn.Embedding(20, 8), steps=lambda n: PreNorm(8),
                          n_steps=8, t_final=1.0,
                          close=nn.Sequential(nn.Flatten(), nn.Linear(40, 20))).double()
    serial = copy.deepcopy(net)
    bwd = options.replace(max_iter=1) if name == "mgrit" else None
    model = layerpar.LayerParallel(net, comm, options, bwd)
    tok = torch.randint(0, 20, (6, 5), generator=g)
    y = torch.randint(0, 20, (6,), generator=g)
    loss = loss_fn(model(tok), y)
    loss.backward()
    loss_s = loss_fn(serial(tok), y)
    loss_s.backward()
    full = dict(serial.named_parameters())
    mine = [(n, p) for n, p in model.named_parameters() if n in full]
    diff = max(float((p.grad - full[n].grad).abs().max()) for n, p in mine) \
        if name != "mgrit" else 0.0
    check = model.check_gradients(tok, y, loss_fn)
    say(f"tokens {name} loss {abs(float(loss.detach() - loss_s.detach())):.3e} "
        f"grads {diff:.3e} "
        f"check {check.param_grad_error:.3e} {check.input_grad_error:.3e} "
        f"params {len(mine)}")
    model.close()

# 3. gradient clipping over the whole network (each rank holds its layers' gradients
# only: clipping its own part gave every rank another scale)
for norm_type in (2.0, float("inf")):
    torch.manual_seed(0)
    net = layerpar.ODENet(open=nn.Linear(3, 6), steps=lambda n: PreNorm(6), n_steps=8,
                          t_final=1.0, close=nn.Linear(6, 3)).double()
    serial = copy.deepcopy(net)
    model = layerpar.LayerParallel(net, comm, MGRITOptions(max_levels=1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_s = torch.optim.SGD(serial.parameters(), lr=0.1)
    norms, totals = [], []
    for _ in range(3):
        x = torch.randn(8, 3, generator=g, dtype=torch.float64)
        y = torch.randint(0, 3, (8,), generator=g)
        for m, o in ((model, opt), (serial, opt_s)):
            o.zero_grad()
            loss_fn(m(x), y).backward()
        got = model.clip_grad_norm_(0.05, norm_type)
        want = torch.nn.utils.clip_grad_norm_(serial.parameters(), 0.05, norm_type)
        norms.append(abs(float(got) - float(want)) / float(want))
        totals.append(float(want))
        opt.step()
        opt_s.step()
    full = model.gather_state_dict()
    diff = max(float((full[k] - p.detach()).abs().max())
               for k, p in serial.named_parameters())
    say(f"clip {norm_type:g} norm {max(norms):.3e} params {diff:.3e} "
        f"smallest {min(totals):.3g}")
    model.close()
