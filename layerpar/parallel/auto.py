"""`Auto`: the policy above a `LayerParallel` that chooses its setting batch by batch.

A `LayerParallel` runs one fixed setting (its MGRIT options, or exact propagation
inside `exact()`).  `Auto` holds one and decides, for every pass, what it runs:

- ``options="auto"``: the settings are chosen by measurement (`tuner.AutoTuner`:
  MGRIT candidates, exact propagation, replicated serial, timed on the user's own
  batches and held to a bound on the gradient error), and the chosen setting, a twin
  of the model over the same parameter tensors, is watched by the adaptive policy.
- fixed MGRIT options with a `policy` (``LayerParallel(..., accuracy=policy)``):
  adaptive iteration counts (`adaptive.AccuracyController`), exact propagation where
  MGRIT stalls or diverges, and back.

A training loop calls it as it calls the model: ``auto(x)``, ``.parameters()``,
``.train()``, ``.state_dict()``, ``.to()``, ``.close()`` ...; what `Auto` does not
define itself it reads from the model (`model`).  ``LayerParallel(net, comm, "auto")``
and ``LayerParallel(..., accuracy=policy)`` build one (the model's constructor hands
such arguments here: `layerpar.parallel.model.register_above`).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor, nn

from ..mgrit.options import MGRITOptions
from ..mgrit.result import MGRITResult
from . import accuracy as _accuracy
from .adaptive import AccuracyController, apply_iterations, as_policy, forward_adaptive
from .autotune import Limit
from .model import LayerParallel, outside_inference, register_above
from .tuner import AutoAccuracy, AutoTuner, auto_policy

__all__ = ["Auto"]


def _settings_error(tune: bool, policy: Any, backward_options: Any,
                    settings: dict[str, Any]) -> None:
    """Refuse what `Auto` cannot run (raised identically on every rank, before any
    message: the model's constructor agrees on it with the other ranks)."""
    if tune and backward_options is not None:
        raise TypeError("`backward_options` must be None with options='auto' (both are "
                        "chosen by measurement)")
    engine = settings.get("engine", "native")
    if tune and engine != "native":
        raise ValueError(f"`engine`={engine!r} with options='auto': auto's candidates "
                         "(batched cycles, replicated serial) run on layerpar's own "
                         "engine; leave `engine` unset, or give MGRITOptions for "
                         "engine='xbraid'")
    grid = settings.get("grid")
    data = getattr(grid, "data", 1)
    if isinstance(data, int) and data > 1:
        # each replica would decide from its own batches and clocks: replicas that
        # chose different iteration counts, paths or exact propagation could not
        # average their gradients (different buckets hang)
        what = "options='auto'" if tune else "`accuracy`"
        raise ValueError(
            f"{what} cannot be used with data replicas (the grid has data={data}): it "
            "decides from each replica's own batches and timings, and replicas that "
            "decided differently could not average their gradients. Tune on a grid with "
            "data=1 (or `layerpar train --auto`) and give the chosen MGRITOptions here")
    if policy is not None and engine == "xbraid":
        raise ValueError("`accuracy` (adaptive iteration counts) needs engine='native'")


class Auto:
    """A `LayerParallel` under a policy: auto-tuned settings (``options="auto"``) or
    adaptive accuracy on fixed MGRIT options (`policy`).  Collective like the model.

    net: an `ODENet` or a factory returning one (as `LayerParallel` takes it), or a
        `LayerParallel` built already (then only `options="auto"` or `policy`).
    comm, settings: as `LayerParallel` takes them (``grid=``, ``timeout=``, ...).
    options: "auto" (default): tuned by measurement on the first training batch (or
        by `tune`); or `MGRITOptions` run under the adaptive `policy`.
    policy: an `AccuracyPolicy`, True (the default bound) or None; ``accuracy=`` is
        the same argument under the model's name for it.  With "auto", None means the
        measured bound (`tuner.auto_policy`); with fixed options it is required.

    `model` is the `LayerParallel` (its setting: exact propagation under "auto", the
    given options otherwise); `tuner` the `AutoTuner` (None without "auto");
    `accuracy` the adaptive controller (`AutoAccuracy` under "auto").
    """

    def __init__(self, net: Any, comm: Any = None,
                 options: Union[str, MGRITOptions, None] = "auto",
                 backward_options: Optional[MGRITOptions] = None, *,
                 policy: Any = None, accuracy: Any = None, **settings: Any) -> None:
        tune = isinstance(options, str) and options == "auto"
        err: Optional[BaseException] = None
        pol = None
        try:
            pol = as_policy(accuracy if policy is None else policy)
            _settings_error(tune, pol, backward_options, settings)
            if not tune and pol is None:
                raise TypeError("`Auto` needs options='auto' or an accuracy `policy` (a "
                                "LayerParallel alone runs fixed options)")
        except Exception as exc:  # noqa: BLE001 - agreed by the model's constructor
            err = exc
        key = {**({"accuracy": None} if pol is None else pol.key()), "auto": tune}
        if isinstance(net, LayerParallel):  # a model built already: its settings stand
            if err is None and (comm is not None or settings or backward_options is not None
                                or not (tune or options is None)):
                err = TypeError("with a LayerParallel, pass only `options='auto'` or a "
                                "`policy` (its other settings are the model's)")
            world = net.transport if net.grid is None else net.grid.world
            world.agree(key, err, "Auto settings (auto, accuracy)")
            self.model = net
        else:
            # options other than "auto" as given: the model's constructor checks them (a
            # str other than "auto" too), on every rank alike, and names the argument
            fixed: Any = None if tune else options
            self.model = LayerParallel(net, comm, fixed, backward_options, above=(key, err),
                                       **settings)
        self.tuner: Optional[AutoTuner] = None
        self.accuracy: Any
        if tune:
            self.tuner = AutoTuner(auto_policy(pol))
            # the chosen setting's controller, and an answer for every setting
            self.accuracy = AutoAccuracy(self.tuner)
        else:
            if pol is None:
                raise RuntimeError("an untuned Auto model needs an accuracy policy")
            m = self.model
            self.accuracy = AccuracyController(pol, m.options.max_iter,
                                               m.backward_options.max_iter)
        self._direct_model = False  # inside `exact()` / `checking()`: the model's passes

    def __getattr__(self, name: str) -> Any:
        """What `Auto` does not define is the model's (`parameters`, `state_dict`,
        `rank`, `transport`, `options`, `gather_state_dict`, `clip_grad_norm_` ...)."""
        if name.startswith("__") or name in ("model", "tuner", "accuracy"):
            raise AttributeError(name)  # (unset: a copy or an unpickling being built)
        return getattr(self.model, name)

    # -- passes -------------------------------------------------------------------------------
    def __call__(self, x: Tensor) -> Tensor:
        """A training or evaluation pass, under the policy (pass the same `x` on every
        rank)."""
        if torch.is_inference_mode_enabled():
            return outside_inference(self.__call__, x)
        if self._direct_model:
            return self.model(x)
        if self.tuner is not None:
            return self.tuner.forward(self.model, x)
        return forward_adaptive(self.model, self.accuracy, x)

    forward = __call__

    @contextlib.contextmanager
    def exact(self) -> Iterator[None]:
        """Passes inside run the model's exact propagation (`LayerParallel.exact`); the
        policy stands aside."""
        prev, self._direct_model = self._direct_model, True
        try:
            with self.model.exact():
                yield
        finally:
            self._direct_model = prev

    @contextlib.contextmanager
    def checking(self) -> Iterator[None]:
        """Passes inside are a gradient check's (`LayerParallel.checking`): the model's
        own, without the policy."""
        prev, self._direct_model = self._direct_model, True
        try:
            with self.model.checking():
                yield
        finally:
            self._direct_model = prev

    def _running(self) -> Any:
        """What runs the passes now: the tuner's chosen setting, else the model."""
        chosen = None if self.tuner is None else self.tuner.chosen
        return self.model if chosen is None else chosen

    @property
    def last_forward(self) -> list[MGRITResult]:
        """Per segment, what the last forward pass's solves reached (the chosen
        setting's under "auto")."""
        return self._running().last_forward

    @last_forward.setter
    def last_forward(self, value: list[MGRITResult]) -> None:
        self._running().last_forward = value

    @property
    def last_backward(self) -> list[MGRITResult]:
        """Per segment, what the last backward pass's adjoint solves reached."""
        return self._running().last_backward

    @last_backward.setter
    def last_backward(self, value: list[MGRITResult]) -> None:
        self._running().last_backward = value

    @property
    def batch(self) -> int:
        """The model's forward passes so far (`LayerParallel.batch`)."""
        return self.model.batch

    @batch.setter
    def batch(self, value: int) -> None:
        self.model.batch = value

    @property
    def training(self) -> bool:
        return self.model.training

    @training.setter
    def training(self, mode: bool) -> None:
        self.model.training = mode

    # -- the policy ---------------------------------------------------------------------------
    def tune(self, x: Tensor, y: Any, loss_fn: Callable[[Tensor, Any], Tensor],
             steps: Optional[int] = None, online: bool = False, *,
             to_beat: Optional[float] = None, limit: Limit = None,
             serial_floor: Optional[float] = None) -> Any:
        """With ``options="auto"``: measure the candidate settings on this batch with
        this loss and choose (collective; `tuner.AutoTuner.tune`; `steps`, the
        training steps to come, bounds the tuning's time).  Returns the `TuneResult`
        (candidate table and choice), identical on every rank.

        online: the passes that follow are training steps (forward, backward,
        optimizer step), so with `steps` given the exact replicated settings may be
        timed on those steps rather than on passes of their own; then None is
        returned, and the result lands in ``tuner.results`` once they decided.

        to_beat: seconds per pass of a way of training outside layer-parallel
        training timed already (`choose_method`'s candidates): an MGRIT setting no
        faster is not checked.  limit: seconds the tuning may take at most, or a
        function of the fastest seconds per pass found.  serial_floor: the serial
        step at the ranks' thread count, timed by the caller: exact propagation's
        pass takes at least that (`autotune.tune`)."""
        if self.tuner is None:
            raise RuntimeError("tune() needs a LayerParallel built with options='auto'")
        return self.tuner.tune(self.model, x, y, loss_fn, steps, online, to_beat=to_beat,
                               limit=limit, serial_floor=serial_floor)

    def check_gradients(self, x: Tensor, y: Any,
                        loss_fn: Callable[[Tensor, Any], Tensor]) -> Any:
        """`LayerParallel.check_gradients` of the setting running now, observed by the
        policy (which may change the iteration counts, or tune again under "auto")."""
        if self.tuner is not None and self.tuner.chosen is not None and \
                not self._direct_model:
            return self.tuner.check(self.model, x, y, loss_fn)
        got = self.measure_gradients(x, y, loss_fn)
        self.accuracy.observe_check(self.model.batch, got)
        return got

    def measure_gradients(self, x: Tensor, y: Any,
                          loss_fn: Callable[[Tensor, Any], Tensor], *,
                          reference: Optional[_accuracy.ExactReference] = None) -> Any:
        """`check_gradients` of the setting as the controller runs it, without the
        controller observing the result (auto confirms a check outside its bound
        before anything changes); `reference`: this batch's exact pass, run already
        (`check_gradients`')."""
        if self.tuner is None:
            apply_iterations(self.model, self.accuracy)  # MGRIT as the controller runs it
        with self.model.checking():
            return _accuracy.check_gradients(self.model, x, y, loss_fn, reference=reference)

    def refine(self, factor: int = 2, interpolation: str = "constant") -> Any:
        """`LayerParallel.refine` (nested iteration), under the same bound: the refined
        model runs the model's options under adaptive accuracy."""
        from .refine import refine_parallel

        return refine_parallel(self.model, factor, interpolation,
                               accuracy=self.accuracy.policy)

    # -- nn.Module's conversions and modes ----------------------------------------------------
    def _apply(self, fn: Callable, recurse: bool = True) -> Auto:
        """`.to()`, `.double()`, `.cuda()` ... reach the model and every setting the
        tuner holds (`AutoTuner.apply`)."""
        self.model._apply(fn, recurse)
        if self.tuner is not None:
            self.tuner.apply(fn)
        return self

    to = nn.Module.to
    cuda = nn.Module.cuda
    cpu = nn.Module.cpu
    double = nn.Module.double
    float = nn.Module.float
    half = nn.Module.half
    bfloat16 = nn.Module.bfloat16

    def train(self, mode: bool = True) -> Auto:
        self.model.train(mode)
        return self

    def eval(self) -> Auto:
        return self.train(False)

    def close(self) -> None:
        """Release the settings the tuner holds and the model's communicator
        (collective)."""
        if self.tuner is not None:
            self.tuner.close()
        self.model.close()

    def __repr__(self) -> str:
        what = "auto" if self.tuner is not None else "adaptive accuracy"
        return f"Auto({what}: {self.accuracy!r}, model={self.model!r})"


register_above(Auto)
