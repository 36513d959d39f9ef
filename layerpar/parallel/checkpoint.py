"""Checkpoints that move between rank counts: the whole network's state dict and the
optimizer state keyed by parameter name, gathered on every rank, and loaded back on
any number of ranks (or into the serial `ODENet`)."""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from ..mgrit.errors import RemoteError
from .flatadam import FlatAdam
from .optimizers import OWNER

#: a `LayerParallel` (the model): not imported, as the model imports this module
_Model = Any

__all__ = ["gather_optimizer_state", "gather_state_dict", "load_optimizer_state"]


def gather_state_dict(model: _Model) -> dict[str, Tensor]:
    """The whole network's state dict (loads into the serial `ODENet`), on every rank."""
    local = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    if model.size == 1:
        return local
    merged: dict[str, Tensor] = {}
    for part in model.guard(lambda: model.transport.allgather_object(
            local, "gather_state_dict")):
        merged.update(part)
    return dict(sorted(merged.items(), key=lambda kv: _name_order(kv[0])))

def _optimizer_names(model: _Model, optimizer: Any, what: str) -> dict[int, list[str]]:
    """id(parameter) -> every name it has in this rank's part of `model` (several for a
    parameter that several layers share), for every tensor `optimizer` holds; a
    ValueError when one is not a parameter of this rank's part of `model`."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"`optimizer` must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    if isinstance(optimizer, FlatAdam):
        raise TypeError(f"`optimizer` is a FlatAdam, whose state is per run of rows, not "
                        f"per parameter; {what} needs a per-parameter optimizer "
                        "(torch.optim.Adam over model.parameters())")
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    for gi, g in enumerate(optimizer.param_groups):
        for pi, p in enumerate(g["params"]):
            if id(p) not in names:
                raise ValueError(
                    f"`optimizer` (param_groups[{gi}]['params'][{pi}], shape "
                    f"{tuple(p.shape)}) holds a tensor that is not a parameter of this "
                    f"rank's part of the LayerParallel; {what} needs an optimizer built "
                    "from model.parameters()")
    return names


def gather_optimizer_state(model: _Model,
                           optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer state of the whole network, keyed by parameter name, on every
    rank (collective).  `load_optimizer_state` restores it on any number of ranks.
    A bad `optimizer` on one rank raises there and `RemoteError` on the others."""
    err: Optional[BaseException] = None
    part: Any = None
    try:
        names = _optimizer_names(model, optimizer, "gather_optimizer_state")
        sd = optimizer.state_dict()
        order = [p for g in optimizer.param_groups for p in g["params"]]
        # a parameter several layers share, under each of its names here: a rank of
        # another partition looks it up under the first name it has there
        state = {n: {k: (v.detach().cpu() if isinstance(v, Tensor) else v)
                     for k, v in st.items()}
                 for i, st in sd["state"].items() for n in names[id(order[i])]}
        groups = [{k: v for k, v in g.items() if k not in ("params", OWNER)}
                  for g in sd["param_groups"]]
        group_of = {n: gi for gi, g in enumerate(optimizer.param_groups)
                    for p in g["params"] for n in names[id(p)]}
        part = (state, groups, group_of, type(optimizer).__name__)
    except Exception as exc:  # noqa: BLE001 - reported on every rank below
        err = exc
    if model.size == 1:
        if err is not None:
            raise err
        parts = [part]
    else:
        got = model.guard(lambda: model.transport.allgather_object(
            (None if err is None else f"{type(err).__name__}: {err}", part),
            "gather_optimizer_state"))
        if err is not None:
            raise err
        for q, (e, _) in enumerate(got):
            if e is not None:
                raise RemoteError(q, e)
        parts = [p for _, p in got]
    merged: dict[str, Any] = {"state": {}, "param_groups": parts[0][1], "group_of": {},
                              "optimizer": parts[0][3]}
    for st, _, go, _ in parts:
        merged["state"].update(st)
        merged["group_of"].update(go)
    return merged


def load_optimizer_state(model: _Model, optimizer: torch.optim.Optimizer,
                         state: dict[str, Any]) -> None:
    """Load a state from `gather_optimizer_state` into this rank's optimizer (local:
    no message)."""
    names = _optimizer_names(model, optimizer, "load_optimizer_state")
    if not isinstance(state, dict) or not {"state", "param_groups"} <= set(state):
        raise ValueError("`state` must be what gather_optimizer_state returned (a dict "
                         "with 'state' and 'param_groups'), got "
                         f"{type(state).__name__}")
    saved_type = state.get("optimizer")
    if saved_type is not None and saved_type != type(optimizer).__name__:
        raise ValueError(f"`state` was gathered from a {saved_type} optimizer; it cannot "
                         f"be loaded into a {type(optimizer).__name__}")
    order = [p for g in optimizer.param_groups for p in g["params"]]
    local = optimizer.state_dict()
    if len(local["param_groups"]) != len(state["param_groups"]):
        raise ValueError("`state` has a different number of parameter groups than "
                         "`optimizer`")
    new_state = {}
    for i, p in enumerate(order):
        st = next((state["state"][n] for n in names[id(p)] if n in state["state"]), None)
        if st is not None:
            # copies: the optimizer updates its state in place, and `state` must stay
            # what was gathered (it may be loaded again, or saved later)
            new_state[i] = {k: (v.detach().to(p.device if v.dim() > 0 else v.device,
                                              copy=True) if isinstance(v, Tensor) else v)
                            for k, v in st.items()}
    groups = []
    for g_local, g_saved in zip(local["param_groups"], state["param_groups"]):
        # (the rank whose layers the group steps stays this rank's: `optimizers.OWNER`)
        mine = {k: g_local[k] for k in ("params", OWNER) if k in g_local}
        groups.append({**{k: v for k, v in g_saved.items() if k != OWNER}, **mine})
    optimizer.load_state_dict({"state": new_state, "param_groups": groups})


def clip_grad_norm(model: _Model, max_norm: float, norm_type: float = 2.0,
                   error_if_nonfinite: bool = False) -> Tensor:
    """`LayerParallel.clip_grad_norm_`: the whole network's gradient norm, the ranks'
    parts summed in rank order (the same on every rank), every gradient scaled by
    ``max_norm / total`` where the total exceeds it (collective)."""
    params = [q for q in model.parameters() if q.grad is not None]
    # a parameter whose layers lie on several ranks has the same gradient on each:
    # counted once, on the first of them
    counted = params if model._shared is None else \
        [q for q in params if model._shared.counts_here(q, model.rank)]
    return clip_over_ranks(params, counted, None if model.size == 1 else lambda local: (
        model.guard(lambda: model.transport.allgather_object(local, "clip_grad_norm_"))),
        max_norm, norm_type, error_if_nonfinite)


def clip_over_ranks(params: Sequence[Tensor], counted: Sequence[Tensor],
                    gather: Optional[Callable[[float], list[float]]], max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False) -> Tensor:
    """`torch.nn.utils.clip_grad_norm_` of a net whose gradients lie on several ranks:
    the norm of this rank's `counted` gradients (each gradient counted on one rank
    only), the ranks' parts combined through `gather` (this rank's part -> every
    rank's, in rank order; None: one rank), and `params`' gradients scaled by
    ``max_norm / total`` where the total exceeds it.  Returns the total (float64)."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or \
            not max_norm >= 0:  # (NaN fails the comparison)
        raise ValueError(f"`max_norm` must be a number >= 0, got {max_norm!r}")
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or \
            not norm_type > 0:
        raise ValueError(f"`norm_type` must be a number > 0 (or inf), got {norm_type!r}")
    p = float(norm_type)
    params = [q for q in params if q.grad is not None]
    grads = [q.grad for q in counted if q.grad is not None]
    local = 0.0
    if grads:
        part = float(torch.nn.utils.get_total_norm(grads, p))
        local = part if p == float("inf") else part ** p
    parts = [local] if gather is None else gather(local)
    total = max(parts) if p == float("inf") else sum(parts) ** (1.0 / p)
    if error_if_nonfinite and not math.isfinite(total):
        raise RuntimeError(f"the total norm of order {p:g} of the gradients is "
                           f"{total}, so it cannot be clipped (error_if_nonfinite)")
    norm = torch.tensor(total, dtype=torch.float64)
    if params:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def check_state_dict(model: _Model, mine: dict[str, Any], state_dict: Any,
                     strict: bool) -> list[str]:
    """`LayerParallel.load_state_dict`'s checks, before anything is loaded: a whole
    network's dict checked against the whole net (alike on every rank), a dict of this
    rank's keys against `mine` (this rank's own state dict).  Returns the unexpected
    keys (those of no layer)."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"`state_dict` must be a mapping of names to tensors, got "
                        f"{type(state_dict).__name__}")
    # checked first, against this rank's part or the whole net's (torch's own
    # load copies what it can before it raises)
    whole = mine if all(k in mine for k in state_dict) else \
        nn.Module.state_dict(model.whole_net, keep_vars=True)  # (its names: no guard)
    unexpected = [k for k in state_dict if k not in whole]
    errors = []
    if strict and unexpected:
        errors.append("Unexpected key(s) in state_dict (no layer of this network has "
                      "them): " + ", ".join(f'"{k}"' for k in unexpected))
    if strict:
        missing = [k for k in whole if k not in state_dict]
        if missing:
            errors.append("Missing key(s) in state_dict: "
                          + ", ".join(f'"{k}"' for k in missing))
    for k, v in state_dict.items():
        want = whole.get(k)
        if want is not None and isinstance(v, Tensor) and v.shape != want.shape:
            errors.append(f"size mismatch for {k}: copying a param with shape "
                          f"{v.shape} from checkpoint, the shape in current model is "
                          f"{want.shape}.")
    if errors:
        raise RuntimeError("Error(s) in loading state_dict for LayerParallel:\n\t"
                           + "\n\t".join(errors))
    return unexpected


#: why `LayerParallel.load_state_dict` refuses ``assign=True``: layerpar holds this
#: rank's parameter tensors beyond the modules (the solvers' per-layer lists, stacked
#: views, shared parameters' reductions, auto's replicated copies), which would go on
#: using and training the old tensors
ASSIGN_REFUSED = (
    "LayerParallel.load_state_dict does not support `assign=True`: layerpar holds this "
    "rank's parameter tensors in its solvers, vectorised steps and gradient reductions, "
    "which would go on using and training the old tensors. Load with assign=False (the "
    "values are copied into the parameters layerpar and your optimizer hold), or load "
    "the state into the ODENet with assign=True before building the LayerParallel")
#: why a LayerParallel cannot be deep-copied
DEEPCOPY_REFUSED = (
    "a LayerParallel cannot be deep-copied: it holds a communicator and its layers live "
    "on several ranks. For an average of the weights (EMA), keep copies of this rank's "
    "parameters (`[p.detach().clone() for p in model.parameters()]`) or of "
    "`model.gather_state_dict()`; for a second model, build one (`model.like()`)")


def refuse_pickling(model: Any, protocol: Any = None) -> Any:
    """`LayerParallel.__reduce_ex__`: ``torch.save(model)`` and ``pickle`` refused by
    name, with what to save instead (the native solver's state has no pickled form)."""
    raise TypeError(
        "a LayerParallel cannot be pickled (torch.save(model), pickle.dumps): it holds a "
        "communicator and native solver state, and its layers live on several ranks. "
        "Save `model.gather_state_dict()` (collective: it loads into the serial ODENet "
        "or into a LayerParallel on any number of ranks) and, for the optimizer, "
        "`model.gather_optimizer_state(optimizer)`")


def this_ranks_part(model: _Model, state_dict: Any, mine: dict[str, Any]) -> dict:
    """What this rank loads from `state_dict`: its own keys, and for a tensor the whole
    net holds under several names (a shared block, tied weights) the value of the last
    of its names present, in the whole net's order (the one serial `load_state_dict`
    leaves in it), under each of this rank's names for it: a dict that keeps one name
    per tensor, or tied names with other values, loads as into the serial net."""
    out = {k: v for k, v in state_dict.items() if k in mine}
    names_of: dict[int, list[str]] = {}
    for n, t in nn.Module.state_dict(model.whole_net, keep_vars=True).items():
        names_of.setdefault(id(t), []).append(n)
    for names in names_of.values():
        given = [n for n in names if n in state_dict]
        if len(names) > 1 and given:
            for n in names:
                if n in mine:
                    out[n] = state_dict[given[-1]]
    return out


def _name_order(name: str) -> tuple:
    return tuple(int(p) if p.isdigit() else -1 for p in name.split("."))
