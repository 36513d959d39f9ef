"""What a user's optimizer over a layer-parallel model's parameters cannot do, refused
at its step: each rank's optimizer holds its own layers' parameters only.

- **Another rank's state.**  ``optimizer.state_dict()`` saved on rank 0 and loaded on
  every rank (the DistributedDataParallel habit, where every rank's optimizer holds
  the same parameters) gives rank q rank 0's moments, position by position: where the
  ranks' parameters have the same shapes, nothing fails, and rank q steps its layers
  with another rank's state (one Adam step was 0.0175 from serial's).  Each
  optimizer's parameter groups carry the rank that stepped them (`OWNER`, a plain
  entry, which `state_dict` saves and `load_state_dict` restores), and a step whose
  groups name another rank, or another rank count, is refused on that rank, and the
  others are told (their next message raises it).  Save ``model.gather_optimizer_state(opt)``
  and load it with ``model.load_optimizer_state(opt, state)`` instead, on any number
  of ranks.
- **Optimizers that reduce over every parameter.**  ``torch.optim.LBFGS`` takes dot
  products over all its parameters, for its directions and curvature pairs: over one
  rank's layers they are another method's (after two steps the parameters were 0.65
  to 0.98 from serial's).  Refused at its first step, on every rank alike.

One global step pre-hook (torch's `register_optimizer_step_pre_hook`),
installed by the first model at two or more ranks.  An optimizer is looked at once, at
its first step (does it hold a parameter of such a model?); afterwards a step reads
one entry of each parameter group.
"""
from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, NoReturn, Optional

import torch
from torch import Tensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = ["OWNER", "watch"]

#: the parameter-group entry naming the rank and rank count whose layers the group's
#: parameters are (saved with the optimizer's state dict, restored by its load)
OWNER = "layerpar_rank"

#: the models at two or more ranks alive in this process (their parameters' ids)
_MODELS: weakref.WeakKeyDictionary[Any, frozenset[int]] = weakref.WeakKeyDictionary()
#: optimizer -> what it was found to be: None (no layer-parallel model's parameters)
#: or (the model, weakly, and this rank's `OWNER` value)
_SEEN: weakref.WeakKeyDictionary[torch.optim.Optimizer, Optional[tuple[Any, str]]] = \
    weakref.WeakKeyDictionary()
_HOOK: list[Any] = []


def watch(model: Any, params: Sequence[Tensor]) -> None:
    """Check the steps of every optimizer over `params`, this rank's parameters of
    `model` (a `LayerParallel` or a pipeline, whose ranks hold parts of the net:
    ``rank``, ``size``, ``transport``), where it has two or more ranks."""
    if model.size == 1:
        return
    _MODELS[model] = frozenset(map(id, params))
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_before_step))


def owner(model: Any) -> str:
    """This rank's `OWNER` value for `model`."""
    return f"rank {model.rank} of {model.size}"


def _find(optimizer: torch.optim.Optimizer) -> Optional[tuple[Any, str]]:
    """The model whose parameters `optimizer` steps, with this rank's `OWNER` value, or
    None; an LBFGS over one refused."""
    ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
    model = next((m for m, mine in list(_MODELS.items()) if not ids.isdisjoint(mine)),
                 None)
    if model is None:
        return None
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError(
            "torch.optim.LBFGS over a LayerParallel model's parameters: each rank's "
            "optimizer holds its own layers only, and LBFGS takes dot products over all "
            "its parameters (its directions and curvature), which would be another "
            "method's over one rank's layers; use a per-parameter optimizer (SGD, Adam, "
            "layerpar.parallel.FlatAdam ...), or train on one rank")
    return weakref.ref(model), owner(model)


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if optimizer in _SEEN:
        found = _SEEN[optimizer]
    else:
        found = _SEEN[optimizer] = _find(optimizer)
    if found is None:
        return
    ref, mine = found
    got = next((g[OWNER] for g in optimizer.param_groups
                if g.setdefault(OWNER, mine) != mine), None)
    if got is not None:
        model = ref()
        try:
            _refuse(got, mine)
        except ValueError as exc:
            if model is not None:  # (closed and gone: no other rank to tell)
                model.transport.broadcast_error(exc)
            raise


def _refuse(got: Any, mine: str) -> NoReturn:
    raise ValueError(
        f"this optimizer's state was loaded from the optimizer of {got} (its parameter "
        f"groups say so), and this is {mine}: each rank's optimizer holds its own "
        "layers' parameters, so another rank's state would step them with that rank's "
        "moments; save model.gather_optimizer_state(optimizer) (collective) and load it "
        "with model.load_optimizer_state(optimizer, state) on every rank")
