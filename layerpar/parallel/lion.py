"""The Lion optimizer (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms").

torch.optim has no Lion.  Per parameter p with gradient g and momentum m:

    c = beta1 * m + (1 - beta1) * g          (the interpolated momentum)
    p = p - lr * (sign(c) + weight_decay * p)
    m = beta2 * m + (1 - beta2) * g

The update is a sign (-1, 0 or +1; 0 where c is 0: no step), so it can be exchanged
between data replicas as two bits per entry (`layerpar.parallel.sync.LionCub`): an
`update_hook` set on the optimizer sees every parameter's sign tensor before it is
applied and may replace it in place (a majority vote over the replicas).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from .._checks import finite_in, positive_float

__all__ = ["Lion"]


class Lion(torch.optim.Optimizer):
    """Lion: sign of an interpolated momentum, decoupled weight decay.

    lr: step size (Lion wants about 3-10x less than Adam); betas: (beta1, beta2), the
    interpolation of the update and the momentum's decay; weight_decay: decoupled, as
    in AdamW (applied as ``p -= lr * weight_decay * p``).  State per parameter:
    ``exp_avg`` (the momentum m); `state_dict` / `load_state_dict` as for any
    `torch.optim.Optimizer`.

    `update_hook`: None, or a callable given the list of (parameter, sign tensor)
    pairs of one step (after every sign is computed, before any is applied); it may
    change the signs in place (`LionCub`'s majority vote).
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-4,
                 betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0) -> None:
        positive_float("lr", lr)
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2
                and all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas)):
            raise ValueError(f"`betas` must be two numbers in [0, 1), got {betas!r}")
        finite_in("weight_decay", weight_decay, 0.0)
        super().__init__(params, {"lr": float(lr), "betas": tuple(float(b) for b in betas),
                                  "weight_decay": float(weight_decay)})
        self.update_hook: Optional[Callable[[list[tuple[Tensor, Tensor]]], None]] = None
        self._buffers: dict[Tensor, Tensor] = {}  # the update c = sign(...) per parameter

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        """One Lion step (with `update_hook`, the signs of all parameters first)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # c goes into a buffer kept between steps (not state: it is not saved): a fresh
        # tensor per step costs its page faults, which made the step ~1.7x slower
        todo: list[tuple[Tensor, Tensor, dict]] = []
        for group in self.param_groups:
            beta1, _ = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lion does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                u = self._buffers.get(p)
                if u is None or u.shape != p.shape or u.dtype != p.dtype \
                        or u.device != p.device:
                    u = self._buffers[p] = torch.empty_like(p)
                torch.lerp(state["exp_avg"], p.grad, 1.0 - beta1, out=u)
                todo.append((p, u.sign_(), group))
        if self.update_hook is not None and todo:
            self.update_hook([(p, u) for p, u, _ in todo])
        for p, u, group in todo:
            _, beta2 = group["betas"]
            if group["weight_decay"]:
                p.mul_(1.0 - group["lr"] * group["weight_decay"])
            p.add_(u, alpha=-group["lr"])
            self.state[p]["exp_avg"].lerp_(p.grad, 1.0 - beta2)
        return loss
