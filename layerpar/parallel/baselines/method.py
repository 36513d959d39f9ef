"""The training-step interface every way of training an `ODENet` offers alike.

A benchmark or a policy that chooses between serial training, layer-parallel MGRIT,
a batch split and a pipeline drives each through the same five calls
(`TrainingMethod`): ``train_step(x, y, loss_fn)`` runs one forward and backward pass
and returns the loss; the caller's optimizer, built over ``parameters()``, then steps.
The input and target are the *whole* batch, given alike on every rank (as
`LayerParallel` takes them); each method splits them its own way.  After
``train_step`` every rank's parameters hold the gradient of the loss of the whole
batch (the serial net's, for that rank's parameters), so one model, one
initialisation and one optimizer compare across methods.

`SerialMethod` (the net on one process) and `LayerParallelMethod` (a `LayerParallel`)
are the adapters of the two existing ways; `DataParallelNet` and `PipelineNet` are
the baselines.  `METHODS` maps a name to each class; `make_method` builds one by name.
"""
from __future__ import annotations

import contextlib
import math
import os
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import Any, Callable, ClassVar, Optional, Union

import torch
from torch import Tensor, nn

from ..._checks import nonneg_int, positive_int
from ...mgrit.transport import SerialTransport, Transport, make_transport
from ...ode.net import ODENet
from ..checkpoint import clip_over_ranks
from ..timing import gauged_seconds

__all__ = ["LayerParallelMethod", "LossFn", "SerialMethod", "SoloMethod", "TrainingMethod",
           "as_net", "node_cores", "step_seconds"]

LossFn = Callable[[Tensor, Any], Tensor]


def as_net(net: Union[ODENet, Callable[[], ODENet]]) -> ODENet:
    """`net`, or what the zero-argument factory `net` returns; a TypeError otherwise."""
    if not isinstance(net, ODENet):
        if not callable(net) or isinstance(net, nn.Module):
            raise TypeError(f"`net` must be an ODENet or a factory returning one, got "
                            f"{type(net).__name__}")
        net = net()
        if not isinstance(net, ODENet):
            raise TypeError(f"the `net` factory returned {type(net).__name__}, not an ODENet")
    return net


def _rows(t: Any) -> Optional[int]:
    return int(t.shape[0]) if isinstance(t, Tensor) and t.dim() > 0 else None


def parts_loss_error(loss_fn: LossFn, parts: Sequence[tuple[Tensor, Any]],
                     losses: Sequence[Tensor]) -> Optional[str]:
    """Why the mean of `losses`, `loss_fn` on each part of a batch (outputs and targets
    in `parts`; a pipeline's micro-batches), is not `loss_fn` on the whole batch, or
    None.  A method that averages its parts' gradients (torch's pipeline schedules)
    equals serial only where it is: for a mean over the rows, not for a sum (the
    whole's loss is the parts' sum) or a weighted mean (class weights, ignored rows:
    each part is normalised by its own weights).  Without grad, on detached outputs;
    the targets are row slices of one tensor, or None."""
    outs = [o for o, _ in parts]
    whole_y = None if parts[0][1] is None else torch.cat([t for _, t in parts])
    with torch.no_grad():
        whole = float(loss_fn(torch.cat(outs), whole_y))
        mean = sum(float(v.detach()) for v in losses) / len(losses)
    tol = 1e-2 if outs[0].dtype in (torch.float16, torch.bfloat16) else 1e-5
    finite = math.isfinite(whole), math.isfinite(mean)
    if finite == (False, False) or all(finite) and \
            abs(whole - mean) <= tol * max(abs(whole), abs(mean)):
        return None  # (a part's NaN where the whole is finite: a part all ignored rows)
    return (f"`loss_fn` on the whole batch gave {whole:.6g}, the mean of its "
            f"{len(parts)} micro-batches' losses {mean:.6g}: the schedule averages the "
            "micro-batches' gradients, so the step's would not be serial's. A sum "
            "(reduction='sum') or a weighted mean (class weights, ignore_index: each "
            "micro-batch normalised by its own weights) is not a mean over the rows; use "
            "one (reduction='mean' without weights), one micro-batch (microbatches=1), "
            "or DataParallelNet or LayerParallel, which apply the loss to the whole "
            "batch's output")


class TrainingMethod(ABC):
    """One way of training an `ODENet` on the ranks of a communicator.

    The contract (every call is collective: make it on every rank, in the same order):

    - ``train_step(x, y, loss_fn) -> float``: `x` and `y` are the whole batch, the same
      on every rank; ``loss_fn(output, target)`` is the batch's loss (a pipeline of
      several micro-batches asks a mean over the rows: `parts_loss_error`).  Sets each
      of this rank's parameters' ``.grad`` to the gradient of the loss of the whole
      batch (earlier gradients are dropped, not accumulated) and returns that loss,
      the same on every rank.
    - ``parameters()``: this rank's trainable parameters (build the optimizer over them).
    - ``eval_forward(x)``: the whole output for the batch `x`, on every rank, without
      gradients, in the modules' current mode (call ``net.eval()`` first for batch norm
      and dropout in inference mode).
    - ``gather_state_dict()``: the whole net's state dict, on every rank; it loads into
      the serial `ODENet`.
    - ``close()``: release the communicator the method duplicated.

    Subclasses set `name`, `transport` (for the agreement on each batch) and
    `check_inputs`; `_check_batch` compares the batch's shapes between ranks for the
    first `check_inputs` steps, so a rank passing different data raises instead of
    training a wrong model or hanging.
    """

    name: ClassVar[str] = "abstract"
    transport: Transport
    check_inputs: int = 10
    _steps: int = 0

    @property
    def rank(self) -> int:
        return self.transport.rank

    @property
    def size(self) -> int:
        return self.transport.size

    @property
    def clocks_step(self) -> bool:
        """Whether this rank's clock times the step (`step_seconds` takes the slowest
        such rank's): every rank's, unless the rank only waits for another's work."""
        return True

    @abstractmethod
    def train_step(self, x: Tensor, y: Any, loss_fn: LossFn) -> float:
        """One forward and backward pass over the whole batch; the loss (see the class)."""

    @abstractmethod
    def parameters(self) -> list[nn.Parameter]:
        """This rank's trainable parameters."""

    @abstractmethod
    def eval_forward(self, x: Tensor) -> Tensor:
        """The whole output for `x` on every rank, without gradients."""

    @abstractmethod
    def gather_state_dict(self) -> dict[str, Tensor]:
        """The whole net's state dict on every rank (loads into the serial `ODENet`)."""

    #: whether ranks run parts of the batch's rows (data parallelism's shares, a
    #: pipeline's micro-batches): the input's gradient is then no rank's whole
    splits_rows: ClassVar[bool] = False
    #: torch.distributed groups of the method's own on which torch waits itself (a
    #: pipeline schedule's messages, DistributedDataParallel's all-reduce): `_apart`
    #: severs them where a step breaks off
    _groups: Sequence[Any] = ()

    @contextlib.contextmanager
    def _apart(self, alike: bool = False) -> Iterator[None]:
        """Around work the ranks do apart (each its part of a step, with messages
        between them): where it raises on this rank, every rank stops with the
        message instead of waiting for this one.  The failure is posted on the
        transport's error channel (a rank waiting in layerpar's messages raises
        RemoteError naming this rank) and the method's own groups are severed (a rank
        blocked in torch's waits raises, then reads the posted failure:
        `Transport.stopped_by`).  The method is stopped then: later calls raise.
        `alike`: around agreements, whose errors every rank raises alike (refusals,
        which stop nothing); only a failure another rank posted meanwhile severs."""
        try:
            yield
        except BaseException as exc:
            if not alike:
                err = self.transport.stopped_by(exc)
            elif self.transport.failure is None:
                raise
            else:
                err = exc
            if self._groups:
                from ...mgrit.transport.torchdist import sever

                for g in self._groups:
                    sever(g)
            if err is exc:
                raise
            raise err from exc

    def _usable(self) -> None:
        """Raise if the method was closed, or stopped by a failure (`_apart`)."""
        if getattr(self, "_closed", False):
            raise RuntimeError(f"this {type(self).__name__} was closed (its communicator "
                               "released): build a new one to train on")
        failure = self.transport.failure
        if failure is not None:
            raise RuntimeError(f"this {type(self).__name__} stopped when a step failed "
                               f"({failure}): build a new one to train on") from failure

    def close(self) -> None:
        """Release the duplicated communicator (collective); the method is done."""
        self._closed = True
        self.transport.close()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's trainable parameters under their names in the serial net."""
        raise NotImplementedError

    def module(self) -> nn.Module:
        """What runs this rank's passes (the net, or the `LayerParallel`): `train` and
        `eval` set its mode."""
        net = getattr(self, "net", None)
        if not isinstance(net, nn.Module):
            raise NotImplementedError(f"{type(self).__name__} has no module")
        return net

    def train(self, mode: bool = True) -> TrainingMethod:
        """Training mode (or evaluation mode, False) for the modules, as
        `nn.Module.train` sets it: batch norm's statistics, dropout."""
        self.module().train(mode)
        return self

    def eval(self) -> TrainingMethod:
        """Evaluation mode (`train(False)`)."""
        return self.train(False)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> Tensor:
        """`torch.nn.utils.clip_grad_norm_` over the whole net's gradients, the same
        norm on every rank (collective: call it on every rank after `train_step`).
        Here every rank holds the whole net's gradients (serial, data parallelism);
        a method whose ranks hold parts (the pipeline, layer-parallel) combines the
        ranks' parts, where ``clip_grad_norm_(method.parameters(), ...)`` would clip
        each rank by its own part.  Returns the total norm (float64)."""
        params = self.parameters()
        return clip_over_ranks(params, params, None, max_norm, norm_type,
                               error_if_nonfinite)

    # -- helpers for subclasses ------------------------------------------------------------
    def _zero_grad(self) -> None:
        for p in self.parameters():
            p.grad = None

    def _batch_error(self, x: Tensor, y: Any) -> Optional[BaseException]:
        """What is wrong with this batch for this method (checked alike on every rank)."""
        if not isinstance(x, Tensor) or x.dim() == 0:
            return TypeError(f"`x` must be a tensor with a batch dimension, got "
                             f"{type(x).__name__}")
        ry = _rows(y)
        if ry is not None and ry != x.shape[0]:
            return ValueError(f"`y` has {ry} rows but `x` has {x.shape[0]}: they must be "
                              "the same batch")
        if x.requires_grad and self.splits_rows and self.size > 1:
            return ValueError(f"`x` requires grad: {type(self).__name__} runs parts of the "
                              "batch on different ranks, so no rank would hold the input's "
                              "gradient (train with SerialMethod or LayerParallel, which "
                              "give it)")
        return None

    def _check_batch(self, x: Tensor, y: Any) -> None:
        """Raise the batch's error the same way on every rank; for the first
        `check_inputs` steps also compare the shapes and dtypes between ranks."""
        self._usable()
        err = self._batch_error(x, y)
        self._steps += 1
        if self.size > 1 and self._steps <= self.check_inputs:
            key = tuple((tuple(t.shape), str(t.dtype)) if isinstance(t, Tensor) else
                        type(t).__name__ for t in (x, y))
            with self._apart(alike=True):  # (a rank ahead may fail meanwhile)
                self.transport.agree(key, err, "the batch's shapes and dtypes (`x`, `y`): "
                                     "every rank must pass the whole batch")
        elif err is not None:
            raise err

    @staticmethod
    def _loss_value(loss: Tensor) -> float:
        return float(loss.detach())


class SerialMethod(TrainingMethod):
    """The serial `ODENet` in this process, plain autograd: the reference every other
    method is compared with (one rank).

    comm: None (one process), or a communicator whose every rank trains a whole copy of
        the net on the whole batch (replicated serial: rank 0's parameters and buffers
        are copied to the others first, and from then on every rank computes the same
        numbers; the communicator compares the ranks' batches and decisions).  Nothing
        is split, so it is as fast as one rank alone: what a parallel method must beat.
    """

    name = "serial"

    def __init__(self, net: Union[ODENet, Callable[[], ODENet]], comm: Any = None) -> None:
        self.transport = SerialTransport() if comm is None else make_transport(comm)
        err: Optional[BaseException] = None
        try:
            self.net = as_net(net)
        except Exception as exc:  # noqa: BLE001 - raised alike on every rank by agree
            err = exc
        if self.size > 1:
            self.transport.agree("serial", err, "SerialMethod's net")
            state = self.transport.bcast_object(
                self.net.state_dict() if self.rank == 0 else None, 0)
            self.net.load_state_dict(state)
        elif err is not None:
            raise err

    def train_step(self, x: Tensor, y: Any, loss_fn: LossFn) -> float:
        self._check_batch(x, y)
        self._zero_grad()
        loss = loss_fn(self.net(x), y)
        loss.backward()
        return self._loss_value(loss)

    def parameters(self) -> list[nn.Parameter]:
        return [p for p in self.net.parameters() if p.requires_grad]

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return ((n, p) for n, p in self.net.named_parameters() if p.requires_grad)

    def eval_forward(self, x: Tensor) -> Tensor:
        with torch.no_grad():
            return self.net(x)

    def gather_state_dict(self) -> dict[str, Tensor]:
        return {k: v.detach().cpu() for k, v in self.net.state_dict().items()}


def step_seconds(method: TrainingMethod, x: Tensor, y: Any, loss_fn: LossFn,
                 repeats: int, bound: float = float("inf"), warm: bool = False,
                 keep_grads: bool = False) -> float:
    """Fewest seconds of `method`'s ``train_step`` on the batch, the slowest rank's
    (of those whose clock times it, `TrainingMethod.clocks_step`), on every rank
    (collective): a warm-up step (none if `warm`: the method ran this batch already),
    then at most `repeats` timed ones, by the rule the auto-tuning times its passes
    with (`timing.gauged_seconds`, against `bound`, the time to beat: a clearly slower
    candidate is not timed further).  `.grad` is cleared after (nothing steps), unless
    `keep_grads`: then the last step's gradient of the batch stays (the caller clears
    it)."""
    try:
        seconds = gauged_seconds(lambda: method.train_step(x, y, loss_fn),
                                 method.transport, repeats, bound, warm=warm,
                                 cuda=x.is_cuda, what="the step timings",
                                 counted=method.clocks_step)
    except BaseException:
        method._zero_grad()
        raise
    if not keep_grads:
        method._zero_grad()
    return seconds


def node_cores() -> int:
    """The cores this process may run on (its CPU affinity; else the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - no affinity on this system
        return os.cpu_count() or 1


def thread_counts(cores: Optional[int] = None) -> list[int]:
    """The torch thread counts a probe tries: 1, 2, 4, ... below `cores`, and `cores`
    itself (default: `node_cores`)."""
    cores = node_cores() if cores is None else positive_int("cores", cores)
    return sorted({1, cores} | {2 ** k for k in range(1, cores.bit_length()) if 2 ** k < cores})


class SoloMethod(TrainingMethod):
    """The serial net on rank 0 alone, with every core there, while the other ranks
    wait: where nothing parallel pays, the best serial run inside a parallel job.

    net: an `ODENet` or a factory (built on every rank; rank 0's trains).
    comm: the job's communicator (its other ranks wait patiently, sleeping between
        tests from the start, `Transport.patiently`: rank 0 has every core).
    threads: torch threads rank 0 runs with during its passes (default: the cores this
        process may use, `node_cores`; `tune_threads` measures the fastest); set back
        after each pass, unless `hold_threads` holds them until `close`.

    Rank 0 trains the parameters; elsewhere their `.grad` stays None, so an optimizer
    there (over `parameters()`, as on rank 0) changes nothing.  The loss,
    `eval_forward`'s output and `gather_state_dict` come from rank 0 to every rank.
    """

    name = "solo"

    def __init__(self, net: Union[ODENet, Callable[[], ODENet]], comm: Any = None, *,
                 threads: Optional[int] = None) -> None:
        self.transport = SerialTransport() if comm is None else make_transport(comm)
        err: Optional[BaseException] = None
        try:
            self.net = as_net(net)
            self.threads = node_cores() if threads is None else positive_int("threads",
                                                                            threads)
        except Exception as exc:  # noqa: BLE001 - raised alike on every rank by agree
            err = exc
        if self.size > 1:
            self.transport.agree("solo", err, "SoloMethod's net and threads")
        elif err is not None:
            raise err
        self._held: Optional[int] = None  # torch's thread count before `hold_threads`

    def hold_threads(self) -> None:
        """Run rank 0 at `threads` from now until `close`, not only inside its passes:
        the optimizer's step between them then runs at it too, as in the serial run
        solo stands for (at one thread, Adam's step over the pre-norm MNIST-1D net's 4
        million parameters is several percent of its pass)."""
        if self.rank == 0:
            if self._held is None:
                self._held = torch.get_num_threads()
            torch.set_num_threads(self.threads)

    def close(self) -> None:
        if self._held is not None:
            torch.set_num_threads(self._held)
            self._held = None
        super().close()

    @property
    def clocks_step(self) -> bool:
        # the other ranks only wait (and see the end of rank 0's pass up to a
        # millisecond late, `Transport.patiently`): rank 0's clock is the step's
        return self.rank == 0

    def tune_threads(self, x: Tensor, y: Any, loss_fn: LossFn, repeats: int = 3,
                     bound: float = float("inf"),
                     counts: Optional[Sequence[int]] = None,
                     keep_grads: bool = False) -> dict[int, float]:
        """Time the step at each torch thread count of `counts` (default
        `thread_counts()`: 1, 2, 4, ... and every core), the most first, each by
        `step_seconds` against the fastest so far (and `bound`), and keep the fastest
        as `threads` (the fewest on a tie): a small net runs a batch fastest on one
        thread, where every core would cost it several times over.  Only the first
        count has a warm-up step: the batch's one-time costs are paid by then, and
        fewer threads start none (the most go first).  Returns the seconds per count,
        the same on every rank (collective).  `keep_grads`: rank 0's parameters keep
        the last step's gradient of the batch, the serial net's (`step_seconds`)."""
        err: Optional[BaseException] = None
        try:
            tried = thread_counts() if counts is None else sorted(
                {positive_int("counts", k) for k in counts})
            if not tried:
                raise ValueError("`counts` must name at least one thread count")
        except Exception as exc:  # noqa: BLE001 - raised alike on every rank by agree
            err = exc
        if self.size > 1:
            self.transport.agree(None, err, "SoloMethod's thread counts")
            tried = self.transport.bcast_object(tried, 0)  # rank 0's cores count
        elif err is not None:
            raise err
        per: dict[int, float] = {}
        for k in reversed(tried):
            self.threads = k
            per[k] = step_seconds(self, x, y, loss_fn, repeats,
                                  min(bound, *per.values()) if per else bound,
                                  warm=bool(per), keep_grads=keep_grads)
        self.threads = min(per, key=lambda k: (per[k], k))
        return per

    def _on_root(self, fn: Callable[[], Any]) -> Any:
        """`fn()` on rank 0 at `threads` torch threads; its result on every rank."""
        if self.rank != 0:
            with self.transport.patiently():  # (spinning would take a core from rank 0)
                return self.transport.bcast_object(None, 0)
        keep = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            with self._apart():  # (a failure here stops the waiting ranks too)
                value = fn()
        finally:
            torch.set_num_threads(keep)
        return self.transport.bcast_object(value, 0) if self.size > 1 else value

    def train_step(self, x: Tensor, y: Any, loss_fn: LossFn) -> float:
        self._check_batch(x, y)
        self._zero_grad()

        def step() -> float:
            loss = loss_fn(self.net(x), y)
            loss.backward()
            return self._loss_value(loss)

        return float(self._on_root(step))

    def parameters(self) -> list[nn.Parameter]:
        return [p for p in self.net.parameters() if p.requires_grad]

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return ((n, p) for n, p in self.net.named_parameters() if p.requires_grad)

    def eval_forward(self, x: Tensor) -> Tensor:
        def run() -> Tensor:
            with torch.no_grad():
                return self.net(x)

        out = self._on_root(run)
        return out.to(x.device) if isinstance(out, Tensor) else out

    def gather_state_dict(self) -> dict[str, Tensor]:
        return dict(self._on_root(
            lambda: {k: v.detach().cpu() for k, v in self.net.state_dict().items()}))


class LayerParallelMethod(TrainingMethod):
    """A `LayerParallel` behind the common interface.

    model: a `LayerParallel`, or an `ODENet` (or factory) to build one from, with `comm`
        and any other `LayerParallel` arguments (`options`, `backward_options`, ...).
    `close()` closes the model.
    """

    name = "layerparallel"

    def __init__(self, model: Any, comm: Any = None, *args: Any, **kwargs: Any) -> None:
        from ..model import LayerParallel

        if not isinstance(model, LayerParallel):
            model = LayerParallel(model, comm, *args, **kwargs)
        elif comm is not None or args or kwargs:
            raise TypeError("pass `comm` and LayerParallel arguments only with a net, not "
                            "with a built LayerParallel")
        self.model = model
        self.transport = model.transport
        self.check_inputs = 0  # the model compares its own inputs (`check_inputs`)

    def train_step(self, x: Tensor, y: Any, loss_fn: LossFn) -> float:
        err = self._batch_error(x, y)
        if err is not None:
            raise err
        self._zero_grad()
        loss = loss_fn(self.model(x), y)
        loss.backward()
        return self._loss_value(loss)

    def parameters(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> Tensor:
        return self.model.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return ((n, p) for n, p in self.model.named_parameters() if p.requires_grad)

    def eval_forward(self, x: Tensor) -> Tensor:
        with torch.no_grad():
            return self.model(x)

    def module(self) -> nn.Module:
        return self.model  # type: ignore[no-any-return]

    def gather_state_dict(self) -> dict[str, Tensor]:
        return self.model.gather_state_dict()

    def close(self) -> None:
        self.model.close()


def check_check_inputs(value: Any) -> int:
    """`check_inputs` validated (a count of first steps, >= 0)."""
    return nonneg_int("check_inputs", value)
