"""Scaling studies: a grid of layer-parallel runs, the serial baseline, CSV, model, plots.

`run_study(grid, out_csv)` expands `grid` (ranks × levels × cfactor × layers ×
fwd_iters × bwd_iters × threads × model × width × batch; strong scaling keeps the
layers fixed, weak scaling (``"weak": True``) runs ``layers × ranks`` layers), and:

0. checks, before any measurement, every grid value, the output folders, and the files
   a resume reads (`out_csv`, the worker logs, the ping-pong cache): a damaged file
   raises `StudyFileError` naming the file and line and is left as it was;
1. skips the runs whose settings are already rows of `out_csv` (resume);
2. measures, in this process, the serial baseline of every model size
   (`worker.serial_baseline`: plain PyTorch, best thread count) and the per-step
   costs the performance model needs (`perfmodel.measure_costs`);
3. measures message latency and bandwidth with a two-rank ping-pong under mpiexec;
4. launches ``mpiexec -n P python -m mpi4py -m layerpar.apps.studies.worker`` once per
   rank count (the mpiexec beside ``sys.executable``, else the one on PATH), under a
   timeout that kills the job's process group and every process below it (as do
   Ctrl-C and SIGTERM here, `launch.run_job`), and adds one CSV row per finished run
   (each file a study writes is replaced whole, `files`: a row is complete or absent);
5. fits the model's three constants on the runs of every depth but the deepest,
   predicts every row (``predicted_seconds_per_batch``, ``model_role`` fit / validate), rewrites the
   CSV, writes ``model.json`` and the plots.
"""
from __future__ import annotations

import csv
import io
import itertools
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional, TextIO, Union

from ..._checks import fits_in_memory
from ...mgrit.options import ENGINE_INT_MAX, MAX_LEVELS, MAX_STEPS
from ...ode.rng import MAX_SEED
from ..launch import job_command, load_average, mpiexec_path, run_job
from ..loop import Progress, available_cores
from . import perfmodel
from .files import StudyFileError, check_output_dir, read_jsonl, write_text
from .runs import DEFAULTS, SYNTHETIC_MODELS, config
from .worker import serial_baseline

__all__ = ["COLUMNS", "KEY_COLUMNS", "REQUIRED_COLUMNS", "StudyFileError", "StudyResult",
           "check_output_dir", "expand_grid", "mpiexec_path", "read_rows", "run_study"]

REQUIRED_COLUMNS = [
    "ranks", "threads", "layers", "width", "batch", "levels", "cfactor", "fwd_iters",
    "bwd_iters", "seconds_per_batch", "forward_seconds", "backward_seconds",
    "comm_idle_seconds", "serial_seconds_per_batch", "serial_threads", "speedup",
    "efficiency", "fwd_residual", "bwd_residual", "loss", "serial_loss", "loss_rel_diff",
    "predicted_seconds_per_batch",
]
EXTRA_COLUMNS = [
    "model", "scaling", "nrelax", "steps", "warmup", "lr", "seed", "t_final", "image",
    "classes", "fwd_iterations", "bwd_iterations", "fwd_comm_idle_seconds",
    "bwd_comm_idle_seconds", "serial_variant", "fwd_batched", "bwd_batched", "fwd_seq", "bwd_seq",
    "predicted_forward_seconds", "predicted_backward_seconds",
    "predicted_comm_idle_seconds", "model_role", "model_rel_error",
    *perfmodel.COST_COLUMNS.values(), "call_overhead_s", "step_overhead_s", "batch_overhead_s",
    "oversubscribed", "cores", "load_avg", "fwd_residual_history", "bwd_residual_history",
]
COLUMNS = REQUIRED_COLUMNS + EXTRA_COLUMNS
# the settings that identify a run (resume skips rows whose key is already in the CSV)
KEY_COLUMNS = ["model", "ranks", "threads", "layers", "width", "batch", "image", "classes",
               "levels", "cfactor", "nrelax", "fwd_iters", "bwd_iters", "steps", "warmup",
               "lr", "seed", "t_final"]
_SERIAL_KEY = ["model", "layers", "width", "batch", "image", "classes", "steps", "warmup",
               "lr", "seed", "t_final"]
_COST_KEY = ["model", "layers", "width", "batch", "image", "classes", "t_final", "threads"]
_GRID_LISTS = ["ranks", "threads", "layers", "levels", "cfactor", "fwd_iters", "bwd_iters",
               "model", "width", "batch"]


# ------------------------------------------------------------------------------------------
# grid and CSV
# ------------------------------------------------------------------------------------------
def _as_list(v: Any) -> list:
    return list(v) if isinstance(v, (list, tuple)) else [v]


# whole-number settings: (lowest, highest or None); the highest are what the engine holds
# in a C int (MGRIT counts), its level limit, or a torch seed
_INT_BOUNDS: dict[str, tuple[int, Optional[int]]] = {
    "ranks": (1, None), "threads": (1, None), "layers": (1, MAX_STEPS), "width": (1, None),
    "batch": (1, None), "image": (1, None), "classes": (1, None),
    "levels": (1, MAX_LEVELS), "cfactor": (2, ENGINE_INT_MAX), "nrelax": (0, ENGINE_INT_MAX),
    "fwd_iters": (1, ENGINE_INT_MAX), "bwd_iters": (1, ENGINE_INT_MAX),
    "diag_iters": (0, ENGINE_INT_MAX), "steps": (1, None), "warmup": (0, None),
    "seed": (0, MAX_SEED),
}
_POSITIVE_FLOATS = ("lr", "t_final")


def _name(key: str, flags: bool) -> str:
    """How a setting is called in messages: the grid key, or the command-line flag."""
    return f"`--{key.replace('_', '-')}`" if flags else f"`{key}`"


def _check_run(cfg: dict[str, Any], flags: bool) -> None:
    """Raise ValueError naming the setting of `cfg` that no run could use."""
    for k, (lo, hi) in _INT_BOUNDS.items():
        v = cfg[k]
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{_name(k, flags)} must be a whole number, got {v!r}")
        if v < lo or (hi is not None and v > hi):
            rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
            raise ValueError(f"{_name(k, flags)} must be {rng}, got {v}")
    for k in _POSITIVE_FLOATS:
        v = cfg[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (
                math.isfinite(v) and v > 0):
            raise ValueError(f"{_name(k, flags)} must be a finite number > 0, got {v!r}")
    _check_memory(cfg, flags)


def _check_memory(cfg: dict[str, Any], flags: bool) -> None:
    """Refuse a run whose net (parameters, gradients, optimizer state) and one batch's
    recorded states alone would not fit in this machine's memory: one line naming the
    settings, not an allocator's traceback minutes in (`--width 2147483648` was)."""
    w, n, b = cfg["width"], cfg["layers"], cfg["batch"]
    conv = cfg.get("model") == "conv"
    pixels = cfg["image"] ** 2 if conv else 1
    per_layer = w * w * (9 if conv else 1) + w
    need = n * (per_layer * 4 * 4 + 2048) + b * w * pixels * 4 * (n + 2) * 2
    fits_in_memory(need, f"{_name('layers', flags)} {n} x {_name('width', flags)} {w} "
                   f"(batch {b}): a run", "the net, its gradients and optimizer state, a "
                   "batch's states")


def expand_grid(grid: dict[str, Any], *, flags: bool = False) -> list[dict[str, Any]]:
    """One run config per combination of the grid's lists (see `_GRID_LISTS`).

    Scalars are used as they are; ``weak=True`` multiplies the layers by the ranks.
    Runs with more ranks than layers are dropped (a grid may mix depths), and with
    ``max_cores=C`` those with ranks × threads > C (to scan the ranks × threads splits
    of a machine).  Every value is checked before anything runs (ValueError naming
    it: the grid key, or with `flags` the ``layerpar scale`` option): unknown keys,
    values out of range or beyond what the engine holds, a rank count larger than
    every layer count, and a grid left with no run at all.
    """
    known = set(DEFAULTS) | {"ranks", "weak", "max_cores"}
    unknown = set(grid) - known
    if unknown:
        raise ValueError(f"unknown grid key(s) {sorted(unknown)}; valid: {sorted(known)}")
    weak = bool(grid.get("weak", False))
    max_cores = grid.get("max_cores")
    if max_cores is not None and (isinstance(max_cores, bool) or not isinstance(
            max_cores, int) or max_cores < 1):
        raise ValueError(f"{_name('max_cores', flags)} must be a whole number >= 1, got "
                         f"{max_cores!r}")
    lists = {k: _as_list(grid[k]) for k in _GRID_LISTS if k in grid}
    lists.setdefault("ranks", [1])
    scalars = {k: v for k, v in grid.items()
               if k not in lists and k not in ("weak", "max_cores")}
    for k, v in scalars.items():
        if isinstance(v, (list, tuple)):
            raise ValueError(f"grid key `{k}` takes one value, got {v!r}")
    for k, vs in lists.items():
        if not vs:
            raise ValueError(f"{_name(k, flags)} needs at least one value")
    keys = list(lists)
    runs = []
    for combo in itertools.product(*(lists[k] for k in keys)):
        run = {**scalars, **dict(zip(keys, combo))}
        try:
            cfg = config(run)
        except ValueError as exc:  # an unknown model
            raise ValueError(str(exc).replace("`model`", _name("model", flags))) from None
        _check_run(cfg, flags)
        if weak:
            cfg["layers"] = cfg["layers"] * cfg["ranks"]
            _check_run(cfg, flags)
        cfg["scaling"] = "weak" if weak else "strong"
        if cfg["ranks"] > cfg["layers"]:
            continue
        if max_cores is not None and cfg["ranks"] * cfg["threads"] > max_cores:
            continue
        runs.append(cfg)
    layers = lists.get("layers", [DEFAULTS["layers"]])
    if not weak and max(lists["ranks"]) > max(layers):
        raise ValueError(f"{_name('ranks', flags)} {max(lists['ranks'])} is more than every "
                         f"layer count ({', '.join(map(str, layers))}): each rank needs at "
                         f"least one layer")
    if not runs:
        raise ValueError(f"the grid has no run: every combination has more ranks than "
                         f"layers or ranks x threads above {_name('max_cores', flags)}")
    return runs


def _canon(v: Any) -> str:
    """A canonical text for a setting, so 4, "4" and 4.0 compare equal (whole numbers
    exactly, also beyond float precision: seeds run up to 2**64 - 1)."""
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str) and v.strip().lstrip("+-").isdigit():
        return str(int(v))
    try:
        f = float(v)
    except (TypeError, ValueError):
        return str(v)
    return str(int(f)) if f.is_integer() else repr(f)


def _key(d: dict[str, Any], cols: Sequence[str]) -> tuple:
    return tuple(_canon(d.get(c, DEFAULTS.get(c, ""))) for c in cols)


_JSONL_RECOVERY = ("A worker log only records the runs a job finished (results.csv holds the "
                   "study's rows): delete that line, or the file, and run again")
_CSV_RECOVERY = ("Nothing was changed.  Restore the file from a backup, or delete or repair "
                 "that line (a deleted run is measured again on the next resume), or move "
                 "the file away to start the study afresh")
# settings that are whole numbers (the others in KEY_COLUMNS: model, lr, t_final)
_INT_KEYS = [c for c in KEY_COLUMNS if c not in ("model", "lr", "t_final")]


def _bad(path: Path, line: int, problem: str) -> StudyFileError:
    return StudyFileError(f"{path}: line {line} {problem}.  {_CSV_RECOVERY}")


def _check_row(path: Path, line: int, header: list[str], fields: list[str]) -> None:
    """Raise `StudyFileError` unless `fields` is a well-formed row under `header`."""
    if len(fields) != len(header):
        raise _bad(path, line, f"has {len(fields)} fields, the header has {len(header)} (a "
                               f"row cut short or two rows run together)")
    row = dict(zip(header, fields))
    for c in KEY_COLUMNS:
        if c not in row:
            continue
        v = row[c]
        if c == "model":
            if v not in SYNTHETIC_MODELS:
                raise _bad(path, line, f"has `model` {v!r}, not one of {SYNTHETIC_MODELS}")
            continue
        try:
            f = float(v)
        except ValueError:
            raise _bad(path, line, f"has `{c}` {v!r}, not a number") from None
        if not math.isfinite(f) or (c in _INT_KEYS and (not f.is_integer() or f < 0)):
            kind = "a whole number >= 0" if c in _INT_KEYS else "a finite number"
            raise _bad(path, line, f"has `{c}` {v!r}, not {kind}")
    for c in REQUIRED_COLUMNS:  # measurements: a number, or empty where none was made
        if c in KEY_COLUMNS or row[c] == "":
            continue
        try:
            float(row[c])
        except ValueError:
            raise _bad(path, line, f"has `{c}` {row[c]!r}, not a number") from None


def read_rows(path: Union[str, Path]) -> list[dict[str, str]]:
    """The rows of a study CSV (empty if the file does not exist or is empty), checked.

    The file must end with a complete line, start with a header holding every
    `REQUIRED_COLUMNS` name, and every row must have the header's number of fields and
    numbers where settings and measurements are numbers.  Anything else raises
    `StudyFileError` naming the file and line, so a damaged file is never resumed
    from, and never rewritten.
    """
    p = Path(path)
    if not p.exists():
        return []
    if p.is_dir():
        raise StudyFileError(f"{p} is a folder, not a study CSV; move it away")
    data = p.read_bytes()
    if not data:
        return []
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise _bad(p, line, "is not UTF-8 text") from None
    if not text.endswith("\n"):
        raise _bad(p, text.count("\n") + 1, "is incomplete (it does not end with a newline: "
                                            "a write was interrupted)")
    reader = csv.reader(io.StringIO(text, newline=""))
    header = next(reader, [])
    missing = [c for c in REQUIRED_COLUMNS if c not in header]
    if missing:
        raise _bad(p, 1, f"is not a study header: it lacks the column(s) "
                         f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''} "
                         f"(the header line is missing or damaged)")
    dups = sorted({c for c in header if header.count(c) > 1})
    if dups:
        raise _bad(p, 1, f"names the column(s) {', '.join(dups)} more than once")
    rows = []
    for fields in reader:
        if not fields:  # a blank line holds no data
            continue
        _check_row(p, reader.line_num, header, fields)
        rows.append(dict(zip(header, fields)))
    return rows


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.6g}"
    if isinstance(v, (list, tuple)):
        return ";".join(f"{x:.4e}" for x in v)
    return str(v)


def _write_rows(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    """Rewrite the CSV atomically (`files.write_text`: temporary file, fsync, rename)."""
    buf = io.StringIO(newline="")
    w = csv.DictWriter(buf, fieldnames=COLUMNS, extrasaction="ignore")
    w.writeheader()
    for r in rows:
        w.writerow({c: _fmt(r.get(c)) if not isinstance(r.get(c), str) else r[c]
                    for c in COLUMNS})
    write_text(path, buf.getvalue())


def _append_row(path: Path, row: dict[str, Any]) -> None:
    """Add one finished run to the CSV so that it is complete or absent: the checked
    old rows and the new one are written whole to a temporary file and renamed (study
    CSVs are small; an append in place could leave half a row after a crash)."""
    _write_rows(path, read_rows(path) + [row])


# ------------------------------------------------------------------------------------------
# launching mpiexec
# ------------------------------------------------------------------------------------------
@dataclass
class _Job:
    returncode: Optional[int]
    stdout: str
    stderr: str
    timed_out: bool


def _launch(nprocs: int, module_args: Sequence[str], timeout: float, threads: int = 1,
            poll: Optional[Any] = None) -> _Job:
    """Run ``mpiexec -n nprocs python -m mpi4py -m <module_args>`` under `timeout`;
    `poll()` is called about every 0.2 s while it runs.  FileNotFoundError when no
    mpiexec is found (`launch.job_command`)."""
    # let this process's intra-op threads stop spinning after in-process measurements
    # (OpenMP workers busy-wait a while after parallel regions), so they do not take
    # cores from the job's ranks
    time.sleep(0.5)
    cmd = job_command(nprocs, ["-m", *module_args])
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads)
    if nprocs * threads > available_cores():  # oversubscribed: let idle ranks back off
        env.setdefault("MPIR_CVAR_CH4_PROGRESS_THROTTLE", "1")
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        # the job dies with this process: on a timeout, Ctrl-C, SIGTERM, or if this
        # process is killed outright (`launch.run_job`)
        st = run_job(cmd, env=env, timeout=timeout, stdout=out, stderr=err, poll=poll)
        out.seek(0)
        err.seek(0)
        return _Job(st.returncode, out.read(), err.read(), st.timed_out)


def _refuse_foreign(out_dir: Path, resumed: bool, plots: bool, ranks: set[int]) -> None:
    """Refuse (`StudyFileError`) before any measurement where `out_dir` holds a file of
    a name the study writes whole (the model's summary, each launch's run list, the
    plots) that the study did not write: a person's file is never replaced.  Plots
    without the marker (`plots.PNG_MARKER`; an older layerpar's plots lack it) are the
    study's where it resumes (`resumed`: its CSV, checked by `read_rows`, is there)."""
    from .files import refuse_foreign
    from .plots import PLOT_NAMES, PNG_MARKER

    owned: dict[str, Callable[[bytes], bool]] = {
        "model.json": lambda b: b'"call_overhead_s"' in b,
        **{f"worker-{r}.json": (lambda b: b'"runs"' in b and b'"out"' in b)
           for r in sorted(ranks)}}
    if plots:
        owned.update({name: (lambda b: resumed or PNG_MARKER.encode() in b)
                      for name in PLOT_NAMES})
    refuse_foreign(out_dir, owned, "this study")


def _read_pingpong(path: Path) -> Optional[dict[str, Any]]:
    """The cached ping-pong fit in `path` (None if there is none); `StudyFileError` if
    the file cannot be read, so a damaged cache is refused before any measurement."""
    if not path.exists():
        return None
    try:
        obj = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise StudyFileError(f"{path}: cannot be read ({exc}); nothing was changed.  It "
                             f"caches the message costs: delete it to measure them again"
                             ) from None
    if not isinstance(obj, dict):
        raise StudyFileError(f"{path}: is not a JSON object; nothing was changed.  It "
                             f"caches the message costs: delete it to measure them again")
    return obj


def run_pingpong(path: Path, quick: bool = False, timeout: float = 120) -> dict[str, Any]:
    """Ping-pong on two ranks (cached in `path`); {} when it cannot run."""
    cached = _read_pingpong(path)
    if cached is not None:
        return cached
    args = ["layerpar.apps.studies.pingpong", "--out", str(path)] + (["--quick"] if quick else [])
    job = _launch(2, args, timeout)
    if job.returncode != 0 or not path.exists():
        sys.stderr.write(f"pingpong failed (exit {job.returncode}, timed out "
                         f"{job.timed_out}): {job.stderr[-2000:]}\n")
        return {}
    return _read_pingpong(path) or {}


# ------------------------------------------------------------------------------------------
# the study
# ------------------------------------------------------------------------------------------
@dataclass
class StudyResult:
    """What `run_study` did: all rows of the CSV (new and resumed), the model fit,
    the files written, and how many runs were launched / skipped / failed."""

    rows: list[dict[str, Any]]
    fit: perfmodel.Fit
    csv_path: Path
    files: list[Path] = field(default_factory=list)
    launched: int = 0
    skipped: int = 0
    failed: list[str] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)


def _num(row: dict[str, Any], col: str) -> float:
    try:
        return float(row[col])
    except (KeyError, TypeError, ValueError):
        return float("nan")


def fastest_per_ranks(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The fastest run (least ``seconds_per_batch``) of each problem (layers, width,
    batch, model) at each rank count, ordered by problem and ranks: what a scan over
    MGRIT structures (levels, cfactor), iterations and threads per rank says the rank
    count reaches per batch, since the best structure changes with the ranks (the
    coarsest grid is solved sequentially across them).  Runs without a finite time
    (failed or still to run) are left out."""
    problems: dict[tuple, int] = {}  # (in the order the rows first name them)
    best: dict[tuple, dict[str, Any]] = {}
    for row in rows:
        t = _num(row, "seconds_per_batch")
        if not (math.isfinite(t) and t > 0):
            continue
        problem = _key(row, ("model", "layers", "width", "batch"))
        at = (problems.setdefault(problem, len(problems)), int(_num(row, "ranks")))
        if at not in best or t < _num(best[at], "seconds_per_batch"):
            best[at] = row
    return [best[at] for at in sorted(best)]


def _finish_row(raw: dict[str, Any], serial: dict[str, Any], costs: perfmodel.Costs,
                cores: int) -> dict[str, Any]:
    row = dict(raw)
    row.update(serial)
    row.update(perfmodel.costs_to_row(costs))
    sp = row["serial_seconds_per_batch"] / row["seconds_per_batch"]
    row["speedup"] = sp
    row["efficiency"] = sp / (int(row["ranks"]) * int(row["threads"]))
    ls, ll = float(row["serial_loss"]), float(row["loss"])
    row["loss_rel_diff"] = abs(ll - ls) / abs(ls) if ls != 0 else float("nan")
    row["oversubscribed"] = int(row["ranks"]) * int(row["threads"]) > cores
    row["cores"] = cores
    row.setdefault("load_avg", load_average()[0])  # the worker's, taken right after the run
    return row


def _apply_model(rows: list[dict[str, Any]]) -> tuple[perfmodel.Fit, dict[str, Any]]:
    """Fit on every depth but the deepest, validate on the deepest (one depth: fit on
    all); predict all rows (in place)."""
    usable = [r for r in rows if math.isfinite(_num(r, "seconds_per_batch"))]
    if not usable:
        return perfmodel.NO_FIT, {}
    deepest = max(int(_num(r, "layers")) for r in usable)
    fit_rows = [r for r in usable if int(_num(r, "layers")) < deepest] or usable
    f = perfmodel.fit(fit_rows)
    fit_ids = {id(r) for r in fit_rows}
    table = []
    for r in rows:
        p = perfmodel.predict_row(r, f)
        m = _num(r, "seconds_per_batch")
        role = "fit" if id(r) in fit_ids else "validate"
        err = (p.seconds_per_batch - m) / m
        r.update({"predicted_seconds_per_batch": p.seconds_per_batch,
                  "predicted_forward_seconds": p.forward_seconds,
                  "predicted_backward_seconds": p.backward_seconds,
                  "predicted_comm_idle_seconds": p.comm_idle_seconds,
                  "model_role": role, "model_rel_error": err,
                  "call_overhead_s": f.call_overhead, "step_overhead_s": f.step_overhead,
                  "batch_overhead_s": f.batch_overhead})
        table.append({k: r.get(k) for k in ("ranks", "threads", "layers", "levels",
                                            "cfactor", "fwd_iters", "bwd_iters")}
                     | {"measured_s": m, "predicted_s": p.seconds_per_batch,
                        "rel_error": err, "role": role})
    val = [t["rel_error"] for t in table if t["role"] == "validate"]
    summary = {
        "call_overhead_s": f.call_overhead, "step_overhead_s": f.step_overhead,
        "batch_overhead_s": f.batch_overhead,
        "fit_rows": f.fit_rows, "fit_rms_rel_error": f.fit_rms_rel_error,
        "validate_rows": len(val),
        "validate_rms_rel_error": math.sqrt(sum(e * e for e in val) / len(val)) if val
        else None,
        "validate_max_abs_rel_error": max(abs(e) for e in val) if val else None,
        "rows": table,
    }
    return f, summary


def _typed(row: dict[str, Any]) -> dict[str, Any]:
    """CSV strings back to numbers where they are numbers (for the model and plots)."""
    out: dict[str, Any] = {}
    for k, v in row.items():
        if isinstance(v, str) and k not in ("model", "scaling", "serial_variant",
                                            "model_role", "fwd_residual_history",
                                            "bwd_residual_history"):
            if k in KEY_COLUMNS and v.strip().lstrip("+-").isdigit():
                out[k] = int(v)  # exactly, also beyond float precision (seeds)
                continue
            try:
                f = float(v)
                out[k] = int(f) if f.is_integer() and k in KEY_COLUMNS + [
                    "serial_threads", "fwd_iterations", "bwd_iterations", "state_bytes",
                    "param_bytes", "cores"] else f
                continue
            except ValueError:
                pass
        out[k] = v
    return out


def run_study(grid: dict[str, Any], out_csv: Union[str, Path], *,
              out_dir: Optional[Union[str, Path]] = None, timeout_per_run: float = 900.0,
              progress: bool = True, plots: bool = True,
              serial_threads: Optional[Sequence[int]] = None, quick_pingpong: bool = False,
              map_ranks: Sequence[int] = perfmodel.MAP_RANKS,
              map_layers: Sequence[int] = perfmodel.MAP_LAYERS,
              stream: TextIO = sys.stderr) -> StudyResult:
    """Run the study `grid`, writing one row per run to `out_csv` (resumable).

    grid: lists or scalars for ranks, threads, layers, levels, cfactor, fwd_iters,
        bwd_iters, model, width, batch; scalars for the other `runs.DEFAULTS`
        (steps, warmup, lr, seed, ...); ``weak: True`` for weak scaling.
    out_dir: where the ping-pong, worker output, model.json and plots go (default:
        the CSV's folder).
    timeout_per_run: seconds allowed per run; a launch gets this times its runs
        (+60 s) before its process tree is killed.
    serial_threads: thread counts tried for the serial baseline (default 1..cores).
    quick_pingpong: fewer message sizes in the ping-pong.
    map_ranks, map_layers: the grid of the model's extrapolation map.
    Returns a `StudyResult`; failed launches are listed there (and the runs they did
    not finish stay out of the CSV, so a later call retries them).
    Raises ValueError for a bad grid value or timeout, and `StudyFileError` for an
    unusable folder or a damaged file to resume from, both before any measurement.
    """
    out_csv = Path(out_csv)
    out_dir = Path(out_dir) if out_dir is not None else out_csv.parent
    if not (isinstance(timeout_per_run, (int, float)) and math.isfinite(timeout_per_run)
            and timeout_per_run > 0):
        raise ValueError(f"`timeout_per_run` must be a finite number > 0, got "
                         f"{timeout_per_run!r}")
    runs = expand_grid(grid)
    existing, todo, logged = _resumable_runs(runs, out_csv, out_dir, plots)
    result = StudyResult(rows=[], fit=perfmodel.NO_FIT,
                         csv_path=out_csv, skipped=len(runs) - len(todo))
    bar = Progress(len(todo), "study", enabled=progress, stream=stream, lines=True,
                   clock=True, interval=0.0)
    if todo:
        bar.update(0, "serial baselines and step costs")
        serial, costs = _baselines_and_costs(existing, todo, serial_threads)
        bar.update(0, "ping-pong")  # also at one rank: the model's extrapolation needs it
        pp = run_pingpong(out_dir / "pingpong.json", quick=quick_pingpong)
        link = {"alpha": float(pp.get("alpha_s", 0.0)),
                "beta": float(pp.get("beta_Bps", math.inf))}
        n_done = 0
        for ranks in sorted({int(r["ranks"]) for r in todo}):
            group = [r for r in todo if int(r["ranks"]) == ranks]
            _run_group(ranks, group, out_csv, out_dir, logged[ranks], serial,
                       {k: replace(c, **link) for k, c in costs.items()},
                       timeout_per_run, bar, n_done, result)
            n_done += len(group)
            bar.update(n_done, f"ranks={ranks} done")
    bar.close()
    _fit_and_write(result, out_csv, out_dir, plots, map_ranks, map_layers)
    return result


def _resumable_runs(runs: list[dict[str, Any]], out_csv: Path, out_dir: Path, plots: bool
                    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[int, int]]:
    """(the rows already in `out_csv`, the runs still to do, the complete lines of each
    rank count's worker log), after refusing, before any measurement, everything that
    can be refused: the folders, the CSV and the worker logs a resume reads and
    extends, the ping-pong cache."""
    check_output_dir(out_dir, "out_dir", ("model.json", "pingpong.json"))
    check_output_dir(out_csv.parent, "out_csv", (out_csv.name,))
    existing = [_typed(r) for r in read_rows(out_csv)]
    done = {_key(r, KEY_COLUMNS) for r in existing}
    todo = [r for r in runs if _key(r, KEY_COLUMNS) not in done]
    _refuse_foreign(out_dir, out_csv.exists(), plots, {int(r["ranks"]) for r in todo})
    logged = {ranks: len(read_jsonl(out_dir / f"worker-{ranks}.jsonl", _JSONL_RECOVERY))
              for ranks in {int(r["ranks"]) for r in todo}}
    if todo:
        _read_pingpong(out_dir / "pingpong.json")
    return existing, todo, logged


def _baselines_and_costs(existing: list[dict[str, Any]], todo: list[dict[str, Any]],
                         serial_threads: Optional[Sequence[int]]
                         ) -> tuple[dict[tuple, dict[str, Any]], dict[tuple, perfmodel.Costs]]:
    """The serial baseline of every run to do (reusing those measured before, in
    `existing`) and the step costs of the performance model, each measured once per
    distinct setting."""
    serial: dict[tuple, dict[str, Any]] = {}
    for r in existing:  # reuse baselines measured before
        if math.isfinite(_num(r, "serial_seconds_per_batch")):
            serial.setdefault(_key(r, _SERIAL_KEY), {
                c: r[c] for c in ("serial_seconds_per_batch", "serial_threads",
                                  "serial_variant", "serial_loss")})
    costs: dict[tuple, perfmodel.Costs] = {}
    for r in todo:
        sk, ck = _key(r, _SERIAL_KEY), _key(r, _COST_KEY)
        if sk not in serial:
            serial[sk] = serial_baseline(r, serial_threads)
        if ck not in costs:
            costs[ck] = perfmodel.measure_costs(r, int(r["threads"]))
    return serial, costs


def _run_group(ranks: int, group: list[dict[str, Any]], out_csv: Path, out_dir: Path,
               start: int, serial: dict[tuple, dict[str, Any]],
               costs: dict[tuple, perfmodel.Costs], timeout_per_run: float,
               bar: Progress, n_done: int, result: StudyResult) -> None:
    """One launch: the runs of `group` (all at `ranks` ranks) in one MPI job, each
    finished run's row appended to `out_csv`, failures listed in `result`.  `start`:
    the complete lines of the worker log before this launch; `n_done`: runs finished
    before it (for the progress bar)."""
    jsonl = out_dir / f"worker-{ranks}.jsonl"
    cfg_path = out_dir / f"worker-{ranks}.json"
    write_text(cfg_path, json.dumps({"out": str(jsonl), "runs": [
        {k: v for k, v in r.items() if k not in ("ranks", "scaling")}
        for r in group]}, indent=1))
    threads = max(int(r["threads"]) for r in group)
    seen = [0]

    def poll() -> None:
        n = (sum(1 for _ in jsonl.open()) - start) if jsonl.exists() else 0
        if n != seen[0]:
            seen[0] = n
            bar.update(n_done + n, f"ranks={ranks}")

    bar.update(n_done, f"launching {len(group)} run(s) on {ranks} rank(s)")
    job = _launch(ranks, ["layerpar.apps.studies.worker", f"@{cfg_path}"],
                  timeout_per_run * len(group) + 60, threads, poll)
    result.launched += len(group)
    # the workers append each line whole (`files.append_line`), so these are the
    # complete results of this launch, one per finished run, in the group's order
    got = read_jsonl(jsonl, _JSONL_RECOVERY)[start:]
    cores = available_cores()
    for raw, run in zip(got, group):
        if "error" in raw:
            result.failed.append(f"ranks={ranks} layers={run['layers']}: "
                                 f"{raw['error']}")
            continue
        raw["scaling"] = run["scaling"]
        row = _finish_row(raw, serial[_key(run, _SERIAL_KEY)],
                          costs[_key(run, _COST_KEY)], cores)
        _append_row(out_csv, row)
    if job.returncode != 0 or job.timed_out:
        result.failed.append(
            f"ranks={ranks}: mpiexec exit {job.returncode}"
            f"{' (timed out, killed)' if job.timed_out else ''}: "
            f"{job.stderr.strip()[-1500:]}")


def _fit_and_write(result: StudyResult, out_csv: Path, out_dir: Path, plots: bool,
                   map_ranks: Sequence[int], map_layers: Sequence[int]) -> None:
    """Fit the performance model to every row of `out_csv` (this study's and earlier
    ones), rewrite the CSV with the model's columns, write model.json and the plots,
    and fill `result` with the rows, the fit and the files."""
    rows = [_typed(r) for r in read_rows(out_csv)]
    f, summary = _apply_model(rows)
    result.fit, result.summary, result.rows = f, summary, rows
    if rows:
        _write_rows(out_csv, rows)
        result.rows = [_typed(r) for r in read_rows(out_csv)]
        model_json = out_dir / "model.json"
        write_text(model_json, json.dumps(summary, indent=1, default=str))
        result.files.append(model_json)
        if plots:
            from .plots import plot_all

            result.files += plot_all(result.rows, out_dir, f, map_ranks=map_ranks,
                                     map_layers=map_layers)
