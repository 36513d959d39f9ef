"""`solve()`: MGRIT for any propagator on torch tensors (its result: `result.py`)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch

from .._checks import finite_in, integer
from .errors import ConvergenceError, DivergenceError
from .grid import block_bounds
from .options import MAX_STEPS, MGRITOptions
from .result import MGRITResult
from .session import EngineSession
from .transport import DEFAULT_TIMEOUT, Transport, check_timeout, make_transport
from .xbraid import check_engine, check_options, require_xbraid, xbraid_bounds, xbraid_refusal

StepFn = Callable[[torch.Tensor, float, float, int], torch.Tensor]
BatchStepFn = Callable[[list, list, list, int], Sequence[torch.Tensor]]


def _check_state(out: Any, like: torch.Tensor, who: str) -> torch.Tensor:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"`{who}` must return a torch.Tensor, got {type(out).__name__}")
    # cheap checks first (dtype objects are singletons; .device allocates an object)
    if (out.shape != like.shape or out.dtype is not like.dtype
            or out.is_cuda != like.is_cuda or (like.is_cuda and out.device != like.device)):
        raise ValueError(
            f"`{who}` returned a state of shape {tuple(out.shape)}, {out.dtype} on {out.device}; "
            f"expected {tuple(like.shape)}, {like.dtype} on {like.device} (like `u0`)")
    return out


def vec_sum(alpha: float, x: torch.Tensor, beta: float, y: torch.Tensor) -> torch.Tensor:
    """alpha*x + beta*y as a new tensor (the engine's `sum`).

    The engine only ever asks for x + y, x - y (residuals, FAS right-hand sides,
    corrections) and the C-relaxation weight: the operators are exact and cost less
    than torch.add with an `alpha` keyword (bit-identical results).
    """
    if beta == 1.0:
        if alpha == 1.0:
            return y + x
        return torch.add(y, x, alpha=alpha)
    if alpha == 1.0:
        if beta == -1.0:
            return x - y
        return torch.add(x, y, alpha=beta)
    return torch.add(x * alpha, y, alpha=beta)


def vec_norm_sq(states: list[torch.Tensor]) -> float:
    """Sum of squared 2-norms, accumulated in float64 and read back once."""
    if len(states) == 1:
        return float(torch.linalg.vector_norm(states[0].detach(), dtype=torch.float64) ** 2)
    norms = torch.stack([torch.linalg.vector_norm(s.detach(), dtype=torch.float64)
                         for s in states])
    return float(torch.dot(norms, norms))


def _modified_input(who: str) -> None:
    raise ValueError(
        f"`{who}` modified its input state in place; MGRIT keeps and reuses states (they "
        "are shared, never copied), so a step must return a new tensor and leave its "
        "input unchanged (write `u = u + ...`, not `u += ...`)")


class _SolveApp:
    """Adapts the user's `step(u, t_start, t_stop, level)` to the engine's callbacks."""

    def __init__(self, step: StepFn, step_batch: Optional[BatchStepFn], u0: torch.Tensor,
                 init: Optional[Callable[[float], torch.Tensor]]) -> None:
        self._user_step = step
        self.u0 = u0
        self._init = init
        self._zero = torch.zeros_like(u0)
        self._shape, self._dtype, self._cuda = u0.shape, u0.dtype, u0.is_cuda
        # the engine's batched step where the user gave one (None: it calls step() per
        # state)
        self.step_batch: Optional[Callable[..., list]] = None
        if step_batch is not None:
            self._batch_fn: BatchStepFn = step_batch
            self.step_batch = self._step_batch

    def step(self, u: torch.Tensor, f: Optional[torch.Tensor], ts: float, te: float, is_: int,
             ie: int, level: int, final: int) -> torch.Tensor:
        version = u._version
        out = self._user_step(u, ts, te, level)
        if u._version != version:
            _modified_input("step")
        if type(out) is not torch.Tensor or out.shape != self._shape or out.dtype is not \
                self._dtype:
            _check_state(out, self.u0, "step")  # raises with the full story
        elif self._cuda:
            _check_state(out, self.u0, "step")
        return out if f is None else torch.add(out, f)

    def _step_batch(self, us: list, fs: Optional[list], ts: list, te: list, is_: list,
                    ie: list, level: int, final: int) -> list:
        versions = [u._version for u in us]
        outs = list(self._batch_fn(us, ts, te, level))
        if any(u._version != v for u, v in zip(us, versions)):
            _modified_input("step_batch")
        if len(outs) != len(us):
            raise ValueError(f"`step_batch` returned {len(outs)} states for {len(us)} inputs")
        for k, o in enumerate(outs):
            _check_state(o, self.u0, "step_batch")
            if fs is not None and fs[k] is not None:
                outs[k] = torch.add(o, fs[k])
        return outs

    def step_seq(self, u: torch.Tensor, fs: Optional[list], ts: list, te: list, is_: list,
                 ie: list, level: int, final: int) -> list:
        """Consecutive steps in one call (a rank's stretch of a sequential solve)."""
        step, shape, dtype = self._user_step, self._shape, self._dtype
        outs = []
        for k in range(len(ts)):
            version, u_in = u._version, u
            u = step(u_in, ts[k], te[k], level)
            if u_in._version != version:
                _modified_input("step")
            if type(u) is not torch.Tensor or u.shape != shape or u.dtype is not dtype or \
                    self._cuda:
                _check_state(u, self.u0, "step")
            if fs is not None and fs[k] is not None:
                u = torch.add(u, fs[k])
            outs.append(u)
        return outs

    def init(self, t: float, i: int) -> torch.Tensor:
        if i == 0:
            return self.u0
        if self._init is None:
            return self._zero
        return _check_state(self._init(t), self.u0, "init")

    sum = staticmethod(vec_sum)
    norm_sq = staticmethod(vec_norm_sq)


def _validate(step: Any, u0: Any, n_steps: Any, t_start: Any, t_final: Any, options: Any,
              init: Any, step_batch: Any, size: int) -> None:
    if not callable(step):
        raise TypeError(f"`step` must be callable, got {type(step).__name__}")
    if step_batch is not None and not callable(step_batch):
        raise TypeError("`step_batch` must be callable or None")
    if init is not None and not callable(init):
        raise TypeError("`init` must be callable or None")
    if not isinstance(u0, torch.Tensor):
        raise TypeError(f"`u0` must be a torch.Tensor, got {type(u0).__name__}")
    # MGRIT sums, scales and takes norms of states: integer and boolean tensors would fail
    # (or round) inside torch, and complex norms are not what the halting rule compares
    if not u0.dtype.is_floating_point:
        raise TypeError(f"`u0` must be a floating-point tensor (float16, bfloat16, float32 "
                        f"or float64), got {u0.dtype}")
    if u0.is_meta:
        raise ValueError("`u0` is on the meta device: it has a shape but no values to "
                         "step; create it on the CPU or a GPU")
    integer("n_steps", integer("n_steps", n_steps, 1), hi=MAX_STEPS,
            why=" (the engine indexes time points with C ints)")
    if n_steps < size:
        raise ValueError(f"`n_steps` ({n_steps}) must be >= the number of ranks ({size})")
    finite_in("t_start", t_start)
    finite_in("t_final", t_final)
    if not t_final > t_start:
        raise ValueError(f"`t_final` ({t_final}) must be > `t_start` ({t_start})")
    if not isinstance(options, MGRITOptions):
        raise TypeError(f"`options` must be an MGRITOptions, got {type(options).__name__}")


def _check_engine(engine: Any, transport: Transport, options: MGRITOptions,
                  step_batch: Any) -> None:
    """What `engine` needs of the other arguments (raised before any message)."""
    if check_engine(engine) != "xbraid":
        return
    require_xbraid()
    why = xbraid_refusal(transport)
    if why is not None:
        raise ValueError(why)
    if step_batch is not None:
        raise ValueError("engine='xbraid' steps one state per call: `step_batch` (batched "
                         "steps) needs engine='native'")
    check_options(options, "options")


def solve(step: StepFn, u0: torch.Tensor, n_steps: int, t_final: float,
          options: Optional[MGRITOptions] = None, comm: Any = None,
          init: Optional[Callable[[float], torch.Tensor]] = None, *, t_start: float = 0.0,
          step_batch: Optional[BatchStepFn] = None,
          timeout: Optional[float] = DEFAULT_TIMEOUT, engine: str = "native") -> MGRITResult:
    """Solve u_{i+1} = step(u_i, t_i, t_{i+1}, level) for i = 0..n_steps-1 with MGRIT.

    step: the propagator; called on coarse levels with longer intervals and their level.
        It must return a new tensor shaped like `u0` and must not modify its input.
    u0: the initial condition (needed on rank 0; other ranks use its shape and dtype).
    n_steps, t_final, t_start: the fine grid t_i = t_start + (i/n_steps)(t_final - t_start).
    options: `MGRITOptions` (the same on every rank; checked).
    comm: an mpi4py communicator, a `torch.distributed` process group, or None for a
        serial solve.
    init: initial guess init(t) at fine C-points (default: zeros shaped like `u0`).
    step_batch: optional batched propagator step_batch(us, t_starts, t_stops, level)
        returning the list of advanced states (independent intervals at once).
    timeout: seconds any one wait for another rank may take (default 10 minutes; None:
        unbounded); on expiry `TimeoutError` names what was waited for and the rank.
    engine: "native" (default) or "xbraid": XBraid itself (when built, see
        `layerpar.mgrit.xbraid`); it refuses `step_batch`, both `tol` and `rtol`, and
        torch.distributed groups.  Its partition of the points (`states`) is XBraid's.

    Returns an `MGRITResult` whose `final_state` (u at t_final) is broadcast to every rank.
    Where `u0` requires grad, the solve is recorded as any torch computation: on one
    rank `final_state` is differentiable with respect to `u0` and to whatever `step`
    reads (the gradient of the computed result, iterations included); on several ranks
    the last rank's `final_state` carries its own part of the graph, and the others
    hold received values.
    """
    options = MGRITOptions() if options is None else options
    transport: Transport = make_transport(comm)
    try:
        err: BaseException | None = None
        try:
            _validate(step, u0, n_steps, t_start, t_final, options, init, step_batch,
                      transport.size)
            n_steps = int(n_steps)
            timeout = check_timeout(timeout)
            _check_engine(engine, transport, options, step_batch)
            key: Any = {"engine": engine, **{f"options.{k}": v for k, v in options.key().items()},
                        "timeout": timeout,
                        "n_steps": n_steps, "t_start": float(t_start),
                        "t_final": float(t_final), "u0.shape": tuple(u0.shape),
                        "u0.dtype": str(u0.dtype), "init": init is not None,
                        "step_batch": step_batch is not None}
        except (TypeError, ValueError, ImportError) as exc:  # ImportError: no XBraid build
            err, key = exc, None
        transport.agree(key, err, "solve() arguments (options, n_steps, times, u0 shape/dtype)")
        transport.timeout = timeout
        transport.set_context("solve()")

        def run() -> MGRITResult | DivergenceError:
            bounds = (xbraid_bounds if engine == "xbraid" else block_bounds)(n_steps,
                                                                              transport.size)
            app = _SolveApp(step, step_batch, u0, init)
            session = EngineSession(n_steps, t_start, t_final, transport, bounds, app, options,
                                    what="MGRIT", engine=engine)
            transport.set_template(u0)
            try:
                stats = session.drive()
            except DivergenceError as exc:
                # every rank sees the same allreduced NaN norm and raises this itself;
                # broadcasting it (guarded) would race and turn it into RemoteError elsewhere
                return exc
            finally:
                session.close()
            hist = stats.residual_history
            last = transport.size - 1
            final = transport.bcast_state(session.state(n_steps) if transport.rank == last
                                          else None, root=last)
            # A sequential solve (one level) computes no residual, so a NaN/Inf would pass
            # as converged; check the final state once.  Every rank holds the same
            # broadcast bytes, so every rank decides the same way without a message.
            if not bool(torch.isfinite(final).all()):
                return DivergenceError(
                    f"MGRIT final state (t = {float(t_final)}) has non-finite values after "
                    f"{stats.iterations} iteration(s) on {stats.n_levels} level(s): the "
                    f"propagator produced non-finite values (history {hist})")
            states = {i: session.state(i) for i in range(bounds[transport.rank],
                                                         bounds[transport.rank + 1])}
            stats.final_state = final
            stats.states = {i: s for i, s in states.items() if s is not None}
            return stats

        from .transport import guarded

        result = guarded(transport, run)
    finally:
        transport.close()
    if isinstance(result, DivergenceError):
        raise result
    if options.strict and not result.converged:
        raise ConvergenceError(result.message)
    return result
