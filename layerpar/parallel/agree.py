"""What the ranks must agree on, checked before any message of a pass.

Settings are compared by digest (`fingerprint`: a layer's structure), inputs and loss
gradients by a cheap fingerprint of their values (`values_fingerprint`,
`same_values`), and what the XBraid engine cannot do is refused by name
(`check_xbraid`); so are module hooks a pass cannot run as serial training does
(`hook_refusal`) and a module or parameter replaced after the model was built
(`Layout`).  Each check raises the same way on every rank.
"""
from __future__ import annotations

import hashlib
import operator
import warnings
from typing import Any, Optional

import torch
from torch import Tensor, nn

from ..mgrit.errors import RankMismatchError
from ..mgrit.options import MGRITOptions
from ..mgrit.transport import Transport
from ..mgrit.xbraid import (
    check_options,
    layer_partition_refusal,
    require_xbraid,
    xbraid_refusal,
)
from ..ode.net import ODENet, Segment, guard_serial_forward, serial_forward_guard
from ..ode.rng import REPLICA, draw_seed, mix_seed
from .batched import structure, user_stacklevel
from .scaler import scaler_agrees

__all__ = ["Agreed", "check_xbraid", "fingerprint", "layer_key", "same_values",
           "values_fingerprint"]


def values_fingerprint(t: Tensor) -> str:
    """Sum and sum of squares in float64, as text (NaN equals NaN there): equal on
    ranks that hold the same values."""
    t64 = t.detach().to(torch.float64)
    return f"{float(t64.sum())!r}/{float(torch.linalg.vector_norm(t64) ** 2)!r}"


def same_values(probes: list, what: str, hint: str) -> None:
    """Raise RankMismatchError (on every rank: each sees all probes) if they differ."""
    if probes[0] is None or all(p == probes[0] for p in probes):
        return
    bad = [q for q, p in enumerate(probes) if p != probes[0]]
    raise RankMismatchError(f"{what} differs between ranks: rank(s) {bad} hold other "
                            f"values than rank 0; {hint}")


def fingerprint(layer: nn.Module) -> str:
    """A short digest of a layer's structure (`batched.structure`: types, parameter
    shapes, attributes such as the activation), equal on two ranks iff they built the
    same layer; a Segment also by its step count, times and scheme."""
    desc = repr(structure(layer))
    if isinstance(layer, Segment):
        desc += f"|{layer.n_steps}|{layer.t_start!r}|{layer.t_final!r}|{layer.scheme!r}"
    return hashlib.sha256(desc.encode()).hexdigest()[:16]


def _shapes(module: nn.Module, limit: int = 6) -> str:
    """A module's first parameter names, shapes and dtypes, readable (``linear.weight
    [8, 8] float32, ...``): what a mismatch message can show where a digest says only
    "different" (a float32 net on one rank, float64 on the others, say)."""
    got = [f"{n} {list(p.shape)} {str(p.dtype).replace('torch.', '')}"
           for n, p in module.named_parameters()]
    more = f", ... ({len(got)} in all)" if len(got) > limit else ""
    return ", ".join(got[:limit]) + more if got else "(no parameters)"


def layer_key(k: int, layer: nn.Module) -> dict[str, Any]:
    """What the ranks compare of layer `k` (`LayerParallel`'s agreement): the digest of
    its whole structure (`fingerprint`) and, readable beside it, what usually differs
    when a script builds the net per rank: a segment's step count, times, scheme and
    first block's parameter shapes; a plain layer's parameter shapes.  (A mismatch was
    reported by digests alone, which named no argument.)"""
    out: dict[str, Any] = {}
    if isinstance(layer, Segment):
        out.update({f"layers.{k}.n_steps": layer.n_steps,
                    f"layers.{k}.t_start": layer.t_start,
                    f"layers.{k}.t_final": layer.t_final,
                    f"layers.{k}.scheme": repr(layer.scheme),
                    f"layers.{k}.blocks.0": _shapes(layer.blocks[0]) if len(layer.blocks)
                    else "(none)"})
    else:
        out[f"layers.{k}"] = _shapes(layer)
    out[f"layers.{k}.structure"] = fingerprint(layer)
    return out


class Agreed:
    """What every rank agreed on before a forward pass (see `LayerParallel._agree`)."""

    __slots__ = ("record", "x_requires_grad", "seed")

    def __init__(self, record: bool, x_requires_grad: bool, seed: Optional[int]) -> None:
        self.record, self.x_requires_grad, self.seed = record, x_requires_grad, seed


def check_xbraid(transport: Transport, net: ODENet, options: MGRITOptions,
                  backward_options: MGRITOptions, batched: bool, grid: bool,
                  accuracy: Any) -> None:
    """What engine="xbraid" cannot do, refused by name (before any message)."""
    require_xbraid()
    why = xbraid_refusal(transport)
    if why is not None:
        raise ValueError(why)
    if batched:
        raise ValueError("engine='xbraid' steps one layer per call: `batched` steps need "
                         "engine='native' (pass batched=False, or leave it unset)")
    if grid:
        raise ValueError("engine='xbraid' runs over an mpi4py communicator (`comm`), not a "
                         "`grid` (use engine='native' for data x layer parallelism)")
    if accuracy is not None:
        raise ValueError("`accuracy` (adaptive iteration counts) needs engine='native'")
    check_options(options, "options")
    check_options(backward_options, "backward_options")
    for _, seg in net.segments:
        why = layer_partition_refusal(seg.n_steps, transport.size)
        if why is not None:
            raise ValueError(why)


#: a `LayerParallel` (the model whose pass is agreed on): not imported, as the model
#: imports this module
LayerParallel = Any


#: a module's hook registries, and what each holds
_HOOKS = (("_forward_pre_hooks", "forward pre-hook"), ("_forward_hooks", "forward hook"),
          ("_backward_pre_hooks", "backward pre-hook"), ("_backward_hooks", "backward hook"))
#: torch's global module hook registries, what each holds, and the call adding one
_GLOBAL_HOOKS = (
    ("_global_forward_pre_hooks", "forward pre-hook", "register_module_forward_pre_hook"),
    ("_global_forward_hooks", "forward hook", "register_module_forward_hook"),
    ("_global_backward_pre_hooks", "backward pre-hook",
     "register_module_full_backward_pre_hook"),
    ("_global_backward_hooks", "backward hook", "register_module_full_backward_hook"))


class _HookSites:
    """Where the net's module hooks are looked for: the modules whose forward a
    layer-parallel pass never calls (the ODENet, its segments and this model's shards
    of them) and the residual blocks' modules, each with its label; and their hook
    registries as one list, which a pass's check scans at C speed (a module keeps its
    registries from construction on: registering a hook adds to them)."""

    def __init__(self, model: LayerParallel) -> None:
        net = model.whole_net
        self.never: list[tuple[str, nn.Module]] = [("the ODENet", net)]
        self.blocks: list[tuple[str, nn.Module]] = []
        for i, (k, seg) in enumerate(net.segments):
            shard = model.layers[k]  # this rank's blocks of the segment
            self.never += [(f"segment {i} (layer {k} of the ODENet)", seg),
                           (f"this model's `layers.{k}`", shard),
                           (f"this model's `layers.{k}.blocks`", shard.blocks)]
            for n, blk in enumerate(seg.blocks):
                where = f"layer {n} of segment {i} ({type(blk).__name__})"
                self.blocks += [(where + (f", its module `{name}`" if name else ""), m)
                                for name, m in blk.named_modules()]
        self.never_hooks = [getattr(m, a) for _, m in self.never for a, _ in _HOOKS]
        self.block_hooks = [getattr(m, a) for _, m in self.blocks for a, _ in _HOOKS]

    @staticmethod
    def first(sites: list[tuple[str, nn.Module]]) -> tuple[str, str]:
        """(label, "kind (the hook's name)") of the first of `sites` holding a hook
        (named, since a helper may have registered it: the old
        `torch.nn.utils.weight_norm` registers a `WeightNorm` pre-hook)."""
        for where, m in sites:
            for attr, what in _HOOKS:
                registry = getattr(m, attr)
                if registry:
                    hook = next(iter(registry.values()))
                    name = getattr(hook, "__qualname__", type(hook).__name__)
                    return where, f"{what} ({name})"
        raise RuntimeError("internal: no module holds the hook found")


#: parameters and modules, and buffers, registered on any module of this process so far
#: (``setattr`` of a Parameter, a buffer or a Module, ``register_*``,
#: ``load_state_dict(..., assign=True)``), counted by global registration hooks
#: installed at the first `registrations` call: a holder of a net walks it again only
#: where the count moved since it last looked.  Buffers apart: a data grid sets its
#: batch norms' averaged running statistics as new buffers on every pass
#: (`passes.average_running_stats`), which moves no parameter or module.
_REGISTERED = {"parameters and modules": 0, "buffers": 0}
_COUNTING: list[Any] = []


def registrations(buffers: bool = True) -> int:
    """How many parameters and modules, and, where `buffers`, buffers, have been
    registered on modules of this process since counting began (the hooks installed
    at the first call)."""
    if not _COUNTING:
        def count(module: nn.Module, name: str, value: Any) -> None:
            _REGISTERED["parameters and modules"] += 1

        def count_buffer(module: nn.Module, name: str, value: Any) -> None:
            _REGISTERED["buffers"] += 1

        glob = torch.nn.modules.module
        _COUNTING.extend([glob.register_module_parameter_registration_hook(count),
                          glob.register_module_buffer_registration_hook(count_buffer),
                          glob.register_module_module_registration_hook(count)])
    return _REGISTERED["parameters and modules"] + (_REGISTERED["buffers"] if buffers
                                                    else 0)


class Layout:
    """Where this rank's model holds each module and parameter object, as built: the
    model's own module tree (this rank's blocks and plain layers, and their modules) and the
    whole net's lists of layers and of each segment's blocks.

    The model computes with the objects it was built with: a segment's parameters are
    rows of one tensor, the vectorised steps and the passes' autograd inputs hold the
    parameters found at construction.  A module or parameter assigned anew afterwards
    (``block.linear = nn.Linear(...)``, ``linear.weight = nn.Parameter(...)``, a
    parametrization registered, ``net.layers[1].blocks[3] = block``) would not be run,
    silently unlike serial, so a pass refuses it (`moved`).  New values set in place
    (``p.copy_``, ``p.data = ...``, ``.to()``) keep the objects and are run."""

    def __init__(self, model: LayerParallel, net: ODENet) -> None:
        self.count = registrations(buffers=False)
        sites: list[tuple[dict, str, Any, str]] = []

        def add(registry: dict, prefix: str) -> None:
            sites.extend((registry, key, obj, prefix + key)
                         for key, obj in registry.items() if obj is not None)

        for path, mod in model.named_modules():
            add(mod._modules, path + "." if path else "")
            add(mod._parameters, path + "." if path else "")
        add(net.layers._modules, "the ODENet's layers.")
        for k, seg in net.segments:
            add(seg.blocks._modules, f"the ODENet's layers.{k}.blocks.")
        self.sites = sites
        self.registries = [r for r, _, _, _ in sites]
        self.keys = [k for _, k, _, _ in sites]
        self.held = [o for _, _, o, _ in sites]
        params = [(r, k, o) for r, k, o, _ in sites if isinstance(o, nn.Parameter)]
        self.param_registries = [r for r, _, _ in params]
        self.param_keys = [k for _, k, _ in params]
        self.params = [o for _, _, o in params]

    def moved(self) -> Optional[str]:
        """Why the model cannot run as built (a site holds another object, or none),
        or None.  Every site is looked at only where something was registered in the
        process since the last look (`registrations`); the parameters' sites on every
        pass, since `torch.func.functional_call` puts tensors into the modules'
        parameter dicts without registering them (0.036 ms for the 1,026 parameters of
        a rank of two of the 1,024-layer dense net)."""
        now = registrations(buffers=False)
        if now == self.count:
            try:
                if all(map(operator.is_, map(operator.getitem, self.param_registries,
                                             self.param_keys), self.params)):
                    return None
            except KeyError:
                pass
        try:
            same = all(map(operator.is_, map(operator.getitem, self.registries, self.keys),
                           self.held))
        except KeyError:
            same = False
        if same:
            self.count = now
            return None
        registry, key, held, name = next(
            site for site in self.sites if site[0].get(site[1]) is not site[2])
        kind = "parameter" if isinstance(held, nn.Parameter) else "module"
        now_held = registry.get(key)
        what = "was removed" if now_held is None else "was replaced by another"
        if isinstance(now_held, Tensor) and not isinstance(now_held, nn.Parameter):
            what += (" tensor, not a Parameter (`torch.func.functional_call` and the "
                     "other torch.func transforms swap tensors in for one call, and "
                     "they would get no gradient)")
        return (f"{kind} `{name}` {what} after the LayerParallel was built: the model "
                f"computes with the modules and parameters it was built with (a "
                f"segment's parameters are rows of one tensor; the passes hold the "
                f"parameters they differentiate), so it would not run what the net holds "
                f"now, unlike serial training; set new values in place (`with "
                f"torch.no_grad(): p.copy_(new)`), or build a new LayerParallel (and "
                f"optimizer) from the changed ODENet")


class StaleNet:
    """Whether the whole net, on a rank of a model that distributes it, still computes
    the trained net.  The model trains this rank's layers, which are the net's own,
    and leaves the net's copies of the other ranks' layers as they were; so once the
    model ran a training pass (one that records for a backward: an optimizer step may
    follow) or this rank's parameters moved (their version counters: replicated
    serial's passes, or values set in place) since the net was built or last loaded
    (`load_state_dict`), a serial pass of the net would run stale layers, and its
    state dict would hold them.  (Version
    counters alone would not do: fused Adam, and `FlatAdam`, step the parameters
    without bumping them.)  Called by `ODENet.forward`, `ODENet.state_dict` and the
    net's pickling and deep copy (`guard_serial_forward`): one
    read of each of this rank's parameters' version (0.11 ms for the 2,050 tensors of
    the whole 1,024-layer dense net; a rank of two holds about half)."""

    def __init__(self, net: nn.Module, params: list[nn.Parameter], ranks: int) -> None:
        self.params, self.ranks = params, ranks
        self.versions = self.now()
        #: a training pass ran since the last load (or a model built on the net before
        #: left it stale)
        self.trained = False
        net.register_load_state_dict_post_hook(self.loaded)

    @classmethod
    def guard(cls, net: nn.Module, params: list[nn.Parameter], ranks: int
              ) -> Optional[StaleNet]:
        """The guard of `net`'s serial forward for a model over `ranks` ranks whose
        parameters here are `params` (None at one rank, where every layer of the net is
        the model's own): one per net, whatever the models built on it (auto's
        candidates share the user's net: each would otherwise add a load hook)."""
        if ranks == 1:
            return None
        held = serial_forward_guard(net)
        if not isinstance(held, cls):
            held = cls(net, params, ranks)
            guard_serial_forward(net, held)
            return held
        if len(held.params) != len(params) or \
                not all(map(operator.is_, held.params, params)):
            held.trained = held() is not None  # (stale stays stale until a load)
            held.params, held.versions = params, sum(map(_VERSION, params))
        held.ranks = ranks
        return held

    def now(self) -> int:
        return sum(map(_VERSION, self.params))

    def loaded(self, module: nn.Module, keys: Any) -> None:
        self.versions, self.trained = self.now(), False

    def __call__(self) -> Optional[str]:
        if not self.trained and self.now() == self.versions:
            return None
        return (f"this ODENet's layers are trained over {self.ranks} ranks by a "
                "LayerParallel, which has trained since the net was built or last "
                "loaded: its copies of the other ranks' layers are stale here, so its "
                "forward, its state_dict, a pickle (torch.save(net)) or a copy of it "
                "would not be the trained net's; evaluate "
                "with the model (`model.eval(); model(x)` on every rank), save "
                "`model.gather_state_dict()` (collective), or load the trained net first "
                "(`net.load_state_dict(model.gather_state_dict())`, on every rank)")


_VERSION = operator.attrgetter("_version")


def hook_refusal(model: LayerParallel) -> Optional[str]:
    """Why a module hook of the net would not run as it runs in serial training, or
    None.  A pass never calls the ODENet's or a segment's forward (the model steps the
    layers itself), so their hooks would never run; and outside sequential passes (one
    rank, direct) a pass evaluates a block several times (MGRIT's iterations and coarse
    steps, the adjoint's recomputation) or stacks the layers into one call, so a
    block's hooks, or a global module hook, would run another number of times, on
    other inputs, or not at all.  The plain layers' hooks run as in serial training,
    once per pass on the layer's owner.  Checked on every pass (`agree_pass`): 0.055 ms
    on 1,024 dense blocks."""
    sites = getattr(model, "_hook_sites", None)
    if sites is None:
        sites = model._hook_sites = _HookSites(model)
    if any(sites.never_hooks):
        where, what = sites.first(sites.never)
        return (f"{where} has a {what}, which would never run: LayerParallel steps the "
                "layers itself and calls neither ODENet.forward nor Segment.forward; "
                "register it on the LayerParallel model instead")
    if model.size == 1 and (model._direct_exact if model._exact_pass else model._direct):
        return None  # sequential passes: each layer once per pass, as in serial
    glob = torch.nn.modules.module
    for attr, what, call in _GLOBAL_HOOKS:
        if getattr(glob, attr, None):
            return f"a global module {what} is registered (torch's {call}): " + _REPEATS
    if any(sites.block_hooks):
        where, what = sites.first(sites.blocks)
        return f"{where} has a {what}: " + _REPEATS
    return None


#: why a block's hook cannot run as in serial training under layer-parallel passes
_REPEATS = ("layer-parallel passes evaluate a residual block several times per pass "
            "(MGRIT's iterations and coarse steps, the adjoint's recomputation), or "
            "the layers of a rank as one stacked call, so the hook would not run once "
            "per layer and pass as in serial training; remove it (a plain layer's "
            "hooks run as in serial training; on one rank, passes run the layers in "
            "order)")


#: said once per model at its first float16-autocast pass that records, at 2+ ranks
FP16_SCALER = ("layerpar: float16 autocast at several ranks: a torch.amp.GradScaler looks "
               "for inf and NaN in its own rank's gradients only, so an overflow in one "
               "rank's layers would skip that rank's step alone and set the ranks' scales "
               "apart; build layerpar.parallel.GradScaler(model) on every rank instead (or "
               "train under bfloat16, which needs no loss scaling)")


def agree_pass(model: LayerParallel, x: Tensor) -> Agreed:
    """`_agree_pass`, and a pass that records for a backward marked on the whole net's
    serial-forward guard (`StaleNet`: an optimizer step may follow)."""
    agreed = _agree_pass(model, x)
    if agreed.record and model._stale is not None:
        model._stale.trained = True
    return agreed


def _agree_pass(model: LayerParallel, x: Tensor) -> Agreed:
    """One collective per forward pass, before any other message: every rank has the
    same input shape, dtype, training and grad mode, and every rank takes the same
    path.  A pass records for the backward if any rank has something to
    differentiate (its input or a trainable parameter), so a rank whose own
    parameters are all frozen still joins the backward; the input's gradient is
    sent back if any rank wants it.  Also brings rank 0's dropout seed."""
    grad_mode = torch.is_grad_enabled()
    x_rg = bool(x.requires_grad)
    p_rg = any(p.requires_grad for p in model._param_list)
    # drawn on every rank (rank 0's is used): each rank's global generator then
    # advances as serial `ODENet.forward` advances it, and the ranks' generators
    # stay in step (a DataLoader shuffling from them gives every rank the same batches);
    # put back after the agreement where no rank's own dropout trains (`seeded`)
    draw = model.training and model._has_dropout
    before = torch.get_rng_state() if draw else None
    seed = draw_seed() if draw else None
    own = draw and any(m.training for m in model._dropouts)
    dev = x.device.type
    cast = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
    key = (tuple(x.shape), str(x.dtype), model.training, grad_mode, str(cast))
    if cast == torch.float16 and model.size > 1 and grad_mode and \
            not getattr(model, "_fp16_warned", False) and not scaler_agrees(model):
        model._fp16_warned = True
        warnings.warn(FP16_SCALER, stacklevel=user_stacklevel())
    # the net's module hooks and layout, on every pass (a hook registered or a module
    # replaced mid-training too): the scans cost a fraction of a millisecond (the
    # layout's nothing, unless a module was registered somewhere since the last pass),
    # and a finding travels in the agreement's message
    hooks = hook_refusal(model) or model._layout.moved()
    if model._agreements is not None:
        return agree_on_grid(model, x, key, x_rg, p_rg, (seed, own, before), hooks)
    if model.size == 1:
        if hooks is not None:
            raise ValueError(hooks)
        return seeded(grad_mode and (x_rg or p_rg), x_rg, seed, own, before)
    probe = values_fingerprint(x) if model._batch <= model.check_inputs else None
    shared = model._shared
    flags = None if shared is None else shared.flags(model.rank)
    got = model.guard(lambda: model.transport.allgather_object(
        (key, x_rg, p_rg, (seed, own), probe, flags, hooks),
        "the forward pass's agreement on the input"))
    _refuse_hooks([g[6] for g in got])
    keys = [g[0] for g in got]
    if any(k != keys[0] for k in keys):
        raise RankMismatchError(f"the input differs between ranks (shape, dtype, "
                                f"training, grad mode, autocast dtype): {keys}")
    same_values([g[4] for g in got], "the input `x`", "pass the same batch on every "
                 "rank (only rank 0's is used)")
    if flags is not None:
        shared.check_flags([g[5] for g in got])
    any_x = any(g[1] for g in got)
    return seeded(grad_mode and (any_x or any(g[2] for g in got)), any_x, got[0][3][0],
                  any(g[3][1] for g in got), before)


def seeded(record: bool, x_requires_grad: bool, seed: Optional[int], any_own: bool,
           before: Optional[Tensor]) -> Agreed:
    """What the ranks agreed, with the dropout seed where some rank's own dropout
    module trains (`any_own`: each rank sent whether one of its own does), else none
    and the seed's draw undone (the global generator put back to `before`).  Serial
    `ODENet.forward` draws where any dropout module of the net trains, and only a
    layer's owner sees its dropout module switched by itself (``m.eval()`` over
    ``model.modules()``): read from this rank's copies of the others' layers, which
    keep their modes, every rank drew a seed serial did not, and every later random
    number differed from serial's."""
    if before is not None and not any_own:
        torch.set_rng_state(before)
    return Agreed(record, x_requires_grad, seed if any_own else None)


def _refuse_hooks(found: list[Optional[str]]) -> None:
    """Raise `hook_refusal`'s finding of the first rank that has one, on every rank
    (each sees every rank's)."""
    for q, why in enumerate(found):
        if why is not None:
            raise ValueError(f"{why} (found on rank {q})")


def agree_on_grid(model: LayerParallel, x: Tensor, key: tuple, x_rg: bool, p_rg: bool,
                  drawn: tuple[Optional[int], bool, Optional[Tensor]],
                  hooks: Optional[str] = None) -> Agreed:
    """`_agree` on a grid with replicas: one collective over the whole grid, each
    process checking every group from it, so a mismatch raises alike everywhere.
    Replicas hold other samples of the same shapes, and take the same kind of pass
    (exact propagation hands its gradients to the replicas' averaging layer by
    layer, MGRIT's batched records several layers at a time, and the reductions
    must pair up bucket by bucket); the ranks of a replica hold the same input.
    (A check per group would raise a mismatch inside one replica on some ranks and
    leave the others waiting out the timeout, and would find a rank that skipped a
    backward() only by the timeout.)"""
    if model.grid is None or model._agreements is None:
        raise RuntimeError("the model has no grid or agreements to check against (not set up)")
    probe = values_fingerprint(x) if model.size > 1 and \
        model._batch <= model.check_inputs else None
    model._agreements.set_context(f"batch {model._batch}, forward pass")
    flags = None if model._shared is None else model._shared.flags(model.rank)
    got = model.guard(lambda: model._agreements.allgather_object(
        (key, model._exact_pass, x_rg, p_rg, drawn[:2], probe, flags, hooks),
        "the forward pass's agreement on the input (whole grid)"))
    _refuse_hooks([g[7] for g in got])
    layers = model.grid.layers
    replicas = [got[d * layers:(d + 1) * layers] for d in range(model.grid.data)]

    def what(k: tuple) -> str:
        return (f"shape {k[0]}, dtype {k[1]}, training={k[2]}, grad mode={k[3]}, "
                f"autocast={k[4]}")

    for d, group in enumerate(replicas):  # the ranks of one replica: the same batch
        if any(g[0] != group[0][0] for g in group):
            detail = "; ".join(f"rank {d * layers + q} has {what(g[0])}"
                               for q, g in enumerate(group))
            raise RankMismatchError(
                f"the input differs between the ranks of data replica {d}: {detail}. "
                "Every rank of a replica must pass the same batch (only its first "
                "rank's is used)")
    if any(group[0][0] != got[0][0] for group in replicas):
        detail = "; ".join(f"replica {d} has {what(group[0][0])}"
                           for d, group in enumerate(replicas))
        raise RankMismatchError(
            f"the input differs between data replicas: {detail}. Every replica must "
            "pass batches of the same shape (use ProcessGrid.sampler, drop_last=True, "
            "and the same per-replica batch size)")
    if any(g[1] != got[0][1] for g in got):
        exact = sorted({q // layers for q, g in enumerate(got) if g[1]})
        raise RankMismatchError(
            f"data replica(s) {exact} run this pass with exact propagation and the "
            "others with MGRIT: the replicas' gradients could not be averaged "
            "(`model.exact()` on some replicas only)")
    for d, group in enumerate(replicas):
        same_values([g[5] for g in group], f"the input `x` of data replica {d}",
                    "pass the same batch on every rank of a replica (only its first "
                    "rank's is used)")
    mine = replicas[model.grid.data_rank]
    if flags is not None:
        model._shared.check_flags([g[6] for g in mine])
    # every replica records alike (their gradients are averaged pass by pass)
    record = key[3] and any(g[2] or g[3] for g in got)
    # each replica's masks its own (its rows are other samples): the seed mixed with
    # the replica's index, so the replicas' dropout noise is independent, as a serial
    # net's over the global batch (not the same masks row for row)
    seed = mine[0][4][0]
    if seed is not None:
        seed = mix_seed(seed, REPLICA, model.grid.data_rank)
    return seeded(record, any(g[2] for g in mine), seed, any(g[4][1] for g in got),
                  drawn[2])
