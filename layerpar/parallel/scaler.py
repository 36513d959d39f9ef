"""Loss scaling whose overflow check spans the ranks.

`torch.amp.GradScaler` looks for inf and NaN in the gradients of the optimizer it is
given, and skips that optimizer's step and lowers its scale when it finds one.  Under
`LayerParallel` (or a pipeline) each rank's optimizer holds that rank's layers only,
so an overflow in one rank's layers would skip that rank's step alone, and the
ranks' scales would part: the loss gradient the last rank scaled would then be
unscaled by another scale on the others, silently.  `GradScaler` is torch's, with one
exchange added to its unscaling: every rank learns whether any rank found an inf or
NaN, so all skip the step together and their scales stay equal, as one serial
net's scaler would have them.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["GradScaler", "scaler_agrees"]


def _owner(model: Any) -> Any:
    """The `LayerParallel` a policy (`Auto`) or a `LayerParallelMethod` runs (through
    both where a method runs a policy), else `model` itself."""
    while True:
        inner = getattr(model, "model", None)
        if inner is None or inner is model or not hasattr(inner, "transport"):
            return model
        model = inner


def scaler_agrees(model: Any) -> bool:
    """Whether a `GradScaler` was built over `model` (its float16 autocast passes then
    need no warning about torch's per-rank scaler)."""
    return bool(getattr(_owner(model), "_agreeing_scaler", False))


class GradScaler(torch.amp.GradScaler):  # type: ignore[misc]
    """`torch.amp.GradScaler` for a model whose parameters lie on several ranks
    (`LayerParallel`, its ``"auto"`` policy, or a `TrainingMethod`): its unscaling
    (`unscale_`, or the one `step` makes) exchanges one flag between the ranks, so
    every rank skips the optimizer's step where any rank's gradients hold an inf or
    NaN, and the scales stay equal on every rank.  Build it on every rank and use it
    as torch's::

        scaler = layerpar.parallel.GradScaler(model, "cuda")
        with torch.autocast("cuda", dtype=torch.float16):
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)   # collective: call it on every rank
        scaler.update()

    The flag is read on the host once per unscaling (torch's `step` reads it there
    too).  bfloat16 autocast needs no loss scaling at all."""

    def __init__(self, model: Any, device: str = "cuda", **kwargs: Any) -> None:
        owner = _owner(model)
        transport = getattr(owner, "transport", None)
        if transport is None or not hasattr(transport, "allgather_object"):
            raise TypeError(f"`model` must be a LayerParallel, its Auto policy or a "
                            f"TrainingMethod (something with a `transport`), got "
                            f"{type(model).__name__}")
        super().__init__(device, **kwargs)
        self._owner = owner
        owner._agreeing_scaler = True

    def _gather(self, found: bool) -> list[bool]:
        """Every rank's flag (through the model's `guard` where it has one, so that a
        failure on one rank reaches the others)."""
        owner = self._owner
        transport = owner.transport
        if transport.size == 1:
            return [found]
        def gather() -> list[bool]:
            return transport.allgather_object(found, "GradScaler's check for inf and NaN")

        guard = getattr(owner, "guard", None)
        return guard(gather) if guard is not None else gather()

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: Tensor,
                        found_inf: Tensor, allow_fp16: bool) -> dict[torch.device, Tensor]:
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        here = any(float(v) != 0.0 for v in per_device.values())
        anywhere = any(self._gather(here))
        if not per_device:  # (no gradient here: the step and `update` still need a flag)
            per_device = {found_inf.device: found_inf}
        if anywhere and not here:
            for flag in per_device.values():
                flag.fill_(1.0)
        return per_device
