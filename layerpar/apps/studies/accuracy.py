"""The ``accuracy`` study: how wrong is an inexact layer-parallel gradient?

    python -m layerpar.studies accuracy --out docs/results/accuracy
    python -m layerpar.studies accuracy --quick --out /tmp/acc      # seconds

Training runs the forward and adjoint MGRIT solves with a few iterations, so the
gradient the optimizer gets is not the network's gradient.  For the Peaks net and the
digits conv net exactly as `layerpar.apps.train` builds them (`layerpar.apps.nets.problem_net`,
`load_data`), at initialisation and after a little serial training, this measures with
`LayerParallel.check_gradients` the relative error and the cosine of the inexact
parameter gradient against the exact one, over forward iterations, backward
iterations, levels and coarsening factors.  One rank and float64 (so that the numbers
are the solver's error, not round-off): MGRIT results do not depend on the number of
ranks (`tests/test_accuracy.py` checks the reported numbers at 2 and 3 ranks against
1 rank to 1e-10).

Writes ``accuracy.csv`` (one row per setting), ``accuracy.png`` and ``README.md`` (the
command, the criterion and the tables) into ``--out``.  Files there that this study did
not write are never replaced: the run stops first with one line naming the file and
exit status 2; its own files (recognised by their header or marker) are rewritten
whole, each atomically (`files.write_text`).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ...defaults import MAX_REL_ERROR, MIN_COSINE
from ..parsing import OneLineParser

__all__ = ["CRITERION", "add_arguments", "add_parser", "build_parser", "main", "run",
           "run_accuracy_study"]

#: "accurate enough": the inexact gradient points where the exact one does and is
#: within 5% of it
CRITERION = {"min_cosine": MIN_COSINE, "max_rel_error": MAX_REL_ERROR}

STATES = ("init", "trained")
_NORMAL = {"models": "peaks,digits", "states": "init,trained", "fwd_iters": "1,2,3",
           "bwd_iters": "1,2", "levels": "2,3,4", "cfactor": "2,4,8", "batch": None,
           "train_epochs": 1}
_QUICK = {**_NORMAL, "models": "peaks", "states": "init", "fwd_iters": "1,2",
          "bwd_iters": "1", "levels": "2", "cfactor": "4", "batch": 20}
COLUMNS = ("model", "state", "val_acc", "layers", "batch", "levels", "levels_used", "cfactor",
           "fwd_iters", "bwd_iters", "param_grad_error", "cosine", "input_grad_error",
           "output_error", "loss_error", "segment_grad_errors", "fwd_residual",
           "bwd_residual", "accurate")
CSV_NAME, PLOT_NAME, README_NAME = "accuracy.csv", "accuracy.png", "README.md"
MARKER = "<!-- written by `python -m layerpar.studies accuracy`; rewritten on each run -->"
PNG_MARKER = "layerpar accuracy study"
COMMAND = "python -m layerpar.studies accuracy --out docs/results/accuracy"
#: (levels, cfactor, forward, backward iterations) that `layerpar train` uses
TRAINING_DEFAULT = (3, 4, 2, 1)


@dataclass(frozen=True)
class Settings:
    """What one study measures (validated by `settings_from_args`)."""

    models: tuple[str, ...]
    states: tuple[str, ...]
    fwd_iters: tuple[int, ...]
    bwd_iters: tuple[int, ...]
    levels: tuple[int, ...]
    cfactor: tuple[int, ...]
    batch: Optional[int]  # None: the problem's training batch size
    train_epochs: int
    seed: int
    threads: int = 1  # torch threads: the tensors are tiny, more threads only contend


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The study's options (defaults resolved in `settings_from_args`, so --quick can
    change them)."""
    g = p.add_argument_group("grid (comma-separated lists)")
    g.add_argument("--models", help=f"bundled problems: peaks, digits, mnist1d (default "
                                    f"{_NORMAL['models']})")
    g.add_argument("--states", help="parameters: init (as built) and/or trained (after "
                                    f"--train-epochs of serial training; default "
                                    f"{_NORMAL['states']})")
    g.add_argument("--fwd-iters", dest="fwd_iters",
                   help=f"forward MGRIT iterations (default {_NORMAL['fwd_iters']})")
    g.add_argument("--bwd-iters", dest="bwd_iters",
                   help=f"adjoint MGRIT iterations (default {_NORMAL['bwd_iters']})")
    g.add_argument("--levels", help=f"MGRIT levels at most (default {_NORMAL['levels']})")
    g.add_argument("--cfactor", help=f"coarsening factor (default {_NORMAL['cfactor']})")
    p.add_argument("--batch", type=int, help="batch size of the measured batch (default: "
                                             "the problem's training batch size)")
    p.add_argument("--train-epochs", dest="train_epochs", type=int,
                   help="epochs of serial training for the `trained` state (default 1)")
    p.add_argument("--seed", type=int, default=0, help="data and parameter seed (0)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: the tensors are small)")
    p.add_argument("--out", default="accuracy", help="output folder (default ./accuracy)")
    p.add_argument("--quick", action="store_true", help="a tiny smoke-test study")
    p.add_argument("--no-plots", dest="plots", action="store_false", help="skip the PNG")
    p.set_defaults(_prog=p.prog)
    return p


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``accuracy`` subcommand to an argparse subparsers object."""
    p = subparsers.add_parser(
        "accuracy", help="gradient accuracy of inexact MGRIT vs iterations and levels",
        description=__doc__.split("\n\n")[1] if __doc__ else None)
    return add_arguments(p)


def build_parser() -> argparse.ArgumentParser:
    """Stand-alone parser of ``python -m layerpar.studies accuracy``."""
    return add_arguments(OneLineParser(
        prog="python -m layerpar.studies accuracy",
        description="Relative error and cosine of inexact layer-parallel gradients against "
                    "exact ones (Peaks and digits nets), written to CSV, a plot and a "
                    "README."))


def _ints(name: str, text: Any, lo: int, hi: int) -> tuple[int, ...]:
    flag = f"--{name.replace('_', '-')}"
    items = [s.strip() for s in str(text).split(",") if s.strip()]
    if not items:
        raise ValueError(f"`{flag}` needs at least one value")
    try:
        values = tuple(int(s) for s in items)
    except ValueError:
        raise ValueError(f"`{flag}` takes comma-separated integers, got {text!r}") from None
    for v in values:
        if not lo <= v <= hi:
            raise ValueError(f"`{flag}` values must be in [{lo}, {hi}], got {v}")
    return values


def _names(name: str, text: Any, allowed: Sequence[str]) -> tuple[str, ...]:
    items = tuple(s.strip() for s in str(text).split(",") if s.strip())
    bad = [s for s in items if s not in allowed]
    if not items or bad:
        raise ValueError(f"`--{name}` takes a comma-separated subset of {list(allowed)}, "
                         f"got {text!r}")
    return items


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The `Settings` the options describe; ValueError naming the option otherwise."""
    from ...mgrit.options import ENGINE_INT_MAX, MAX_LEVELS
    from ...ode.rng import MAX_SEED
    from ..nets import PROBLEMS

    base = _QUICK if getattr(args, "quick", False) else _NORMAL

    def pick(k: str) -> Any:
        v = getattr(args, k, None)
        return base[k] if v is None else v

    batch = pick("batch")
    if batch is not None and not 1 <= int(batch) <= 1500:
        raise ValueError(f"`--batch` must be in [1, 1500] (every model's training set holds "
                         f"a batch: digits', the smallest, has 1500 samples), got {batch}")
    epochs = int(pick("train_epochs"))
    if epochs < 1:
        raise ValueError(f"`--train-epochs` must be >= 1, got {epochs}")
    seed = args.seed
    if args.threads < 1:
        raise ValueError(f"`--threads` must be >= 1, got {args.threads}")
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"`--seed` must be in [0, 2**64 - 1], got {seed}")
    return Settings(models=_names("models", pick("models"), PROBLEMS),
                    states=_names("states", pick("states"), STATES),
                    fwd_iters=_ints("fwd_iters", pick("fwd_iters"), 1, ENGINE_INT_MAX),
                    bwd_iters=_ints("bwd_iters", pick("bwd_iters"), 1, ENGINE_INT_MAX),
                    levels=_ints("levels", pick("levels"), 1, MAX_LEVELS),
                    cfactor=_ints("cfactor", pick("cfactor"), 2, ENGINE_INT_MAX),
                    batch=None if batch is None else int(batch), train_epochs=epochs,
                    seed=int(seed), threads=int(args.threads))


def check_outputs(out: Path, plots: bool) -> None:
    """Refuse (`StudyFileError`) before any measurement when ``--out`` cannot be used or
    holds a file of our names that this study did not write."""
    from .files import check_output_dir, first_line, refuse_foreign

    check_output_dir(out, "--out", (CSV_NAME, PLOT_NAME, README_NAME))
    header = ",".join(COLUMNS)
    owned = {CSV_NAME: lambda b: first_line(b) == header,
             README_NAME: lambda b: first_line(b) == MARKER}
    if plots:
        owned[PLOT_NAME] = lambda b: PNG_MARKER.encode() in b
    refuse_foreign(out, owned, "this study")


def _state_net(model_name: str, state: str, s: Settings) -> tuple[Any, Optional[float]]:
    """The net of `model_name` in float64: as built (init), or after `train_epochs` of
    serial training with the problem's recipe (trained); and its validation accuracy
    (trained only)."""
    import torch

    from ..nets import problem_net
    from ..train import train

    if state == "init":
        torch.manual_seed(s.seed)
        return problem_net(model_name).double(), None
    with contextlib.redirect_stdout(io.StringIO()):  # train() prints its summary line
        res = train(model_name, serial=True, epochs=s.train_epochs, seed=s.seed,
                    progress=False, dtype=torch.float64)
    return res.module, float(res.val_acc)


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return ";".join(repr(float(e)) for e in v)
    return str(v)


def run_accuracy_study(s: Settings, log: Any = None) -> list[dict[str, Any]]:
    """Measure every setting of `s` on one rank; one dict per setting (`COLUMNS`)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(s.threads)
    try:
        return _measure(s, log)
    finally:
        torch.set_num_threads(threads)


def _measure(s: Settings, log: Any) -> list[dict[str, Any]]:
    import torch
    from torch.nn import functional as F

    from ...mgrit.grid import build_levels
    from ...mgrit.options import MGRITOptions
    from ...parallel import LayerParallel
    from ..nets import RECIPES
    from ..train import load_data

    rows: list[dict[str, Any]] = []
    for model_name in s.models:
        x_train, y_train, _, _ = load_data(model_name, s.seed, torch.float64)
        batch = s.batch or RECIPES[model_name].batch_size
        if batch > len(x_train):
            raise ValueError(f"`--batch` {batch} exceeds the {len(x_train)} training "
                             f"samples of {model_name}")
        x, y = x_train[:batch], y_train[:batch]
        for state in s.states:
            t0 = time.perf_counter()
            net, val_acc = _state_net(model_name, state, s)
            n = net.segments[0][1].n_steps
            for levels in s.levels:
                for cf in s.cfactor:
                    used = len(build_levels(n, MGRITOptions(max_levels=levels, cfactor=cf)))
                    for fi in s.fwd_iters:
                        for bi in s.bwd_iters:
                            fwd = MGRITOptions(max_levels=levels, cfactor=cf, max_iter=fi,
                                               tol=0.0)
                            bwd = fwd.replace(max_iter=bi)
                            model = LayerParallel(net, None, fwd, bwd)
                            try:
                                c = model.check_gradients(x, y, F.cross_entropy)
                            finally:
                                model.close()
                            ok = (c.cosine >= CRITERION["min_cosine"]
                                  and c.param_grad_error <= CRITERION["max_rel_error"])
                            rows.append({
                                "model": model_name, "state": state, "val_acc": val_acc,
                                "layers": n, "batch": batch, "levels": levels,
                                "levels_used": used, "cfactor": cf, "fwd_iters": fi,
                                "bwd_iters": bi, "param_grad_error": c.param_grad_error,
                                "cosine": c.cosine, "input_grad_error": c.input_grad_error,
                                "output_error": c.output_error, "loss_error": c.loss_error,
                                "segment_grad_errors": list(c.segment_grad_errors),
                                "fwd_residual": c.fwd_residuals[0],
                                "bwd_residual": c.bwd_residuals[0], "accurate": ok})
            if log is not None:
                done = sum(1 for r in rows if (r["model"], r["state"]) == (model_name, state))
                log.write(f"{model_name} {state}: {done} settings in "
                          f"{time.perf_counter() - t0:.1f} s\n")
    return rows


def to_csv(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as CSV text (header `COLUMNS`; lists joined by ';', None empty)."""
    lines = [",".join(COLUMNS)]
    lines += [",".join(_fmt(r[c]) for c in COLUMNS) for r in rows]
    return "\n".join(lines) + "\n"


def _cell(r: dict[str, Any]) -> str:
    mark = "✓" if r["accurate"] else "✗"
    return f"{r['param_grad_error']:.2g} / {r['cosine']:.3f} {mark}"


def to_readme(rows: Sequence[dict[str, Any]], s: Settings, seconds: float) -> str:
    """The README: command, what was measured, the criterion, a summary table and one
    table per model and state."""
    pairs = [(f, b) for f in s.fwd_iters for b in s.bwd_iters]
    grids = [(lv, cf) for lv in s.levels for cf in s.cfactor]
    default = s == settings_from_args(build_parser().parse_args([]))
    command = COMMAND if default else f"{COMMAND}  # with other settings: see below"
    batches = ", ".join(f"{m} {next(r['batch'] for r in rows if r['model'] == m)}"
                        for m in s.models)
    cos, rel = CRITERION["min_cosine"], 100 * CRITERION["max_rel_error"]
    head = " | ".join(f"fwd {f} / bwd {b}" for f, b in pairs)
    rule = "|" + "---|" * (2 + len(pairs))
    lv0, cf0, f0, b0 = TRAINING_DEFAULT
    default_label = f" (L{lv0} cf{cf0}, fwd {f0} / bwd {b0}: error / cosine)"
    lines = [
        MARKER, "", "# Gradient accuracy of inexact layer-parallel training", "",
        f"Made by (about {seconds:.0f} s on this machine, one process, {s.threads} "
        f"torch thread(s)):", "",
        "```bash", command, "```", "",
        "For the Peaks net (32 layers, width 8) and the digits conv net (8 layers, 8 "
        "channels) exactly as `layerpar.apps.train.build_net` builds them, one batch (the "
        f"first training samples: {batches}) is run with `LayerParallel.check_gradients`: "
        "once with inexact MGRIT (the forward and backward iteration counts, levels and "
        "coarsening factor below; `tol=0`, so exactly that many iterations) and once "
        "exactly (sequential solves). The relative error is ‖g − g_exact‖ / ‖g_exact‖ of "
        "the full parameter gradient (all layers); the cosine is between g and g_exact.",
        "",
        f"- Parameters: `init` = as built after `torch.manual_seed({s.seed})`; `trained` = "
        f"after {s.train_epochs} epoch(s) of serial (exact) training with the problem's "
        "recipe (`layerpar.apps.train.train(..., serial=True)`: Adam, cosine schedule).",
        f"- Settings: levels {list(s.levels)}, cfactor {list(s.cfactor)}, forward "
        f"iterations {list(s.fwd_iters)}, backward iterations {list(s.bwd_iters)}.",
        "- float64 and one rank. The numbers do not depend on the number of ranks: "
        "`tests/test_accuracy.py` checks that 2 and 3 ranks report the 1-rank numbers to "
        "1e-10.",
        "- `levels_used` in the CSV is the number of levels the grid allows: digits has 8 "
        "layers, so with cfactor 8 there is no coarse level (sequential, exact), and with "
        "cfactor 4 at most 2 levels.",
        f"- Accurate enough (✓): cosine ≥ {cos:g} and relative error ≤ {rel:g}%. Cells of "
        "the detailed tables: relative error / cosine.", "",
        f"## Summary: settings (levels × cfactor) accurate enough, out of {len(grids)}", "",
        f"| model | parameters | {head} | training default{default_label} |",
        rule + "---|"]
    by = {(r["model"], r["state"], r["levels"], r["cfactor"], r["fwd_iters"],
           r["bwd_iters"]): r for r in rows}
    for m in s.models:
        for st in s.states:
            first = next(r for r in rows if r["model"] == m and r["state"] == st)
            label = st if first["val_acc"] is None else \
                f"{st} (val_acc {first['val_acc']:.2f})"
            cells = [str(sum(by[(m, st, lv, cf, f, b)]["accurate"] for lv, cf in grids))
                     for f, b in pairs]
            d = by.get((m, st, *TRAINING_DEFAULT))
            cells.append("not measured" if d is None else _cell(d))
            lines.append(f"| {m} | {label} | " + " | ".join(cells) + " |")
    for m in s.models:
        for st in s.states:
            lines += ["", f"## {m}, {st}", "", f"| levels | cfactor | {head} |", rule]
            for lv, cf in grids:
                used = by[(m, st, lv, cf, *pairs[0])]["levels_used"]
                lvtext = str(lv) if used == lv else f"{lv} ({used} used)"
                lines.append(f"| {lvtext} | {cf} | " + " | ".join(
                    _cell(by[(m, st, lv, cf, f, b)]) for f, b in pairs) + " |")
    lines += ["", f"All numbers: `{CSV_NAME}`; plot: `{PLOT_NAME}` (relative error of the "
              "parameter gradient per setting; the dotted line is the 5% criterion).", ""]
    return "\n".join(lines)


def plot(rows: Sequence[dict[str, Any]], s: Settings, path: Path) -> Path:
    """Relative gradient error per (levels, cfactor), one line per iteration pair, one
    panel per model and parameter state."""
    from .files import write_bytes
    from .plots import _plt

    plt = _plt()
    grids = [(lv, cf) for lv in s.levels for cf in s.cfactor]
    pairs = [(f, b) for f in s.fwd_iters for b in s.bwd_iters]
    fig, axes = plt.subplots(len(s.models), len(s.states), squeeze=False, sharey=True,
                             figsize=(4.8 * len(s.states) + 1.5, 3.4 * len(s.models) + 0.6))
    floor = 1e-5  # exact settings (no coarse level, or converged) drawn here
    for i, m in enumerate(s.models):
        for j, st in enumerate(s.states):
            ax = axes[i][j]
            for f, b in pairs:
                ys = [max(floor, next(r["param_grad_error"] for r in rows
                                      if (r["model"], r["state"], r["levels"], r["cfactor"],
                                          r["fwd_iters"], r["bwd_iters"]) == (m, st, lv, cf,
                                                                              f, b)))
                      for lv, cf in grids]
                ax.plot(range(len(grids)), ys, marker="o", ms=3,
                        ls="-" if b == s.bwd_iters[0] else "--", label=f"fwd {f} / bwd {b}")
            ax.axhline(CRITERION["max_rel_error"], color="k", ls=":", lw=1)
            ax.set_yscale("log")
            ax.set_xticks(range(len(grids)))
            ax.set_xticklabels([f"L{lv}\ncf{cf}" for lv, cf in grids], fontsize=7)
            ax.set_title(f"{m}, {st}", fontsize=10)
            if j == 0:
                ax.set_ylabel("rel. error of the parameter gradient")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.suptitle("Inexact vs exact parameter gradient, one batch (dotted: 5%; errors "
                 "below 1e-5, i.e. exact solves, drawn at 1e-5)", fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, dpi=110, format="png", metadata={"Software": PNG_MARKER})
    plt.close(fig)
    write_bytes(path, buf.getvalue())
    return path


def _error(args: argparse.Namespace, message: str) -> int:
    sys.stderr.write(f"{getattr(args, '_prog', 'python -m layerpar.studies accuracy')}: "
                     f"error: {message}\n")
    return 2


def run(args: argparse.Namespace) -> int:
    """Run the study the parsed options describe; write its files; print a summary.

    Bad options and an unusable ``--out`` (or a file there this study did not write)
    are one line on stderr and exit status 2, before anything is measured.
    """
    from .files import write_text

    out = Path(args.out)
    try:
        s = settings_from_args(args)
        check_outputs(out, bool(args.plots))
    except ValueError as exc:  # StudyFileError is one
        return _error(args, str(exc))
    t0 = time.perf_counter()
    try:
        rows = run_accuracy_study(s, log=sys.stdout)
    except ValueError as exc:
        return _error(args, str(exc))
    seconds = time.perf_counter() - t0
    written = [out / CSV_NAME]
    write_text(out / CSV_NAME, to_csv(rows))
    if args.plots:
        written.append(plot(rows, s, out / PLOT_NAME))
    write_text(out / README_NAME, to_readme(rows, s, seconds))
    written.append(out / README_NAME)
    good = sum(r["accurate"] for r in rows)
    print(f"{good} of {len(rows)} settings accurate enough (cosine >= "
          f"{CRITERION['min_cosine']}, relative error <= {CRITERION['max_rel_error']}) in "
          f"{seconds:.1f} s")
    for p in written:
        print(f"wrote {p}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m layerpar.studies accuracy [options]``."""
    return run(build_parser().parse_args(argv))
