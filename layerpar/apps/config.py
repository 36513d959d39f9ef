"""One training configuration for every front door: `TrainConfig`.

``layerpar train`` and the examples build it from their parsed command line
(`TrainConfig.from_args`), the Python API `layerpar.apps.train.train` from its keywords
(``TrainConfig(**kw)``).  It checks itself once, on construction: every range and every
conflict between options is written here, once, and its message names the option the
way the front door that built the configuration spells it: ``--check-every`` on the
command line, ``check_every`` in Python (each field's flag is its metadata).

Values that come from the problem's `Recipe` when not given (epochs, batch size,
learning rate, the optimizer and the nested stages' epochs) are resolved on
construction, so a configuration says what will run.
"""
from __future__ import annotations

import argparse
import math
import numbers
import os
from dataclasses import dataclass, field, fields
from typing import Any, Optional, Union

import torch

from ..mgrit.options import ENGINE_INT_MAX, MAX_LEVELS, MGRITOptions
from ..mgrit.transport import DEFAULT_TIMEOUT
from ..mgrit.xbraid import ENGINES
from ..ode.rng import MAX_SEED
from ..parallel.adaptive import AccuracyPolicy, as_policy
from .arguments import AUTO_CHOOSES, METHOD_CHOICES, SCHEDULE_CHOICES
from .nets import ARCHITECTURES, problem_name, recipe_for

__all__ = ["DEVICES", "SYNCS", "TrainConfig"]

DEVICES = ("cpu", "cuda")
SYNCS = ("allreduce", "daso", "lioncub")
#: the command line's spelling of a configuration (its messages name flags)
ARGV = "argv"
#: the Python API's (its messages name keywords)
KEYWORDS = "keywords"


def _opt(flag: str, default: Any = None, **kw: Any) -> Any:
    """A field whose command-line flag is `flag`."""
    return field(default=default, metadata={"flag": flag}, **kw)


@dataclass(frozen=True)
class TrainConfig:
    """What `layerpar.apps.train.train` trains and how: frozen, checked on construction
    (ValueError, or TypeError for a value of the wrong type, naming the option).

    None means the problem's `Recipe` (epochs, batch_size, lr), the defaults of
    `layerpar.defaults.TRAINING` (fwd, bwd) or the engine "native"; after construction
    epochs, batch_size, lr, optimizer and nested_epochs hold what will run.  fwd, bwd
    and engine stay None where not given: `auto` and `serial` refuse them given.
    """

    model: str = _opt("model")
    """The problem: "peaks", "digits" or "mnist1d"."""
    serial: bool = _opt("--serial", False)
    """Train the plain `ODENet` with ordinary autograd (the serial oracle)."""
    epochs: Optional[int] = _opt("--epochs")
    batch_size: Optional[int] = _opt("--batch-size")
    lr: Optional[float] = _opt("--lr")
    seed: int = _opt("--seed", 0)
    """Data split, initial parameters and batch order."""
    fwd: Optional[MGRITOptions] = _opt("--levels")
    """MGRIT options of the forward solves (None: `TRAINING.fwd_options()`)."""
    bwd: Optional[MGRITOptions] = _opt("--levels")
    """MGRIT options of the adjoint solves (None: `TRAINING.bwd_options()`)."""
    progress: bool = _opt("--no-progress", True)
    dtype: torch.dtype = _opt("--float64", torch.float32)
    n_layers: Optional[int] = _opt("--layers")
    width: Optional[int] = _opt("--width")
    data_parallel: int = _opt("--data-parallel", 1)
    """Replicas R of a `ProcessGrid` (R x L processes): every process draws the same
    global batches, each replica trains on its share, gradients are averaged."""
    adaptive: Union[bool, AccuracyPolicy] = _opt("--adaptive", False)
    """Adaptive accuracy (`LayerParallel(accuracy=...)`: True for the default bound, or
    an `AccuracyPolicy`): iteration counts follow the measured gradient error."""
    check_every: int = _opt("--check-every", 0)
    """Measure the gradient error every K-th batch (0: never, unless adaptive)."""
    nested: int = _opt("--nested", 0)
    """Nested iteration: nets of n/2^K, ..., n/2 layers first, `nested_epochs` epochs
    each, each refined onto the next; then the n-layer net `epochs` epochs."""
    nested_epochs: Optional[int] = _opt("--nested-epochs")
    """Epochs of each coarser net of `nested` (None: 2)."""
    timeout: float = _opt("--timeout", DEFAULT_TIMEOUT)
    """Seconds any one wait for another rank may take (`LayerParallel`'s)."""
    engine: Optional[str] = _opt("--engine")
    """"native" or "xbraid" (None: "native")."""
    arch: Optional[str] = _opt("--model")
    """Architecture ("dense" or "conv" for mnist1d; None: the problem's)."""
    t_final: Optional[float] = _opt("--t-final")
    """Final time of the ODE segment (None: the problem's)."""
    device: str = _opt("--device", "cpu")
    """"cpu" or "cuda" (a layer-parallel step is captured in a CUDA graph where the
    settings allow it)."""
    auto: Union[bool, AccuracyPolicy] = _opt("--auto", False)
    """MGRIT settings chosen by measurement on the first batch, then watched by the
    adaptive policy (an `AccuracyPolicy` here: its bound)."""
    target_acc: Optional[float] = _opt("--target-acc")
    """Stop once the validation accuracy reaches it."""
    time_budget: Optional[float] = _opt("--time-budget")
    """Stop after this many seconds of training (evaluation not counted)."""
    sync: str = _opt("--sync", "allreduce")
    """How data replicas stay in step: "allreduce", "daso" or "lioncub"."""
    nodes: Optional[int] = _opt("--nodes")
    """Nodes the replicas are split into (DASO's inter-node exchanges)."""
    optimizer: Optional[str] = _opt("--optimizer")
    """"adam" or "lion" (None: Adam; Lion for sync "lioncub")."""
    slow_link: Optional[float] = _opt("--slow-link")
    """Gbit/s of a simulated link between nodes."""
    compile: bool = _opt("--compile", False)
    threads: Union[None, int, str] = _opt("--threads")
    """Torch threads: a count, "best" (the count whose serial batch is fastest here,
    measured at start: `layerpar.apps.threads.serial_threads`), or None (as they are)."""
    method: Optional[str] = _opt("--method")
    """"layerparallel", "data" or "pipeline" (`layerpar.parallel.baselines`); None:
    layer-parallel, or under `auto` on several ranks the fastest of the three
    (`layerpar.parallel.choose_method`); with `auto`, a method given is the only one
    timed."""
    schedule: Optional[str] = _opt("--schedule")
    """The pipeline's schedule (None: the fastest of "gpipe" and "1f1b", measured)."""
    microbatches: Optional[int] = _opt("--microbatches")
    """The pipeline's micro-batches per batch (None: the fastest count, measured)."""
    spelling: str = field(default=KEYWORDS, compare=False, repr=False)
    """How the messages name options: "keywords" (``check_every``) or "argv"
    (``--check-every``); set by `from_args`."""
    given: frozenset = field(default=frozenset(), compare=False, repr=False)
    """The MGRIT flags the command line gave (a refusal of `fwd` names the first)."""

    # -- how options are named -------------------------------------------------------------

    def flag(self, name: str) -> str:
        """Option `name` as this configuration's front door spells it, in backticks."""
        if self.spelling != ARGV:
            return f"`{name}`"
        if name in ("fwd", "bwd"):  # the first MGRIT flag given
            return f"`{next((f for f in AUTO_CHOOSES if f in self.given), '--levels')}`"
        return f"`{_FLAGS[name]}`"

    def said(self, name: str, value: Any, whole: bool = False) -> str:
        """Option `name` with `value`: ```--nested` 6`` or ```nested`=6``; `whole`: the
        command line's in one pair of backticks (```--sync lioncub```)."""
        if self.spelling == ARGV:
            return f"`{_FLAGS[name]} {value}`" if whole else f"{self.flag(name)} {value}"
        return f"`{name}`={value!r}"

    # -- construction ----------------------------------------------------------------------

    @classmethod
    def from_args(cls, args: argparse.Namespace, model: Optional[str] = None) -> TrainConfig:
        """The configuration of a parsed command line (`add_arguments`' options, and
        ``layerpar train``'s data-parallel ones where present); `model` defaults to
        ``args.model``.  The MGRIT flags become `fwd` and `bwd` where any was given."""
        given = frozenset(getattr(args, "given", ()))
        _check_mgrit_flags(args)
        fwd = bwd = None
        if given & set(AUTO_CHOOSES) - {"--engine"}:
            common = dict(max_levels=args.levels, cfactor=args.cfactor, nrelax=args.nrelax,
                          tol=args.tol)
            fwd = MGRITOptions(max_iter=args.fwd_iters, **common)
            bwd = MGRITOptions(max_iter=args.bwd_iters, **common)
        bound = _bound(args)
        if bound and not (args.adaptive or getattr(args, "auto", False)):
            raise ValueError(f"`--{next(iter(bound)).replace('_', '-').replace('rel-', 'grad-')}"
                             "` sets the bound of `--adaptive` or `--auto`: give one of them")
        try:
            policy = AccuracyPolicy(**bound) if bound else None
        except ValueError as exc:
            flag = "--max-grad-error" if "max_rel_error" in str(exc) else "--min-cosine"
            raise ValueError(f"`{flag}`: {exc}") from None
        get = partial_get(args)
        return cls(
            model=model or args.model, serial=args.serial, epochs=args.epochs,
            batch_size=args.batch_size, lr=args.lr, seed=args.seed, fwd=fwd, bwd=bwd,
            progress=not args.no_progress,
            dtype=torch.float64 if args.float64 else torch.float32,
            n_layers=get("layers"), width=get("width"),
            data_parallel=get("data_parallel", 1),
            adaptive=(policy or True) if args.adaptive else False,
            check_every=args.check_every, nested=args.nested,
            nested_epochs=args.nested_epochs, timeout=get("timeout", DEFAULT_TIMEOUT),
            engine=args.engine if "--engine" in given else None, arch=get("arch"),
            t_final=get("t_final"), device=get("device", "cpu"),
            auto=(policy or True) if get("auto", False) else False,
            target_acc=get("target_acc"), time_budget=get("time_budget"),
            sync=get("sync", "allreduce"), nodes=get("nodes"),
            optimizer=get("optimizer"), slow_link=get("slow_link"),
            compile=get("compile", False), method=get("method"),
            schedule=get("schedule"), microbatches=get("microbatches"),
            threads=args.threads if get("threads") is not None else "best"
            if args.serial and not os.environ.get("OMP_NUM_THREADS") else None,
            spelling=ARGV, given=given)

    def __post_init__(self) -> None:
        model = problem_name(self.model)
        # the architecture's own recipe (a wrong `arch` is named by the checks below)
        recipe = recipe_for(model, self.arch if self.arch in ARCHITECTURES[model] else None)
        self._types()
        lr_given = self.lr is not None
        optimizer = self.optimizer
        if optimizer is None:
            optimizer = "lion" if self.sync == "lioncub" else "adam"
        resolved = dict(
            model=model,
            epochs=recipe.epochs if self.epochs is None else self.epochs,
            batch_size=recipe.batch_size if self.batch_size is None else self.batch_size,
            # Lion's steps are signs: it wants a smaller rate than Adam
            lr=self.lr if lr_given else recipe.lr / (3 if optimizer == "lion" else 1),
            optimizer=optimizer,
            nested_epochs=self.nested_epochs)
        self._ranges(resolved)
        self._conflicts()
        if resolved["nested_epochs"] is None:
            resolved["nested_epochs"] = 2
        for name, value in resolved.items():
            object.__setattr__(self, name, value)

    # -- the checks, each written once -----------------------------------------------------

    def _types(self) -> None:
        for name in ("serial", "compile", "progress"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{self.flag(name)} must be a bool, got "
                                f"{type(getattr(self, name)).__name__}")
        if self.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"{self.flag('dtype')} must be torch.float32 or torch.float64, "
                             f"got {self.dtype!r}")
        for name in ("fwd", "bwd"):
            o = getattr(self, name)
            if o is not None and not isinstance(o, MGRITOptions):
                raise TypeError(f"{self.flag(name)} must be an MGRITOptions, got "
                                f"{type(o).__name__}")
        as_policy(self.adaptive)  # TypeError naming `accuracy`, as LayerParallel's
        if not isinstance(self.auto, (bool, AccuracyPolicy)):
            raise TypeError(f"{self.flag('auto')} must be a bool or an AccuracyPolicy, got "
                            f"{type(self.auto).__name__}")

    def _int(self, name: str, value: Any, lo: int, hi: Optional[int] = None) -> None:
        """`value` an int in [lo, hi]: the command line says ">= lo" / "<= hi", Python
        also the type ("a positive int", "an int >= 0", "an int in [0, 2**64 - 1]")."""
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{self.flag(name)} must be {_want(lo, hi)}, got "
                            f"{type(value).__name__}")
        if value < lo or (hi is not None and value > hi):
            if self.spelling == ARGV:
                want = f">= {lo}" if value < lo else f"<= {hi}"
            else:
                want = _want(lo, hi)
            raise ValueError(f"{self.flag(name)} must be {want}, got {value}")

    def _ranges(self, r: dict[str, Any]) -> None:
        for name, lo, hi in (("epochs", 1, None), ("batch_size", 1, None),
                             ("seed", 0, MAX_SEED), ("check_every", 0, None),
                             ("nested", 0, None), ("nested_epochs", 1, None),
                             ("n_layers", 1, ENGINE_INT_MAX), ("width", 1, ENGINE_INT_MAX),
                             ("data_parallel", 1, None), ("microbatches", 1, None)):
            self._int(name, r.get(name, getattr(self, name)), lo, hi)
        nodes = self.nodes
        if nodes is not None and (not _number(nodes) or nodes < 1 or self.data_parallel % nodes):
            raise ValueError(f"{self.flag('nodes')} must be >= 1 and divide "
                             f"{self.said('data_parallel', self.data_parallel)}, got "
                             f"{self.nodes}")
        if self.threads != "best":
            self._int("threads", self.threads, 1, ENGINE_INT_MAX)
        if not (_number(self.timeout) and math.isfinite(self.timeout) and self.timeout > 0):
            raise ValueError(f"{self.flag('timeout')} must be a positive number of seconds, "
                             f"got {self.timeout}")
        if not (_number(r["lr"]) and math.isfinite(r["lr"]) and r["lr"] > 0):
            raise ValueError(f"{self.flag('lr')} must be a positive number, got {r['lr']}")
        for name, hi in (("t_final", math.inf), ("target_acc", 1.0), ("time_budget", math.inf),
                         ("slow_link", math.inf)):
            v = getattr(self, name)
            if v is not None and not (_number(v) and math.isfinite(v) and 0 < v <= hi):
                what = ("in (0, 1]" if hi == 1.0 else "a positive number of Gbit/s"
                        if name == "slow_link" else "a finite number > 0")
                raise ValueError(f"{self.flag(name)} must be {what}, got {v}")
        for name, value, choices in (("engine", self.engine, (None, *ENGINES)),
                                     ("device", self.device, DEVICES),
                                     ("sync", self.sync, SYNCS),
                                     ("method", self.method, (None, *METHOD_CHOICES)),
                                     ("schedule", self.schedule, (None, *SCHEDULE_CHOICES)),
                                     ("optimizer", r["optimizer"], ("adam", "lion")),
                                     ("arch", self.arch,
                                      (None, *ARCHITECTURES[r["model"]]))):
            if value not in choices:
                names = [c for c in choices if c is not None]
                raise ValueError(f"{self.flag(name)} must be one of {names}"
                                 + (f" for {r['model']}" if name == "arch" else "")
                                 + f", got {value!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"{self.said('device', 'cuda')}: CUDA is not available on this "
                             "machine")

    def _conflicts(self) -> None:
        """Options that conflict, or that act only with another."""
        f = self.flag
        auto, adaptive = self.auto is not False, self.adaptive is not False
        if self.nested_epochs is not None and not self.nested:
            raise ValueError(f"{f('nested_epochs')} sets the epochs of each {f('nested')} "
                             f"stage: give {f('nested')}")
        if auto and (self.serial or self.nested or self.data_parallel > 1):
            raise ValueError(f"{f('auto')} chooses layer-parallel settings: not with "
                             f"{f('serial')}, {f('nested')} or {f('data_parallel')}")
        if self.serial and self.data_parallel > 1:
            raise ValueError(f"{f('data_parallel')} makes replicas of a layer-parallel "
                             f"model: not with {f('serial')}, which trains the whole net "
                             f"on each process alone (the batch split of the whole net "
                             f"is {f('method')} \"data\")")
        if adaptive and self.data_parallel > 1:
            raise ValueError(f"{f('adaptive')} decides from each replica's own batches: not "
                             f"with {f('data_parallel')}")
        for name in ("fwd", "bwd", "engine"):
            if getattr(self, name) is None:
                continue
            for on, why in (("auto", "auto chooses the MGRIT settings (and the engine) "
                                     "by measurement"),
                            ("serial", "the serial oracle runs no MGRIT solve (nor an "
                                       "engine)")):
                if getattr(self, on) is not False:
                    raise ValueError(f"{f(name)} with {f(on)}: {why}; give one or the "
                                     "other")
        if auto and self.check_every:
            raise ValueError(f"{f('check_every')} with {f('auto')}: auto spreads its own "
                             "gradient checks (about 3 % of the training's time)")
        self._method_conflicts()
        if self.compile and not self.serial:
            raise ValueError(f"{f('compile')} compiles the serial net with torch.compile: "
                             f"give {f('serial')} (a layer-parallel step is captured on "
                             "CUDA instead)")
        if self.compile and self.nested:
            raise ValueError(f"{f('compile')} with {f('nested')}: each refinement is a new "
                             "net, which would compile again")
        if self.serial and (adaptive or self.check_every):
            raise ValueError(f"{f('adaptive')} and {f('check_every')} need a layer-parallel "
                             "run (they compare MGRIT with exact propagation), not "
                             f"{f('serial')}")
        if self.threads == "best" and not self.serial:
            raise ValueError(f"{self.said('threads', 'best')} measures the serial net: give "
                             f"{f('serial')}, or a number of threads")
        if self.sync == "lioncub" and self.optimizer == "adam":
            raise ValueError(f"{self.said('sync', 'lioncub', True)} exchanges Lion updates: not "
                             f"with {self.said('optimizer', 'adam')}")
        if self.data_parallel == 1:  # options that act only between data replicas
            for name, given in (("sync", self.sync != "allreduce"),
                                ("slow_link", self.slow_link is not None),
                                ("nodes", self.nodes is not None)):
                if given:
                    raise ValueError(f"{f(name)} acts between data replicas: give "
                                     f"{f('data_parallel')} R > 1")

    def _method_conflicts(self) -> None:
        """What `method`, `schedule` and `microbatches` allow beside them."""
        f, method = self.flag, self.method
        pipeline_may = method == "pipeline" or (method is None and self.auto is not False)
        for name in ("schedule", "microbatches"):
            if getattr(self, name) is not None and not pipeline_may:
                raise ValueError(f"{f(name)} sets the pipeline: give {f('method')} "
                                 f"\"pipeline\" (or {f('auto')})")
        if method is None or method == "layerparallel":
            return
        said = f"{f('method')} \"{method}\""
        if self.serial:
            raise ValueError(f"{said} with {f('serial')}: the serial net runs on one "
                             "process; give one or the other")
        for name, given in (("fwd", self.fwd is not None), ("engine", self.engine is not None),
                            ("adaptive", self.adaptive is not False),
                            ("check_every", self.check_every > 0), ("nested", self.nested > 0),
                            ("data_parallel", self.data_parallel > 1)):
            if given:
                raise ValueError(f"{f(name)} acts on layer-parallel training, not on "
                                 f"{said}")
        if self.device != "cpu":
            raise ValueError(f"{said} runs its process group on gloo, CPU tensors: not "
                             f"with {f('device')} \"{self.device}\"")

    def check_processes(self, size: int, processes: Optional[str] = None) -> None:
        """What the configuration asks of `size` processes (ValueError naming the
        option): `data_parallel` divides them and the batch, and `nested` halvings leave
        each rank of a replica a layer.  `processes`: how the message names them
        (default: "the `size` process(es)")."""
        dp = self.said("data_parallel", self.data_parallel)
        processes = processes or f"the {size} process(es)"
        if size % self.data_parallel:
            raise ValueError(f"{dp} must divide {processes} (N processes form R replicas "
                             "of N/R ranks)")
        if self.batch_size % self.data_parallel:
            raise ValueError(f"the batch size {self.batch_size} must be divisible by {dp}")
        if self.method in ("data", "pipeline") and size < 2:
            raise ValueError(f"{self.flag('method')} \"{self.method}\" shares the work "
                             f"among processes: {processes} are too few (give 2 or more)")
        ranks = 1 if self.serial else size // self.data_parallel
        layers = self.layers
        k = self.nested
        if k and (layers % 2 ** k or layers // 2 ** k < ranks):
            raise ValueError(f"{self.said('nested', k)}: {self.model}'s {layers} layers "
                             f"must halve {k} time(s) and still give each of the {ranks} "
                             "rank(s) per replica at least one layer")

    # -- what follows from the options -----------------------------------------------------

    @property
    def layers(self) -> int:
        """Residual layers of the final net."""
        if self.n_layers is not None:
            return self.n_layers
        return recipe_for(self.model, self.arch if self.arch in ARCHITECTURES[self.model]
                          else None).n_layers

    @property
    def engine_name(self) -> str:
        return self.engine or "native"

    def mgrit_options(self) -> tuple[MGRITOptions, MGRITOptions]:
        """(forward, adjoint) MGRIT options, the defaults where not given."""
        from ..defaults import TRAINING

        return (TRAINING.fwd_options() if self.fwd is None else self.fwd,
                TRAINING.bwd_options() if self.bwd is None else self.bwd)

    def policy(self) -> Optional[AccuracyPolicy]:
        """The accuracy policy `LayerParallel` gets: `adaptive`'s; under auto its bound
        given, else one measured on the batch's gradient noise; with `check_every`, at
        that interval."""
        from dataclasses import replace

        from ..parallel.tuner import auto_policy

        if isinstance(self.auto, AccuracyPolicy):
            return self.auto
        if self.auto:
            return as_policy(self.adaptive) or auto_policy(None)
        policy = as_policy(self.adaptive)
        if policy is not None and self.check_every:
            policy = replace(policy, check_every=self.check_every)
        return policy


_FLAGS = {f.name: f.metadata.get("flag", f.name) for f in fields(TrainConfig)}
_FLAGS["model"] = "model"


def _want(lo: int, hi: Optional[int]) -> str:
    if hi == MAX_SEED:
        return "an int in [0, 2**64 - 1]"
    if hi is not None:
        return f"an int in [{lo}, {hi}]"
    return "a positive int" if lo == 1 else f"an int >= {lo}"


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def partial_get(args: argparse.Namespace) -> Any:
    """``get(name, default)``: an option of `args`, `default` where its parser has none
    (the examples' parsers lack ``layerpar train``'s data-parallel options)."""
    return lambda name, default=None: getattr(args, name, default)


def _bound(args: argparse.Namespace) -> dict[str, float]:
    """The accuracy bound given by ``--max-grad-error`` / ``--min-cosine`` (as
    `AccuracyPolicy` fields; empty: the default bound)."""
    got = {"max_rel_error": getattr(args, "max_grad_error", None),
           "min_cosine": getattr(args, "min_cosine", None)}
    return {k: v for k, v in got.items() if v is not None}


def _check_mgrit_flags(args: argparse.Namespace) -> None:
    """The MGRIT flags' ranges (the command line's alone: in Python they arrive as an
    `MGRITOptions`, which checks itself), up to what the engine holds in C ints."""
    for flag, value, lo, hi in (("--levels", args.levels, 1, MAX_LEVELS),
                                ("--cfactor", args.cfactor, 2, ENGINE_INT_MAX),
                                ("--fwd-iters", args.fwd_iters, 1, ENGINE_INT_MAX),
                                ("--bwd-iters", args.bwd_iters, 1, ENGINE_INT_MAX),
                                ("--nrelax", args.nrelax, 0, ENGINE_INT_MAX)):
        if value < lo:
            raise ValueError(f"`{flag}` must be >= {lo}, got {value}")
        if value > hi:
            raise ValueError(f"`{flag}` must be <= {hi}, got {value}")
    if not (math.isfinite(args.tol) and args.tol >= 0):
        raise ValueError(f"`--tol` must be a finite number >= 0, got {args.tol}")

