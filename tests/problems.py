"""Reference problems for the MGRIT tests: propagators with a sequential reference.

Each problem has ``step(u, t_start, t_stop, level)`` (the propagator `solve()` calls,
on coarse levels with longer intervals), ``u0()`` and ``sequential(u0, N, T)``, which
steps the fine grid t_i = t0 + (i/N)(T - t0) one interval after the other with the
same step function and the same time formula as the engine (`grid_time`), so a
one-level solve must reproduce it bit for bit.

Also the table of solver configurations the serial and MPI tests share
(`PARALLEL_CASES`), `run_case`, which runs one of them, and `reference_mgrit`: MGRIT
written out plainly from DESIGN.md, an oracle independent of the engine.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from tolerances import SOLVER_TOL

from layerpar.mgrit import MGRITOptions, MGRITResult, build_levels, grid_time, solve

Tensor = torch.Tensor
DTYPE = torch.float64


def sequential_states(step: Callable[[Tensor, float, float, int], Tensor], u0: Tensor, n: int,
                      t_final: float, t_start: float = 0.0) -> list[Tensor]:
    """u_0..u_N by plain sequential stepping on the fine grid (level 0)."""
    states = [u0]
    u = u0
    for i in range(n):
        u = step(u, grid_time(i, n, t_start, t_final), grid_time(i + 1, n, t_start, t_final), 0)
        states.append(u)
    return states


def rel_err(a: Tensor, b: Tensor) -> float:
    """||a - b|| / ||b|| (or ||a - b|| when b is 0), in float64."""
    a64, b64 = a.detach().double(), b.detach().double()
    nb = float(torch.linalg.vector_norm(b64))
    d = float(torch.linalg.vector_norm(a64 - b64))
    return d / nb if nb > 0 else d


def max_rel_err(states: dict[int, Tensor], ref: Sequence[Tensor]) -> float:
    """Largest `rel_err` of states[i] against ref[i] over the keys of `states`."""
    return max((rel_err(s, ref[i]) for i, s in states.items()), default=0.0)


class Problem:
    """Base class: `step`, optional `step_batch`, `u0`, `sequential`."""

    name = "problem"
    t_start = 0.0
    step_batch: Optional[Callable[[list, list, list, int], list]] = None

    def step(self, u: Tensor, ts: float, te: float, level: int) -> Tensor:
        raise NotImplementedError

    def u0(self) -> Tensor:
        raise NotImplementedError

    def sequential(self, u0: Tensor, n: int, t_final: float) -> list[Tensor]:
        """States u_0..u_N of sequential stepping with `step`."""
        return sequential_states(self.step, u0, n, t_final, self.t_start)


class Dahlquist(Problem):
    """u' = lam u, u(0) = 1, with backward Euler u/(1 - lam dt) or forward Euler
    u (1 + lam dt)."""

    def __init__(self, scheme: str = "backward", lam: float = -1.0) -> None:
        if scheme not in ("backward", "forward"):
            raise ValueError(f"`scheme` must be 'backward' or 'forward', got {scheme!r}")
        self.scheme = scheme
        self.lam = lam
        self.name = f"dahlquist-{scheme}"

    def step(self, u: Tensor, ts: float, te: float, level: int) -> Tensor:
        dt = te - ts
        if self.scheme == "backward":
            return u / (1.0 - self.lam * dt)
        return u * (1.0 + self.lam * dt)

    def u0(self) -> Tensor:
        return torch.ones(1, dtype=DTYPE)


class Heat(Problem):
    """u_t = u_xx on (0, 1), u = 0 at both ends, `nx` interior points, backward Euler.

    The step is u <- M(dt) u with M(dt) = (I - dt A)^-1, cached per dt value, so the
    same interval always gives the same bits.
    """

    name = "heat"

    def __init__(self, nx: int = 31) -> None:
        self.nx = nx
        dx = 1.0 / (nx + 1)
        a = torch.diag(torch.full((nx,), -2.0, dtype=DTYPE))
        a += torch.diag(torch.ones(nx - 1, dtype=DTYPE), 1)
        a += torch.diag(torch.ones(nx - 1, dtype=DTYPE), -1)
        self.a = a / dx**2
        self.x = torch.linspace(dx, 1.0 - dx, nx, dtype=DTYPE)
        self._cache: dict[float, Tensor] = {}

    def matrix(self, dt: float) -> Tensor:
        m = self._cache.get(dt)
        if m is None:
            m = torch.linalg.inv(torch.eye(self.nx, dtype=DTYPE) - dt * self.a)
            self._cache[dt] = m
        return m

    def step(self, u: Tensor, ts: float, te: float, level: int) -> Tensor:
        return torch.mv(self.matrix(te - ts), u)

    def u0(self) -> Tensor:
        x = self.x
        return torch.sin(torch.pi * x) + 0.5 * torch.sin(3 * torch.pi * x) + x * (1 - x)


class TanhResNet(Problem):
    """u <- u + h tanh(W_n u + b_n) with one (W_n, b_n) per fine layer n = 0..N-1.

    A step from t_a uses the layer of the fine point at t_a (injection on coarse
    levels): n = round((t_a - t0) N / (T - t0)).  `batched` adds `step_batch`, which
    advances many states at once with stacked weights (torch.baddbmm).
    States are [batch, width] tensors.
    """

    def __init__(self, n_layers: int, t_final: float = 1.0, *, width: int = 4, batch: int = 3,
                 t_start: float = 0.0, seed: int = 0, batched: bool = False) -> None:
        g = torch.Generator().manual_seed(seed)
        self.n_layers = n_layers
        self.t_start = t_start
        self.t_final = t_final
        self.width = width
        self.batch = batch
        self.weight = torch.randn(n_layers, width, width, generator=g, dtype=DTYPE) * 0.8
        self.bias = torch.randn(n_layers, width, generator=g, dtype=DTYPE) * 0.3
        self._u0 = torch.randn(batch, width, generator=g, dtype=DTYPE)
        self.name = "tanh-batched" if batched else "tanh"
        if batched:
            self.step_batch = self._step_batch

    def layer(self, t: float) -> int:
        """Index of the fine layer whose step starts at time t."""
        n = round((t - self.t_start) * self.n_layers / (self.t_final - self.t_start))
        if not 0 <= n < self.n_layers:
            raise IndexError(f"time {t} maps to layer {n}, outside 0..{self.n_layers - 1}")
        return n

    def step(self, u: Tensor, ts: float, te: float, level: int) -> Tensor:
        n = self.layer(ts)
        return u + (te - ts) * torch.tanh(torch.addmm(self.bias[n], u, self.weight[n].T))

    def _step_batch(self, us: list, ts: list, te: list, level: int) -> list:
        idx = torch.tensor([self.layer(t) for t in ts])
        u = torch.stack(us)
        h = torch.tensor([b - a for a, b in zip(ts, te)], dtype=u.dtype).view(-1, 1, 1)
        z = torch.baddbmm(self.bias[idx].unsqueeze(1), u, self.weight[idx].transpose(1, 2))
        return list((u + h * torch.tanh(z)).unbind(0))

    def u0(self) -> Tensor:
        return self._u0

    def sequential(self, u0: Tensor, n: int, t_final: float) -> list[Tensor]:
        if n != self.n_layers or t_final != self.t_final:
            raise ValueError(f"this net has {self.n_layers} layers on [{self.t_start}, "
                             f"{self.t_final}], asked for {n} steps to {t_final}")
        return super().sequential(u0, n, t_final)


PROBLEM_NAMES = ("dahlquist-backward", "dahlquist-forward", "heat", "tanh", "tanh-batched")

# the final time of each problem
T_FINAL = {"dahlquist-backward": 4.0, "dahlquist-forward": 2.0, "heat": 0.5, "tanh": 2.0,
           "tanh-batched": 2.0}


def make_problem(name: str, n_steps: int) -> Problem:
    """The problem called `name` (one of PROBLEM_NAMES) for an `n_steps` fine grid."""
    if name == "dahlquist-backward":
        return Dahlquist("backward")
    if name == "dahlquist-forward":
        return Dahlquist("forward")
    if name == "heat":
        return Heat()
    if name in ("tanh", "tanh-batched"):
        return TanhResNet(n_steps, T_FINAL[name], batched=name == "tanh-batched")
    raise ValueError(f"unknown problem {name!r}; choose from {PROBLEM_NAMES}")


@dataclass(frozen=True)
class Case:
    """One solve: a problem, a fine grid size and MGRIT options (as keyword arguments)."""

    problem: str
    n_steps: int
    options: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in sorted(self.options.items()))
        return f"{self.problem}/N={self.n_steps}/{opts}"


def run_case(case: Case, comm: Any = None) -> tuple[MGRITResult, list[Tensor]]:
    """Solve `case` (serially for comm=None) and return the result with the sequential
    reference states u_0..u_N."""
    prob = make_problem(case.problem, case.n_steps)
    t_final = T_FINAL[case.problem]
    u0 = prob.u0()
    result = solve(prob.step, u0, case.n_steps, t_final, MGRITOptions(**case.options), comm=comm,
                   step_batch=prob.step_batch)
    return result, prob.sequential(u0, case.n_steps, t_final)


_TOL = dict(tol=SOLVER_TOL)
_OPTION_SETS: list[dict] = [
    dict(max_levels=1),
    dict(max_levels=2, nrelax=0, cfactor=4, **_TOL),
    dict(max_levels=3, cfactor=[4, 2], **_TOL),
    dict(max_levels=30, cfactor=2, **_TOL),
    dict(max_levels=30, cfactor=2, fmg=True, **_TOL),
    dict(max_levels=4, cfactor=3, skip=False, cweight=0.7, nrelax=[2, 1], **_TOL),
    dict(max_levels=3, cfactor=2, max_iter=2, tol=0.0),  # not converged: same histories
]

# configurations run at 1, 2, 3 and 4 ranks and compared with the serial solve
PARALLEL_CASES: list[Case] = [
    Case(p, n, o)
    for p in ("dahlquist-backward", "heat", "tanh", "tanh-batched")
    for n in (37, 64)
    for o in _OPTION_SETS
] + [Case("dahlquist-forward", 37, dict(max_levels=3, cfactor=2, **_TOL))]


def reference_mgrit(step: Callable[[Tensor, float, float, int], Tensor], u0: Tensor,
                    n_steps: int, t_final: float, options: MGRITOptions, t_start: float = 0.0
                    ) -> tuple[list[Tensor], list[float], int, list[int]]:
    """MGRIT written out plainly from DESIGN.md ("MGRIT semantics"), serial, no engine.

    Returns (states u_0..u_N, residual history, iterations, step calls per level).  An
    independent oracle for the engine's residual histories and work counters.
    """
    levels = build_levels(n_steps, options)
    nl = len(levels)
    u: list[list] = [[None] * (lv.n_intervals + 1) for lv in levels]
    v: list[list] = [[None] * (lv.n_intervals + 1) for lv in levels]
    f: list[list] = [[None] * (lv.n_intervals + 1) for lv in levels]
    calls = [0] * nl
    hist: list[float] = []

    def t(i: int) -> float:
        return grid_time(i, n_steps, t_start, t_final)

    def phi(lvl: int, x: Tensor, j: int, rhs: bool = True) -> Tensor:
        s = levels[lvl].stride
        calls[lvl] += 1
        out = step(x, t((j - 1) * s), t(j * s), lvl)
        return out if (not rhs or f[lvl][j] is None) else out + f[lvl][j]

    def cpoints(lvl: int) -> range:
        return range(levels[lvl].cfactor, levels[lvl].n_intervals + 1, levels[lvl].cfactor)

    def f_sweep(lvl: int) -> None:
        for j in range(1, levels[lvl].n_intervals + 1):
            if j % levels[lvl].cfactor:
                u[lvl][j] = phi(lvl, u[lvl][j - 1], j)

    def c_sweep(lvl: int) -> None:
        w = options.cweight
        for c in cpoints(lvl):
            a = phi(lvl, u[lvl][c - 1], c)
            u[lvl][c] = a if w == 1.0 else w * a + (1 - w) * u[lvl][c]

    def inject(lvl: int) -> None:
        cf = levels[lvl].cfactor
        for i in range(levels[lvl + 1].n_intervals + 1):
            v[lvl + 1][i] = u[lvl + 1][i] = u[lvl][i * cf]
            f[lvl + 1][i] = None

    def down(lvl: int, skip: bool) -> None:
        if skip:
            inject(lvl)
            return
        for _ in range(options.nrelax_at(lvl)):
            f_sweep(lvl)
            c_sweep(lvl)
        f_sweep(lvl)
        a = {c: phi(lvl, u[lvl][c - 1], c) for c in cpoints(lvl)}
        if lvl == 0:
            hist.append(math.sqrt(sum(float(((a[c] - u[0][c]).double() ** 2).sum())
                                      for c in a)))
        inject(lvl)
        cf = levels[lvl].cfactor
        for i in range(1, levels[lvl + 1].n_intervals + 1):
            f[lvl + 1][i] = a[i * cf] - phi(lvl + 1, v[lvl + 1][i - 1], i, rhs=False)

    def coarsest(lvl: int) -> None:
        for j in range(1, levels[lvl].n_intervals + 1):
            u[lvl][j] = phi(lvl, u[lvl][j - 1], j)

    def up(lvl: int) -> None:
        cf = levels[lvl].cfactor
        for i in range(1, levels[lvl + 1].n_intervals + 1):
            u[lvl][i * cf] = u[lvl][i * cf] + (u[lvl + 1][i] - v[lvl + 1][i])
        if lvl > 0:
            f_sweep(lvl)

    def v_cycle(lvl: int, skip: bool) -> None:
        if lvl == nl - 1:
            return coarsest(lvl)
        down(lvl, skip)
        v_cycle(lvl + 1, skip)
        up(lvl)

    def f_cycle(lvl: int, skip: bool) -> None:
        if lvl == nl - 1:
            return coarsest(lvl)
        down(lvl, skip)
        f_cycle(lvl + 1, skip)
        up(lvl)
        if lvl > 0:
            down(lvl, False)
            v_cycle(lvl + 1, False)
            up(lvl)

    u[0][0] = u0
    if nl == 1:
        coarsest(0)
        return u[0], hist, 1, calls
    for j in range(levels[0].cfactor, n_steps + 1, levels[0].cfactor):
        u[0][j] = torch.zeros_like(u0)
    k = 0
    while True:
        before = len(hist)
        (f_cycle if options.fmg else v_cycle)(0, options.skip and k == 0)
        done = k == options.max_iter - 1
        if len(hist) > before:
            r = hist[-1]
            if r == 0.0 or r < options.tol or r < options.rtol * hist[0]:
                done = True
        if done:
            break
        k += 1
    f_sweep(0)
    if options.final_fc_relax:
        c_sweep(0)
    return u[0], hist, k + 1, calls
