"""What the ranks must agree on, checked before any message of a pass.

Settings are compared by digest (`fingerprint`: a layer's structure), inputs and loss
gradients by a cheap fingerprint of their values (`values_fingerprint`,
`same_values`), and what the XBraid engine cannot do is refused by name
(`check_xbraid`).  Each check raises the same way on every rank.
"""
from __future__ import annotations

import hashlib
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
from ..ode.net import ODENet, Segment
from .batched import structure

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
