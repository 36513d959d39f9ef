"""Per-layer random-number control, so dropout is consistent under MGRIT.

MGRIT evaluates a layer's step several times per batch (relaxation, residual,
coarse levels, recomputation in the adjoint).  For the parallel result to equal
the serial one, every evaluation of layer n must draw the *same* dropout mask.
``layer_rng(seed, *key)`` seeds the global generator from (seed, key) for the
duration of one evaluation and then puts the previous state back, so the mask
depends only on the per-batch seed and the layer's key, never on how often or in
which order layers were evaluated.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator, Sequence
from typing import Optional

import torch
from torch import nn

__all__ = ["DROPOUT_TYPES", "MAX_SEED", "PLAIN", "REPLICA", "STEP", "GeneratorStates",
           "StepStreams", "needs_rng", "layer_rng", "own_generators", "plain_rng", "draw_seed",
           "mix_seed"]

#: Module types whose forward draws from the global generator.
DROPOUT_TYPES: tuple[type[nn.Module], ...] = (
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.FeatureAlphaDropout,
)

_MASK64 = (1 << 64) - 1
#: The first key of a plain (non-Segment) layer's generator, ``layer_rng(seed, PLAIN, k)``
#: for layer k of an `ODENet`: a Segment's layers use their segment index (>= 0) there.
PLAIN = -1
#: The first key of a data replica's pass seed, ``mix_seed(seed, REPLICA, d)`` for
#: replica d of a process grid: each replica draws masks of its own.
REPLICA = -2
#: The first key of a rank's generator in a data-parallel or pipeline training step,
#: ``layer_rng(seed, STEP, rank)`` (`StepStreams`): each rank draws masks of its own.
STEP = -3
#: The largest seed torch's generators accept (``torch.manual_seed`` takes 64 bits; a
#: larger int fails deep inside torch as "Overflow when unpacking long long").
MAX_SEED = _MASK64


def own_generators(module: Optional[nn.Module]) -> list[tuple[str, torch.Generator]]:
    """(name, generator) of every `torch.Generator` `module`'s modules hold as an
    attribute (``self.g = torch.Generator()``), once each: randomness that the global
    generator's state does not show."""
    if module is None:
        return []
    seen: set[int] = set()
    out = []
    for prefix, m in module.named_modules():
        for k, v in vars(m).items():
            if isinstance(v, torch.Generator) and id(v) not in seen:
                seen.add(id(v))
                out.append((f"{prefix}.{k}" if prefix else k, v))
    return out


class GeneratorStates:
    """The states of the generators a pass may draw from, taken now: the CPU's global
    generator, CUDA's where initialised, and every generator `modules` hold
    (`own_generators`).  `restore` puts them all back, so that a measuring pass (a
    gradient check's, the auto-tuning's) leaves the training's random streams as
    serial training would have them, and two passes draw the same numbers."""

    def __init__(self, modules: Sequence[nn.Module] = ()) -> None:
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        self._cpu = torch.get_rng_state()
        self._cuda = torch.cuda.get_rng_state_all() if cuda else None
        self._own = [(g, g.get_state()) for m in modules for _, g in own_generators(m)]

    def moved(self) -> bool:
        """Whether any of the generators drew since (its state differs from the one
        taken)."""
        if not torch.equal(torch.get_rng_state(), self._cpu):
            return True
        if self._cuda is not None and any(
                not torch.equal(a, b) for a, b in zip(torch.cuda.get_rng_state_all(), self._cuda)):
            return True
        return any(not torch.equal(g.get_state(), state) for g, state in self._own)

    def restore(self) -> None:
        torch.set_rng_state(self._cpu)
        if self._cuda is not None:
            torch.cuda.set_rng_state_all(self._cuda)
        for g, state in self._own:
            g.set_state(state)


def needs_rng(module: nn.Module) -> bool:
    """True if ``module`` contains a dropout submodule that is in training mode now.

    Only the module types in ``DROPOUT_TYPES`` are detected; randomness drawn in a
    custom ``forward`` (e.g. ``F.dropout``) is not.
    """
    return any(isinstance(m, DROPOUT_TYPES) and m.training for m in module.modules())


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mix_seed(seed: int, *key: int) -> int:
    """A deterministic 63-bit seed from ``seed`` and ``key`` (SplitMix64; no ``hash()``)."""
    h = _splitmix64(operator.index(seed) & _MASK64)
    for k in key:
        h = _splitmix64(h ^ (operator.index(k) & _MASK64))
    return h >> 1


@contextlib.contextmanager
def layer_rng(seed: int, *key: int) -> Iterator[None]:
    """Seed the global torch generator from (seed, *key) inside the block; restore it after.

    Covers the CPU generator and, if CUDA is initialised, the current CUDA
    device's generator.  The previous states are restored on exit, also when the
    block raises, so code outside sees an untouched random stream.
    """
    s = mix_seed(seed, *key)
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    cpu_state = torch.get_rng_state()
    cuda_state = torch.cuda.get_rng_state() if cuda else None
    # default_generator, not torch.manual_seed: the latter also queues a lazy
    # seeding of every CUDA device, which would leak past the restore.
    torch.default_generator.manual_seed(s)
    if cuda:
        torch.cuda.manual_seed(s)
    try:
        yield
    finally:
        torch.set_rng_state(cpu_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state)


def plain_rng(seed: Optional[int], k: int,
              layer: nn.Module) -> contextlib.AbstractContextManager[None]:
    """The generator plain layer ``k`` of an `ODENet` runs under in a pass with dropout
    seed `seed`: ``layer_rng(seed, PLAIN, k)`` where it has dropout in training mode,
    else none.  A plain layer runs on one rank only in a layer-parallel pass; drawing
    its mask from the global generator would advance that rank's generator alone, and
    the ranks' generators (a shuffling DataLoader's, say) would fall out of step."""
    if seed is not None and needs_rng(layer):
        return layer_rng(seed, PLAIN, k)
    return contextlib.nullcontext()


def draw_seed() -> int:
    """Draw one int in [0, 2**62) from the global CPU generator (once per forward pass;
    a layer-parallel pass draws it on every rank, so their generators stay in step)."""
    return int(torch.randint(0, 2**62, (), dtype=torch.int64).item())


class StepStreams:
    """The random streams of a training step that runs a different part of `net` on
    each rank (a data-parallel rank's share of the batch, a pipeline rank's stages).

    Drawn from the global generator, a rank's dropout masks would move that rank's
    generator alone (a pipeline's; the ranks' shuffling DataLoaders would then load
    different batches), or repeat on every rank (data parallelism's shares, all drawn
    from one state).  Where `net` holds dropout that is active (`DROPOUT_TYPES` in
    training mode, p > 0), each step instead draws one seed on every rank alike
    (`draw_seed`: the generators stay in step) and runs under ``layer_rng(seed, STEP,
    rank)``: masks of the rank's own, new each step.  A net without it draws nothing
    (its streams stay serial training's).  The dropout modules are found once, here:
    checking them each step costs a few attribute reads, not a walk of the net."""

    def __init__(self, net: nn.Module, rank: int) -> None:
        self.rank = rank
        self._dropouts = [m for m in net.modules() if isinstance(m, DROPOUT_TYPES)
                          and float(getattr(m, "p", 0.0)) > 0]

    def active(self) -> bool:
        """Whether a step now draws masks from the modules found (training mode)."""
        return any(m.training for m in self._dropouts)

    def step(self) -> contextlib.AbstractContextManager[None]:
        """The context one training step runs in (collective: every rank enters it)."""
        if self.active():
            return layer_rng(draw_seed(), STEP, self.rank)
        return contextlib.nullcontext()
