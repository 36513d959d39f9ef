"""Replicated serial: every rank runs the whole net with plain autograd.

Where no MGRIT setting pays, exact propagation over P > 1 ranks is a pipeline with a
single micro-batch: each rank waits for the others, so it is slower than one rank
running the net alone.  `ReplicatedSerial` steps aside instead: every rank runs the
whole `ODENet` serially, as the serial oracle does, and the result is the serial
net's, on every rank.

- **Parameters.**  A private copy of the net whose layers owned by this rank are
  the model's own modules' tensors (the real `Parameter` objects the user's
  optimizer holds: `copy.deepcopy` with those tensors in its memo), so autograd puts
  their gradients straight into their `.grad` and the optimizer is unchanged.  The
  other ranks' layers are copies with ``requires_grad=False`` (no gradient is
  computed for them: their owners compute their own).
- **Refresh.**  Before each pass one all-gather per dtype (into buffers laid out
  once: the owners are known on every rank) carries every rank's own tensors
  (parameters and buffers); the copies of the others' layers live in its receive
  buffer (their storage is a view of it), so the exchange itself updates them.
  Every pass: a fused optimizer (``torch.optim.Adam(fused=True)``) writes in place
  without bumping version counters, so no cheaper test of change is reliable.
- **Batch split** (``split=True``; `split_supported`: not with batch norm, whose
  statistics would be a share's, nor, given the batch, with a module of the user's
  that couples rows, found by running the net on a few rows: `probe_rows`). Every rank
  runs the whole net on its share of the batch's rows; the outputs are all-gathered,
  so every rank holds the whole output and loss; backward, each rank back-propagates
  its rows, one all-reduce sums the parameter (and input) gradients, flat and laid out
  by owner, and each keeps its own parameters' sums (one slice of it): the batch's
  gradient to round-off, the arithmetic shared over the ranks. The trainable set is
  read per pass, as the layer-parallel passes read it: each rank's parameters'
  ``requires_grad`` flags travel with the refresh, so a block frozen or unfrozen on
  its owner changes the layout on every rank at the same pass; a rank left with
  nothing trainable joins the backward through an anchor.
- **Moves.**  `apply` (what `.to()`, `.float()`, `.cuda()` ... apply to the model)
  builds the private net again from the model's tensors as they are then.
- **Identical on every rank.**  The same input, the same parameter values and the
  same code on every rank give the same output and loss; each rank's gradients are
  those of the serial net for its own layers.

Not offered (`supported`) on one rank (direct mode is plain serial autograd already),
under data parallelism (the gradient averaging belongs to the layer-parallel pass),
and for nets with dropout (each rank would draw its own masks).
"""
from __future__ import annotations

import contextlib
import copy
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional, Union

import torch
from torch import Tensor, nn
from torch.autograd.variable import Variable

from ..mgrit.options import MGRITOptions
from ..ode.flat import generation as flat_generation
from ..ode.net import copying_stale
from ..ode.rng import DROPOUT_TYPES, GeneratorStates
from .grads import hooks_held
from .move import gather_rows

if TYPE_CHECKING:
    from .model import LayerParallel

__all__ = ["ReplicatedSerial", "RowProbe", "agreed_rows", "probe_rows", "split_supported",
           "supported"]

#: the batch norms, whose statistics a split batch changes
BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def supported(model: LayerParallel) -> Optional[str]:
    """None if `model` can run replicated, else why not."""
    if model.size == 1:
        return "one rank: direct mode is serial autograd already"
    if model.averages_replicas:
        return "data parallelism averages gradients inside the layer-parallel pass"
    if model.has_dropout:
        return "the net has dropout: each rank would draw its own masks"
    return None


def split_supported(model: LayerParallel, x: Optional[Tensor] = None) -> Optional[str]:
    """None if `model` can run replicated with the batch split over the ranks, else
    why not (on top of `supported`).  With the batch `x`, a net whose rows its
    modules couple (`probe_rows` on the whole net, rank 0's verdict on every rank:
    collective) is refused too, as batch norm is; so is one that cannot run whole on
    a rank to be probed (the other ranks' layers are stale copies there, left behind
    by a move to another device)."""
    why = supported(model)
    if why is None:
        why = split_refusal(model.whole_net)
    if why is None and x is not None:
        rows = agreed_rows(model.whole_net, x, model.transport, refuse_failure=True)
        why = rows.coupled
    return why


def split_refusal(net: nn.Module) -> Optional[str]:
    """Why the net itself cannot run replicated with the batch split (None: it can):
    batch norm (its statistics would be a share's), or trainable parameters of
    several dtypes (the gradients' all-reduce is one flat buffer).  What only a pass
    can tell (a module of the user's that couples rows) is `probe_rows`'."""
    if _has_batch_norm(net):
        return BATCH_NORM_WHY
    if len({p.dtype for p in net.parameters() if p.requires_grad}) > 1:
        return "the net's parameters have several dtypes"
    return None


#: why a split batch is not the serial net's where it holds batch norm
BATCH_NORM_WHY = "the net has batch norm: its statistics would be a share of the batch's"


def _has_batch_norm(net: nn.Module) -> bool:
    return any(isinstance(m, BATCH_NORMS) for m in net.modules())


#: the rows `probe_rows` runs the net on (and on half of them): enough for a batch
#: statistic to differ between the two, few enough to cost nothing beside a step
PROBE_ROWS = 8


#: module types whose forward computes each row on its own and moves no buffer: torch's
#: and layerpar's, matched by exact type (a subclass's forward may do otherwise), so a
#: net built of these (and batch norm, known by type) is not run by `probe_rows`
ROW_WISE: tuple[type, ...] = (
    nn.Linear, nn.Bilinear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d,
    nn.ConvTranspose2d, nn.ConvTranspose3d, nn.Identity, nn.Sequential, nn.ModuleList,
    nn.ModuleDict, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.Tanh, nn.ReLU, nn.ReLU6,
    nn.GELU, nn.SiLU, nn.Mish, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU,
    nn.Softplus, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.AvgPool1d, nn.AvgPool2d,
    nn.AvgPool3d, nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d,
    nn.AdaptiveMaxPool3d, nn.Embedding, *DROPOUT_TYPES)


def _row_wise_by_type(net: nn.Module) -> bool:
    """Whether every module of `net` is of a type known to keep rows apart (`ROW_WISE`,
    layerpar's nets and blocks, batch norm, a flatten or unflatten that keeps dim 0)."""
    from ..ode import blocks
    from ..ode.net import ODENet, Segment

    ours = (ODENet, Segment, blocks.Dense, blocks.Conv, blocks.Conv1d, blocks.PreNorm,
            blocks.Transformer)
    for m in net.modules():
        t = type(m)
        if t in ROW_WISE or t in ours or t in BATCH_NORMS or _compiled(m):
            continue  # (a compiled module: its original is among the modules)
        if isinstance(m, nn.Flatten) and t is nn.Flatten and m.start_dim >= 1 or \
                isinstance(m, nn.Unflatten) and t is nn.Unflatten and m.dim >= 1:
            continue
        return False
    return True


def _compiled(m: nn.Module) -> bool:
    """Whether `m` is `torch.compile`'s wrapper of a module (its `_orig_mod`)."""
    return type(m).__name__ == "OptimizedModule" and isinstance(
        getattr(m, "_orig_mod", None), nn.Module)


class RowProbe(NamedTuple):
    """What `probe_rows` found: why the net's rows are coupled, why its buffers move in
    forward, why it draws random numbers outside torch's dropout modules (None: they
    are not, they do not, it does not; where it draws, `coupled` is not measured)."""

    coupled: Optional[str]
    buffers: Optional[str]
    random: Optional[str] = None


def probe_rows(net: nn.Module, x: Tensor) -> RowProbe:
    """Whether `net`, in training mode, computes each row of a batch on its own, and
    leaves its buffers alone in forward: what splitting a batch (over ranks, or into a
    pipeline's micro-batches) assumes of it, measured on the batch `x`.

    Batch norm is known by its type, and a net of `ROW_WISE` modules (layerpar's
    blocks among them) keeps rows apart; a module of the user's that normalises by a
    batch statistic, or keeps a running one, is known by neither, so the net runs (no
    autograd, dropout off) on the batch's first `PROBE_ROWS` rows and on the first
    half of them.  Where the outputs for the shared rows differ beyond round-off (the square
    root of the dtype's epsilon, relative to the largest entry), both run again with
    every module's output kept, and the first module (innermost, in the order calls
    finish) whose output differs is named.  A buffer other than batch norm's whose
    version moved in the first run is a running statistic, which each rank's share
    would update apart.  A forward that raises on the half is reported as coupled.
    Compiled modules run eagerly (no compilation for the probe's batches).
    Generators, buffers and training flags are put back; no parameter is touched.
    Local: callers agree on one rank's verdict."""
    n = int(x.shape[0]) if x.dim() else 0
    if n < 2:
        return RowProbe(None, None)
    if _row_wise_by_type(net):  # (nothing to run: batch norm, if any, by its type)
        return RowProbe(BATCH_NORM_WHY if _has_batch_norm(net) else None, None)
    k = min(n, PROBE_ROWS)
    h = k // 2
    bn = {id(t) for m in net.modules() if isinstance(m, BATCH_NORMS)
          for t in m.buffers(recurse=False)}
    buffers = list(net.named_buffers())
    versions = [b._version for _, b in buffers]
    drawn: list[nn.Module] = []
    try:
        whole, half = _probe_runs(net, x, k, h, None, drawn)
    except _HalfRaised as exc:
        return RowProbe(str(exc), None)
    moved = [name for (name, b), v in zip(buffers, versions)
             if b._version != v and id(b) not in bn]
    why_buf = None if not moved else (
        f"buffer(s) {moved[:3]}{f' and {len(moved) - 3} more' if len(moved) > 3 else ''} "
        "change in forward (a running statistic: over a split batch each rank's would "
        "follow its own share, and micro-batches would update it once each)")
    names = {id(m): name or "the net" for name, m in net.named_modules()}
    if drawn:  # (its draws differ with the batch's size: rows are not compared)
        mod = drawn[0]
        return RowProbe(None, why_buf, (
            f"{names.get(id(mod), '?')} ({type(mod).__name__}) draws random numbers in "
            "forward() outside torch's dropout modules (F.dropout, torch.rand_like ...): "
            "split over ranks or stages, each would draw from its own generator, not as "
            "serial training does"))
    if not _rows_differ(whole, half, h):
        return RowProbe(None, why_buf)
    calls: list[list[tuple[nn.Module, Optional[Tensor]]]] = [[], []]
    _probe_runs(net, x, k, h, calls)
    for (mod, a), (mod2, b) in zip(*calls):
        if mod is not mod2:
            break  # (the calls diverged: the net is named)
        if a is not None and b is not None and _rows_differ(a, b, h):
            return RowProbe(f"{names.get(id(mod), '?')} ({type(mod).__name__}) gives a "
                            "row another output when the batch holds other rows (a batch "
                            f"statistic, found on {h} rows run with {k} and alone)",
                            why_buf)
    return RowProbe(f"the net ({type(net).__name__}) gives a row another output when the "
                    f"batch holds other rows (found on {h} rows run with {k} and alone)",
                    why_buf)


def agreed_rows(net: nn.Module, x: Tensor, transport: Any,
                refuse_failure: bool = False) -> RowProbe:
    """`probe_rows` on every rank, rank 0's verdict kept by all (collective).  A forward
    that raises raises alike on every rank, or (`refuse_failure`) is the verdict
    "coupled", saying why."""
    rows, err = RowProbe(None, None), None
    try:
        rows = probe_rows(net, x)
    except Exception as exc:  # noqa: BLE001 - raised alike below, or the verdict
        if not refuse_failure:
            err = exc
        else:
            rows = RowProbe(f"the net did not run whole on a rank, to check that it keeps "
                            f"rows apart ({type(exc).__name__}: {exc})", None)
    if transport.size == 1:
        if err is not None:
            raise err
        return rows
    transport.agree(None, err, "the probe of the net's rows")
    return transport.bcast_object(rows, 0)


class _HalfRaised(Exception):
    """The probe's forward on the half batch raised (its text: the verdict)."""


def _rows_differ(a: Any, b: Any, h: int) -> bool:
    """Whether the first `h` rows of output `a` differ from output `b` (`h` rows) beyond
    round-off; outputs that are not row-indexed floating tensors are not compared."""
    if not (isinstance(a, Tensor) and isinstance(b, Tensor)) or not a.is_floating_point() \
            or a.dim() == 0 or b.dim() == 0:
        return False
    a = a[:h]
    if a.shape != b.shape:
        return True
    gap = float((a - b).abs().max())
    scale = float(a.abs().max())
    return (gap / scale if scale > 0 else gap) > float(torch.finfo(a.dtype).eps) ** 0.5


def _probe_runs(net: nn.Module, x: Tensor, k: int, h: int,
                calls: Optional[list[list[tuple[nn.Module, Optional[Tensor]]]]],
                drawn: Optional[list[nn.Module]] = None) -> tuple[Any, Any]:
    """`probe_rows`' two forwards (`k` rows, then `h`) in training mode, dropout off,
    no autograd, from the same generator states, each module's row-indexed output
    kept in `calls` where given; buffers, generators and flags put back.  Where the
    first forward moved a generator, `drawn` gets the first module whose call ended
    after it moved (found by a forward of `h` rows with hooks)."""
    run = [0]
    streams = GeneratorStates([net])  # (its own generators: every submodule's)

    def hook(mod: nn.Module, _inp: Any, out: Any) -> None:
        if calls is None:  # (the search for the module that draws)
            if drawn is not None and not drawn and streams.moved():
                drawn.append(mod)
            return
        rows = (k, h)[run[0]]
        keep = out.detach().clone() if isinstance(out, Tensor) and out.dim() \
            and out.shape[0] == rows else None
        calls[run[0]].append((mod, keep))

    buffers = [b for b in net.buffers()]
    saved = [b.detach().clone() for b in buffers]
    flags = [(m, m.training) for m in net.modules()]
    handles = [m.register_forward_hook(hook) for m in net.modules()] if calls is not None \
        else []
    outs = []
    try:
        net.train()
        for m in net.modules():
            if isinstance(m, DROPOUT_TYPES):
                m.eval()
        # (compiled modules run eagerly: the probe's two small batches would each cost
        # a compilation; the stance only where one is: it imports torch's compiler,
        # 1.1 s on the 2-core machine)
        eager = torch.compiler.set_stance("force_eager") if any(
            _compiled(m) for m in net.modules()) else contextlib.nullcontext()
        with torch.no_grad(), eager:
            for i, rows in enumerate((k, h)):
                run[0] = i
                streams.restore()
                try:
                    outs.append(net(x[:rows]))
                except Exception as exc:
                    if i == 0:
                        raise
                    raise _HalfRaised(f"its forward on {h} of a batch's rows raised "
                                      f"{type(exc).__name__}: {exc}") from exc
                finally:
                    for b, v in zip(buffers, saved):
                        b.copy_(v)
                if i == 0 and drawn is not None and streams.moved():
                    streams.restore()
                    handles = [m.register_forward_hook(hook) for m in net.modules()]
                    try:
                        net(x[:h])
                    finally:
                        for hd in handles:
                            hd.remove()
                        for b, v in zip(buffers, saved):
                            b.copy_(v)
                    if not drawn:
                        drawn.append(net)
    finally:
        for hd in handles:
            hd.remove()
        for m, flag in flags:
            m.training = flag
        streams.restore()
    return outs[0], outs[1]


class _SplitBatch(torch.autograd.Function):
    """Every rank runs the whole net on its share of the batch's rows; the outputs are
    gathered, so every rank holds the whole batch's output.  Backward: each rank
    back-propagates its rows through the whole net, one all-reduce sums the parameter
    gradients (and the input's), and each rank keeps its own parameters' sum."""

    @staticmethod
    def forward(ctx: Any, rep: ReplicatedSerial, graph: bool, x: Tensor,
                *own: Tensor) -> Tensor:
        n, size, r = x.shape[0], rep.transport.size, rep.rank
        whole = n < size  # fewer rows than ranks: every rank runs them all, no exchange
        lo, hi = (0, n) if whole else (r * n // size, (r + 1) * n // size)
        with torch.set_grad_enabled(graph):  # (graph: grad mode where the pass was called)
            xl = x[lo:hi].detach().requires_grad_(graph and x.requires_grad)
            out = rep.net(xl)
        ctx.rep, ctx.out, ctx.xl, ctx.rows, ctx.n = rep, out, xl, (lo, hi), n
        ctx.whole = whole
        # this pass's trainable set (the same on every rank; it may change by the next)
        ctx.layout = (rep._trainable, rep._own, rep._own_at, rep._own_span)
        ctx.anchored = bool(own) and not rep._own
        if whole:
            return out.detach()
        return gather_rows(rep.transport, out.detach(),
                           [(q + 1) * n // size - q * n // size for q in range(size)],
                           "the outputs of the batch's shares")

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        rep, (lo, hi), dx_wanted = ctx.rep, ctx.rows, ctx.xl.requires_grad
        trainable, own_tensors, own_at, own_span = ctx.layout
        wrt = trainable + [ctx.xl] if dx_wanted else trainable
        with torch.enable_grad():
            got = _grad(ctx.out, wrt, grad[lo:hi])
        # this rank's rows' gradients in one fresh buffer (autograd may hand the sums on
        # to the caller), laid out by owner; then the input's (zero outside its rows)
        parts = [torch.zeros_like(t) if g is None else g for t, g in zip(trainable, got)]
        if dx_wanted:
            dx = grad.new_zeros((ctx.n, *ctx.xl.shape[1:]))
            if got[-1] is not None:
                dx[lo:hi] = got[-1]
            parts.append(dx)
        flat = torch._C._nn.flatten_dense_tensors(parts) if parts else grad.new_zeros(0)
        if not ctx.whole:  # (whole: this rank's own gradients are complete already)
            rep.transport.allreduce_start(flat, "the batch's shares' gradients").wait()
        dx_all = flat[flat.numel() - dx.numel():].view_as(dx) if dx_wanted else None
        # this rank's own sums: views of one slice where they lie together
        if ctx.anchored:
            return (None, None, dx_all, None)
        if own_span is not None:
            own = torch._C._nn.unflatten_dense_tensors(
                flat[own_span[0]:own_span[1]], own_tensors)
        else:
            every = torch._C._nn.unflatten_dense_tensors(flat, trainable)
            own = [every[k] for k in own_at]
        return (None, None, dx_all, *own)


def _grad(out: Tensor, wrt: list[Tensor], g: Tensor) -> tuple[Optional[Tensor], ...]:
    """``torch.autograd.grad(out, wrt, g, allow_unused=True)`` (`g` shaped like `out`)
    straight through the engine's entry point (the one `torch.autograd.grad` calls,
    the same arguments since torch 1.9), without the Python argument handling that
    costs ~50 us a call with 19 inputs.  A torch without that private entry point
    gets `torch.autograd.grad` itself."""
    with hooks_held(wrt):  # run once, where the split's node hands them on
        if _ENGINE is None:
            return torch.autograd.grad(out, wrt, g, allow_unused=True)
        return _ENGINE.run_backward((out,), (g,), False, False, tuple(wrt), True, False)


_ENGINE = getattr(Variable, "_execution_engine", None)


def _views(flat: Tensor, tensors: list[Tensor]) -> list[Tensor]:
    """Consecutive views of `flat` shaped like `tensors`."""
    out, at = [], 0
    for t in tensors:
        out.append(flat[at:at + t.numel()].view(t.shape))
        at += t.numel()
    return out


class _Exchange(NamedTuple):
    """One dtype's share of the refresh (see `ReplicatedSerial.__init__`)."""

    send: Tensor
    recv: Tensor
    mine: list[Tensor]  # this rank's tensors (flat where `into` is one tensor)
    into: Union[Tensor, list[Tensor]]  # the head of `send` they fill, or its views
    copies: list[Tensor]  # what is copied out of `recv` after the exchange
    views: list[Tensor]  # ... from these views of it
    own: list[Tensor]  # this rank's tensors themselves (`mine` are detached views)


def _send_side(send: Tensor, own: list[Tensor]) -> tuple[list[Tensor], Any]:
    """(`mine`, `into`) of an exchange: detached views of this rank's tensors `own`,
    flat where all are contiguous CPU tensors (one concatenation fills the head of
    `send`), else as they are, with views of `send` to copy them into."""
    mine = [t.detach() for t in own]
    if mine and all(t.device.type == "cpu" and t.is_contiguous() for t in mine):
        return [t.view(-1) for t in mine], send[:sum(t.numel() for t in mine)]
    return mine, _views(send, mine)


def _copy(dst: list[Tensor], src: list[Tensor]) -> None:
    """dst[i] <- src[i]: one call where all are CPU tensors, else one per tensor."""
    if not dst:
        return
    if all(t.device.type == "cpu" for t in (*dst, *src)):
        torch._foreach_copy_(dst, src)
    else:
        for d, t in zip(dst, src):
            d.copy_(t)


def _no_seed() -> None:
    """`ODENet.forward_seed` of a net without dropout."""
    return None


def _named_tensors(net: nn.Module) -> list[tuple[str, Tensor]]:
    """The net's parameters and buffers, each once, in a fixed order."""
    seen: set[int] = set()
    out = []
    for name, t in [*net.named_parameters(), *net.named_buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            out.append((name, t))
    return out


class ReplicatedSerial:
    """The whole net, run serially on every rank of `model` (collective to build:
    one exchange says who owns what).  See the module docstring."""

    #: what the autotuner and the gradient checks read off a setting
    options = MGRITOptions(max_levels=1)
    backward_options = options
    accuracy = None

    def __init__(self, model: LayerParallel, split: bool = False) -> None:
        why = split_supported(model) if split else supported(model)
        if why is not None:
            raise ValueError(f"replicated serial{' (batch split)' if split else ''} is not "
                             f"available here: {why}")
        self.split = split
        self.model = model
        self.transport = model.transport
        self.rank = model.rank
        named = _named_tensors(model.whole_net)
        mine = {id(t) for t in model.parameters()} | {id(b) for b in model.buffers()}
        self._local = [i for i, (_, t) in enumerate(named) if id(t) in mine]
        owners: list[Optional[int]] = [None] * len(named)
        for r, got in enumerate(self.transport.allgather_object(
                self._local, "the replicated net's owners")):
            for i in got:
                if owners[i] is None:
                    owners[i] = r
        self._owners = owners
        # joins the backward of the batch split on a rank with nothing of its own to
        # differentiate (the others' all-reduce waits for it)
        self._anchor = torch.zeros((), requires_grad=True)
        self.training = model.training
        self.last_forward: list[Any] = []
        self.last_backward: list[Any] = []
        self._build()

    def _build(self, fn: Optional[Callable[[Tensor], Tensor]] = None) -> None:
        """The private net and the refresh's exchange, laid out from the owners (no
        message: they are known on every rank).  `fn`: what `nn.Module._apply` applies
        (`.to()`, `.double()`, `.cuda()` ...), applied to the copies of the others'
        tensors (this rank's own are the model's, which it moved already)."""
        model, owners = self.model, self._owners
        net: nn.Module = model.whole_net
        named = _named_tensors(net)
        local = self._local
        # a private net: this rank's tensors are the real ones, the others' copies
        memo: dict[int, Any] = {id(named[i][1]): named[i][1] for i in local}
        with copying_stale():  # (the others' layers are refreshed from their owners)
            self.net: nn.Module = copy.deepcopy(net, memo)
        if fn is not None:
            self.net._apply(fn)
        rep = _named_tensors(self.net)
        if [n for n, _ in rep] != [n for n, _ in named]:
            raise RuntimeError("the private copy of the net names its tensors differently "
                               "from the net")
        if hasattr(self.net, "forward_seed") and not any(
                isinstance(m, DROPOUT_TYPES) for m in self.net.modules()):
            # no dropout in the private copy, ever (nothing adds modules to it): its
            # forward never draws a seed, so skip the walk over every module that
            # finds that out on each pass (36 us on digits, 96 us on Peaks)
            # (torch types Module.__setattr__ for tensors and modules only; a plain
            # attribute, as here, is set as on any object)
            self.net.forward_seed = _no_seed  # type: ignore[assignment]
        self._rep = rep
        # the parameters, and which of them each rank owns: under the batch split the
        # owners' `requires_grad` flags travel with the refresh (`_trainable_from`), so
        # every rank lays out the same trainable set, pass by pass
        self._params_at = [i for i, (_, t) in enumerate(rep) if isinstance(t, nn.Parameter)]
        slots: dict[int, list[int]] = {}
        for k, i in enumerate(self._params_at):
            if (owner := owners[i]) is not None:
                slots.setdefault(owner, []).append(k)
        self._slots = slots
        self._mine = [rep[self._params_at[k]][1] for k in slots.get(self.rank, [])]
        n_flags = max((len(v) for v in slots.values()), default=0) if self.split else 0
        # the refresh's exchange, one per dtype (the same on every rank: the owners are
        # known everywhere): a send buffer of the widest rank's share, which this rank's
        # tensors are concatenated into, and a receive buffer (ranks x width).  The
        # private copies of the others' tensors live in the receive buffer (their
        # storage is a view of it), so the exchange itself updates them; only what
        # cannot live there (a copy on another device; a tensor this rank holds but
        # another rank owns first) is copied out of it.  Split: the first exchange
        # carries each rank's parameters' flags after its tensors.
        by: dict[torch.dtype, dict[int, list[Tensor]]] = {}
        for i, (_, t) in enumerate(rep):
            if (owner := owners[i]) is not None:
                by.setdefault(t.dtype, {}).setdefault(owner, []).append(t)
        real = {id(named[i][1]) for i in local}
        self._xchg: list[_Exchange] = []
        self._flag_at = 0
        for dtype, per in by.items():
            width = max(sum(t.numel() for t in ts) for ts in per.values())
            if not self._xchg:
                self._flag_at, width = width, width + n_flags
            send = torch.zeros(width, dtype=dtype)
            recv = torch.zeros((model.size, width), dtype=dtype)
            copies, views = [], []
            with torch.no_grad():
                for r, ts in per.items():
                    if r == self.rank:
                        continue
                    for t, v in zip(ts, _views(recv[r], ts)):
                        if id(t) in real:
                            # a tensor this rank holds too (layers of several ranks
                            # share it): its copies are kept equal by the summed
                            # gradient, and writing the owner's values into it in
                            # place would break a pass still waiting for its backward
                            continue
                        if t.device.type != "cpu":
                            copies.append(t.detach())
                            views.append(v)
                        else:
                            v.copy_(t)
                            t.data = v
            own = per.get(self.rank, [])
            mine, into = _send_side(send, own)
            self._xchg.append(_Exchange(send, recv, mine, into, copies, views, own))
        self._generation = flat_generation()
        self._sent: Optional[tuple[bool, ...]] = None  # this rank's flags as last sent
        self._seen: Optional[Tensor] = None  # every rank's flags as last received
        self._set_trainable([named[i][1].requires_grad for i in self._params_at])
        self._mode: Optional[bool] = None

    def _set_trainable(self, flags: list[bool]) -> None:
        """Take `flags` (per parameter of the net, its owner's `requires_grad`) as the
        trainable set: the copies of the others' parameters require grad where theirs
        do (split: every rank adds its rows' share; else never, their owners compute
        their gradients), and, split, every trainable tensor in one list, the same on
        every rank, laid out by owner so that each rank's own ones lie together in the
        flat gradient, and where this rank's own ones (its `parameters()`) sit in it."""
        rep, owners = self._rep, self._owners
        # a tensor this rank holds keeps its flag, also under another rank's name (a
        # parameter that layers of several ranks share): the whole net's autograd
        # gives each such rank the sum of all its uses, so the ranks' copies stay equal
        real = {id(rep[i][1]) for i in self._local}
        for k, i in enumerate(self._params_at):
            if owners[i] != self.rank and id(rep[i][1]) not in real:
                rep[i][1].requires_grad_(self.split and flags[k])
        trainable = [i for k, i in enumerate(self._params_at) if flags[k]]
        trainable.sort(key=lambda i: (owners[i] is None, owners[i] or 0))
        self._trainable = [rep[i][1] for i in trainable]
        where = {id(t): k for k, t in enumerate(self._trainable)}
        self._own_at = sorted(where[id(p)] for p in self.model.parameters() if id(p) in where)
        self._own = [self._trainable[k] for k in self._own_at]
        self._own_span: Optional[tuple[int, int]] = None
        if self._own_at and self._own_at == list(range(self._own_at[0],
                                                        self._own_at[-1] + 1)):
            at = sum(t.numel() for t in self._trainable[:self._own_at[0]])
            self._own_span = (at, at + sum(t.numel() for t in self._own))

    def _trainable_from(self, got: Tensor) -> None:
        """The trainable set from every rank's flags as received (`got`: ranks x
        slots), where they changed since the last pass."""
        if self._seen is not None and torch.equal(got, self._seen):
            return
        self._seen = got.clone()
        rows = got.tolist()
        flags = [self._rep[i][1].requires_grad for i in self._params_at]
        for r, ks in self._slots.items():
            for slot, k in enumerate(ks):
                flags[k] = bool(rows[r][slot])
        self._set_trainable(flags)

    def apply(self, fn: Callable[[Tensor], Tensor]) -> None:
        """What `nn.Module._apply` applies to the model (`.to()`, `.float()`,
        `.cuda()` ...), applied here too: the private net is built again from the
        model's tensors as they are now, the copies of the others' moved alike (no
        message)."""
        self._build(fn)

    def parameters(self) -> list[nn.Parameter]:
        """This rank's trainable tensors (those the user's optimizer holds)."""
        return list(self.model.parameters())

    def refresh(self) -> None:
        """Bring the copies of the other ranks' layers up to date (collective): one
        all-gather per dtype of every rank's tensors, into buffers laid out once.  It
        runs before every pass: a fused optimizer (``torch.optim.Adam(fused=True)``)
        writes parameters in place without bumping their version counters, so no
        cheaper sign of change is reliable, and the exchange costs one concatenation
        of this rank's tensors and the all-gather (0.04 ms alone on Peaks at 2 ranks,
        against 0.20 ms when the copies were copied out of the receive buffer; about
        0.1 ms inside a training step, where it also absorbs the ranks' skew)."""
        pending = []
        if self._generation != flat_generation():
            # `flatten` moved parameters to new storage since the exchange was laid
            # out (a layer-parallel setting built on this model lays its segments out
            # flat): the detached views would send the old values
            for k, x in enumerate(self._xchg):
                mine, into = _send_side(x.send, x.own)
                self._xchg[k] = x._replace(mine=mine, into=into)
            self._generation = flat_generation()
        with torch.no_grad():
            if self.split and self._xchg:  # this rank's flags, where they changed
                flags = tuple(p.requires_grad for p in self._mine)
                if flags != self._sent:
                    self._sent = flags
                    head = self._xchg[0].send
                    head[self._flag_at:self._flag_at + len(flags)] = torch.tensor(
                        flags, dtype=head.dtype)
            for x in self._xchg:
                if isinstance(x.into, Tensor):
                    torch.cat(x.mine, out=x.into)
                else:
                    _copy(x.into, x.mine)
                pending.append(self.transport.allgather_start(
                    x.send, x.recv, "the replicated net's refresh"))
            for x, p in zip(self._xchg, pending):
                p.wait()
                _copy(x.copies, x.views)
            if self.split and self._xchg:
                self._trainable_from(self._xchg[0].recv[:, self._flag_at:])

    def __call__(self, x: Tensor) -> Tensor:
        self.refresh()
        if self._mode is not self.training:
            self.net.train(self.training)
            self._mode = self.training
        if self.split:
            # (no trainable parameter of its own but some elsewhere: the anchor makes
            # this rank's backward run, and join the others' all-reduce)
            own = self._own or ([self._anchor] if self._trainable else [])
            return _SplitBatch.apply(self, torch.is_grad_enabled(), x, *own)
        out = self.net(x)
        if not out.requires_grad and torch.is_grad_enabled():
            # nothing of this rank's requires grad (its own layers frozen): the output
            # still carries a graph, as on the ranks whose layers train, so that the
            # same training loop runs backward() on every rank
            out = out + 0 * self._anchor
        return out

    def check_gradients(self, x: Tensor, y: Any,
                        loss_fn: Callable[[Tensor, Any], Tensor]) -> Any:
        """The gradient check of exact propagation (this setting is exact: errors 0)."""
        from .accuracy import check_gradients

        with self.model.checking():
            return check_gradients(self.model, x, y, loss_fn)

    def close(self) -> None:
        """Drop the private copy (nothing to release: no communicator of its own)."""
        self._xchg = []
