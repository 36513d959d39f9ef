"""One layer-parallel pass of a `LayerParallel`: the forward pass over plain layers and
segments (activations handed between ranks, each segment an MGRIT solve), the backward
pass in reverse (each segment an adjoint solve, plain layers' gradients by autograd),
direct mode's forward onto the caller's graph, and what frames them (the refusal after
a failed pass, batch norms' statistics averaged over the replicas).

`LayerParallel.forward` and its autograd Function call these; the model holds the
settings, the runners and the transports they read.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from ..mgrit.errors import DivergenceError
from ..ode.rng import plain_rng
from .agree import same_values, values_fingerprint
from .bn_dropout import batch_norms
from .direct import direct_backward_started
from .grads import hooks_held
from .move import Like, move
from .sharing import add as add_grads
from .sharing import finish as finish_grads
from .tape import PassRecord, PlainRecord

#: a `LayerParallel` (the model running the pass): not imported, as the model imports
#: this module
LayerParallel = Any

_LINK_TAG = 31002


def move_activation(model: LayerParallel, t: Optional[Tensor], src: int, dst: int,
                    shape: tuple, dtype: torch.dtype, device: torch.device
                    ) -> Optional[Tensor]:
    """An activation (or its gradient) handed from rank `src` to `dst`: the tensor
    received on `dst`, `t` as it was elsewhere."""
    item = Like(shape, dtype, device) if model.rank == dst else t
    got = move(model.transport, [(src, dst, item)], tag=_LINK_TAG, what="an activation")[0]
    if got is not None and not isinstance(got, Tensor):
        raise RuntimeError(f"internal: an activation moved as a {type(got).__name__}")
    return got


def _meta(model: LayerParallel, t: Optional[Tensor], root: int
          ) -> tuple[tuple[int, ...], torch.dtype]:
    """The shape and dtype of `t`, held on rank `root`, on every rank."""
    if model.size == 1:
        if t is None:
            raise RuntimeError("a one-rank model: its only rank must hold `t`, got None")
        return tuple(t.shape), t.dtype
    return model.transport.bcast_object(None if t is None else (tuple(t.shape), t.dtype),
                                       root=root)


def broadcast(model: LayerParallel, t: Optional[Tensor], root: int, shape: tuple,
              dtype: torch.dtype, device: torch.device) -> Tensor:
    """`t`, held on rank `root`, on every rank (the output, or the input's gradient)."""
    if model.size == 1:
        if t is None:
            raise RuntimeError("a one-rank model: its only rank must hold `t`, got None")
        return t
    return model.transport.bcast_tensor(t, root, shape, dtype, device,
                                       "the broadcast output or input gradient")


def refuse_after_failure(model: LayerParallel) -> None:
    """Refuse a pass once a pass of this model failed on any rank (at 2+ ranks): its
    messages may still be in flight, and the next pass would read them.  Every rank
    raises this (the one that failed too), with the first failure named, so no
    later call re-raises the old error as a `RemoteError` that, on the failing rank,
    would name that rank itself and read as a new failure."""
    if model.size == 1 and model._agreements is None:
        return
    for t in (model.transport, model._data_transport, model._agreements):
        broken = None if t is None else t.failure
        if broken is not None:
            raise RuntimeError(
                f"this LayerParallel cannot run again: an earlier pass failed ({broken}),"
                " and a pass that failed may leave messages in flight for the next one "
                "to read. Build a new LayerParallel (and close() this one); under "
                "`python -m mpi4py` the first failure ends the job instead") from broken


def forward_pass(model: LayerParallel, ctx: PassRecord, x: Tensor, record: bool,
                  seed: Optional[int]) -> Tensor:
    """The forward pass of `x` (on rank 0) through the whole net, the output on every
    rank; with `record`, what the backward pass needs is kept in `ctx`."""
    size, rank = model.size, model.rank
    last = size - 1
    # activation shapes and dtypes follow from the input's and the autocast state
    dev = x.device.type
    cast = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
    key = (tuple(x.shape), str(x.dtype), model.training, record, str(cast))
    h: Optional[Tensor] = x if rank == 0 else None
    holder = 0  # rank holding the current activation
    model.last_forward = []
    # activation shapes depend only on the input's (checked equal on every rank):
    # broadcast them the first time, then reuse
    cached = model._shape_cache.get(key)
    metas: list[tuple[tuple[int, ...], torch.dtype]] = []

    def meta(t: Optional[Tensor], root: int) -> tuple[tuple[int, ...], torch.dtype]:
        got = cached[len(metas)] if cached is not None else _meta(model, t, root)
        metas.append(got)
        return got

    for k, (kind, info) in enumerate(model.plan.kinds):
        if kind == "plain":
            owner = info
            if owner != holder:
                shape, dtype = meta(h, holder)
                h = move_activation(model, h, holder, owner, shape, dtype, x.device)
                holder = owner
            if rank == owner:
                if ctx.direct:  # onto the caller's graph
                    with torch.enable_grad(), plain_rng(seed, k, model.layers[k]):
                        h = _one_tensor(model, k, model.layers[k](h))
                    continue
                prev = ctx.plain.get(k - 1) if record else None
                # a plain layer runs on its owner alone: randomness of its own (not a
                # dropout module's, which `plain_rng` keys) would advance that rank's
                # generator only, and the ranks' generators would fall out of step
                before = torch.get_rng_state() if size > 1 and \
                    model.batch <= model.check_inputs else None
                if h is None:
                    raise RuntimeError(f"internal: plain layer {k} has no input on its "
                                       "owner")
                with plain_rng(seed, k, model.layers[k]):
                    rec = PlainRecord(model.layers[k], h, record, prev)
                _one_tensor(model, k, rec.y)
                if before is not None and not torch.equal(before, torch.get_rng_state()):
                    raise ValueError(
                        f"plain layer {k} ({type(model.layers[k]).__name__}) draws random "
                        "numbers outside torch.nn's dropout modules (F.dropout, "
                        "torch.rand...): it runs on one rank, whose generator alone would "
                        "advance, and the ranks' generators (a shuffling DataLoader's) "
                        "would fall out of step. Use an nn.Dropout module, or draw from a "
                        "torch.Generator of the layer's own")
                ctx.plain[k] = rec
                h = rec.y.detach()
        else:
            runner = model._runners[k]
            if holder != 0:
                shape, dtype = meta(h, holder)
                h = move_activation(model, h, holder, 0, shape, dtype, x.device)
                holder = 0
            shape, dtype = meta(h, 0)
            ctx.shapes.append((shape, dtype))
            like = torch.empty(shape, dtype=dtype, device=x.device)
            runner.ghosts.set_training(model.training)
            if size > 1 and not ctx.exact:  # exact propagation has no coarse steps
                runner.ghosts.sync(model.transport)
            tape = runner.new_tape(record and not ctx.direct, seed)
            if ctx.direct:
                if h is None:
                    raise RuntimeError("a direct pass has no input on this rank")
                h, stats = runner.forward_direct(h, tape, check_shapes=cached is None,
                                                 exact=ctx.exact)
            else:
                h, stats = runner.forward(h if rank == 0 else None, like, tape,
                                          check_shapes=cached is None, exact=ctx.exact)
            if tape.recording:
                ctx.tapes[k] = tape
            model.last_forward.append(stats)
            holder = last
    shape, dtype = meta(h, holder)
    if cached is None:
        model._shape_cache[key] = metas
    ctx.out_holder = holder
    y = broadcast(model, h, holder, shape, dtype, x.device)
    if y._is_view():
        # a tensor of its own on every rank: autograd refuses an in-place change to a
        # view that a Function returns, and a rank whose output viewed a buffer (the
        # segment's last state) would raise where the others went on
        y = y.clone()
    if model.check_finite and not bool(torch.isfinite(y).all()):
        raise DivergenceError("the layer-parallel forward pass produced non-finite "
                              "outputs (NaN or inf)")
    return y


def backward_pass(model: LayerParallel, ctx: PassRecord, gy: Tensor
                  ) -> tuple[Optional[Tensor], dict]:
    """The backward pass of the forward pass `ctx` recorded, from the loss gradient
    `gy`: (the input's gradient where wanted, parameter id -> gradient)."""
    probe = values_fingerprint(gy) \
        if model.size > 1 and model._batch <= model.check_inputs else None
    # on a grid with replicas and several layer ranks, over the whole grid (every
    # process checks every replica) instead of the layer group: a rank that skipped
    # a backward() then meets the others' check in its next forward's agreement,
    # and the labels say where each one is.  With one layer rank per replica there
    # was no exchange here, and one more per step cost 3-4 % of a small net's batch
    # (`make bench-grid`, 2 x 1): a skipped backward is then found by the timeout
    whole = model._agreements if model.size > 1 else None
    if model.check_finite or probe is not None or whole is not None:
        bad = 0.0 if not model.check_finite or bool(torch.isfinite(gy).all()) else 1.0
        if whole is not None:
            whole.set_context(f"batch {model._batch}, backward pass")
            got_all = whole.allgather_object((bad, probe), "the loss-gradient check "
                                             "(whole grid)")
            layers = model.grid.layers
            d0 = model.grid.data_rank * layers
            got = got_all[d0:d0 + layers]
            bad_ranks = [q for q, (f, _) in enumerate(got) if f]
            if not any(f for f, _ in got_all):
                for d in range(len(got_all) // layers):
                    same_values([p for _, p in got_all[d * layers:(d + 1) * layers]],
                                f"the loss gradient of data replica {d}",
                                "compute the loss from the same outputs and targets "
                                "on every rank of a replica (only its last rank's "
                                "gradient is used)")
        elif model.size > 1:  # one small exchange: every rank stops, none waits
            got = model.transport.allgather_object((bad, probe), "the loss-gradient check")
            bad_ranks = [q for q, (f, _) in enumerate(got) if f]
            if not bad_ranks:
                same_values([p for _, p in got], "the loss gradient",
                             "compute the loss from the same outputs and targets on "
                             "every rank (only the last rank's gradient is used)")
        else:
            bad_ranks = [0] if bad else []
        if bad_ranks:
            where = "" if model.size == 1 else f" on rank(s) {bad_ranks}"
            raise DivergenceError(f"the loss gradient is not finite{where} (NaN or inf "
                                  "loss?)")
    size, rank = model.size, model.rank
    grads: dict[int, Tensor] = {}  # id(parameter) -> gradient (Tensor.__hash__ is slow)
    extra: list[tuple[int, Tensor]] = []  # a shared parameter's further uses
    g: Optional[Tensor] = gy if rank == ctx.out_holder else None
    holder = ctx.out_holder
    seg_shapes = list(ctx.shapes)
    g_meta = (tuple(gy.shape), gy.dtype)  # shape of g wherever it travels
    model.last_backward = []
    kinds = model.plan.kinds
    for k in reversed(range(len(kinds))):
        kind, info = kinds[k]
        if kind == "plain":
            owner = info
            if owner != holder:
                g = move_activation(model, g, holder, owner, *g_meta, gy.device)
                holder = owner
            if rank == owner:
                rec = ctx.plain[k]
                nxt = ctx.plain.get(k + 1)
                if nxt is None or nxt.head is not rec.head:
                    # the last layer of a group: back-propagate the whole group
                    head = rec.head
                    wrt = [head.x] if head.x.requires_grad else []  # (not token ids)
                    with hooks_held(rec.group_params):  # run once, when handed on
                        # None for a parameter the group does not use (allow_unused)
                        outs: tuple[Optional[Tensor], ...] = torch.autograd.grad(
                            rec.y, [*wrt, *rec.group_params], g, allow_unused=True)
                    g, outs = (outs[0], outs) if wrt else (None, (None, *outs))
                    if model._averager is not None:
                        model._averager.add(outs[1:])
                    add_grads(grads, extra, ((id(p), gp) for p, gp in
                                             zip(rec.group_params, outs[1:])
                                             if gp is not None))
        else:
            runner = model._runners[k]
            shape, dtype = seg_shapes.pop()
            like = torch.empty(shape, dtype=dtype, device=gy.device)
            if holder != size - 1:
                g = move_activation(model, g, holder, size - 1, shape, dtype, gy.device)
                holder = size - 1
            g, stats, seg_grads = runner.backward(g if rank == size - 1 else None, like,
                                                  ctx.tapes.pop(k), extra)
            model.last_backward.append(stats)
            if model._shared is None:
                grads.update(seg_grads)
            else:
                add_grads(grads, extra, seg_grads.items())
            holder = 0
            g_meta = (shape, dtype)
    model.last_backward.reverse()
    if model._averager is not None:
        model._averager.finish()
    if model._shared is not None:
        # every use of a shared parameter, once the replicas averaged each use's
        # gradient in place, then over the ranks whose layers use it
        finish_grads(grads, extra)
        model._shared.reduce(grads, model.transport, rank)
    if model.training and model._stats_averager is not None and not model._checking:
        average_running_stats(model)
    gx = None
    if ctx.x_requires_grad:
        gx = broadcast(model, g, holder, ctx.x_shape, ctx.x_dtype, gy.device)
    return gx, grads


def average_running_stats(model: LayerParallel) -> None:
    """Average this process's batch norms' running statistics over the data
    replicas (collective over the data group; at the end of each backward pass,
    when its graph is spent).
    Each replica updated them from its own share of the batch, so without this
    the replicas' statistics drift apart: an evaluation, and the state dict saved,
    would depend on the replica (PyTorch's DDP broadcasts replica 0's instead; the
    average of the replicas' updates is the update of the shares' mean statistics).
    """
    if model._running_stats is None:
        model._running_stats = [(m, name) for m in batch_norms(model)
                               for name in ("running_mean", "running_var")]
    if not model._running_stats:
        return
    averager = model._stats_averager
    if averager is None:
        raise RuntimeError("running statistics to average but no averager")
    # averaged in copies, which then become the buffers: a pass still waiting for
    # its backward (two forwards, one backward) saved the old ones in its graph
    copies = [getattr(m, name).clone() for m, name in model._running_stats]
    model.guard(lambda: (averager.add(copies), averager.finish()))
    for (m, name), t in zip(model._running_stats, copies):
        setattr(m, name, t)


def _one_tensor(model: LayerParallel, k: int, y: Any) -> Tensor:
    """`y`, plain layer k's output, where it is one tensor; else the error naming it
    (the pass hands one tensor on, between ranks too, and returns one)."""
    if not isinstance(y, Tensor):
        raise TypeError(f"plain layer {k} ({type(model.layers[k]).__name__}) returned a "
                        f"{type(y).__name__}: a LayerParallel model hands one tensor "
                        "from layer to layer, between ranks, and returns one; return one "
                        "tensor from the layer, and compute other outputs from the "
                        "model's output outside it")
    return y


def forward_direct(model: LayerParallel, x: Tensor, seed: Optional[int]) -> Tensor:
    """Direct mode: one rank, forward and adjoint both sequential.

    The adjoint solve would then be exactly backpropagation through the recorded
    final sweep, which here is the serial network's own graph; so the steps are
    recorded onto `x`'s graph and PyTorch's engine runs the backward.  Parameters
    are the graph's leaves as in plain PyTorch: `autograd.grad`, `backward(inputs=)`
    and hooks behave as in serial code, and no autograd Function with one input per
    parameter stands in between (that cost ~4.5 us per parameter per backward pass).
    """
    ctx = PassRecord()
    ctx.direct, ctx.exact = True, model._exact_pass
    with torch.no_grad():  # only the recording itself builds a graph
        y = model.guard(lambda: forward_pass(model, ctx, x, True, seed))
    if y.requires_grad:
        y.register_hook(lambda gy: direct_backward_started(model, gy))
    return y
