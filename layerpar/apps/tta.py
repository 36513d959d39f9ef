"""Time to accuracy: serial training against layer-parallel training with ``--auto``
(``tta``), and against every method at the same ranks (``versus``).

    python -m layerpar.bench tta [--cases a,b,c,d] [--np 2] [--out out/tta/latest]
    python -m layerpar.bench tta --smoke            # every case shrunk: checks the pipeline
    python -m layerpar.bench versus [--cases a,f,e,c,d] [--np 2] [--methods ...]

``versus`` trains, beside the best serial, each method of `METHODS` at P ranks: data
parallelism (``--method data``), the pipeline at its measured schedule and micro-batch
count (``--method pipeline``), layer-parallel at auto's own setting (``--auto --method
layerparallel``) and auto itself (``--auto``, which chooses among all of them: the
table of what it measured is in the README it writes); each row's seconds to the
target are also given over the fastest of the alternatives a user would pick instead
(serial, data, pipeline).

For each case, the best serial training on this machine (plain `ODENet` with
autograd, at the torch thread count that runs a batch fastest here: each count from 1
to the cores this process may use, in powers of two, is timed on a few batches; on
CUDA also the serial step captured in one CUDA graph, `SERIAL_CAPTURED`) and
layer-parallel training with settings chosen by measurement (``layerpar train --auto
--np N``) train the same network from the same seed: same data split, batch order,
initial weights, optimiser (Adam) and learning-rate schedule (cosine over the run).
Both record validation accuracy after every epoch against their training seconds
(from the first batch, with the auto-tuning and gradient checks, without
evaluation).  The target is serial's best validation accuracy minus half a point;
each method's seconds and epochs to the target, final accuracy and chosen settings
are reported.

Cases: (a) MNIST-1D dense ODE-net, 1,024 layers, width 32, t_final 1; (b) MNIST-1D
conv ODE-net, 256 layers, 16 channels (both latency-bound, at low accuracy); (c)
digits; (d) Peaks, as bundled; (e) MNIST-1D convolutional ResNet, 128 layers, and (f)
MNIST-1D pre-norm dense ResNet, 256 layers x 128, each at its recipe's whole budget
(the accurate cases: ``--cases e,f``; not in the default set, which they would
lengthen by most of an hour on a small CPU).  Writes ``tta.csv`` (every epoch),
``summary.csv`` (one row per method), ``tta.png`` (accuracy against seconds, one line
per method) and ``README.md`` (the table and the exact command) under ``--out``.

Each training runs in a process of its own (`worker`, the serial one with
``OMP_NUM_THREADS`` set to the chosen count, the parallel one under mpiexec with one
thread per rank), so neither inherits the other's state.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

from .parsing import OneLineParser
from .threads import best_threads

__all__ = ["CASES", "SMOKE", "Case", "best_threads", "main", "run_case", "worker"]


@dataclass(frozen=True)
class Case:
    """One network and training budget (the arguments of ``layerpar train``)."""

    key: str
    problem: str
    label: str
    epochs: int
    args: tuple[str, ...] = ()  # more ``layerpar train`` options (--model, --layers ...)
    #: ``layerpar train --seed``: data split, initial weights, batch order (both methods)
    seed: int = 0
    #: which run of the same comparison this is (``--repeats``: 0, 1, ...)
    round: int = 0

    def train_args(self) -> list[str]:
        seed = ["--seed", str(self.seed)] if self.seed else []
        return [self.problem, "--epochs", str(self.epochs), *self.args, *seed]

    def with_seed(self, seed: int) -> Case:
        """The same case from another seed (its label says which)."""
        return replace(self, seed=seed, label=f"{self.label.split(', seed ')[0]}, seed {seed}")

    def with_round(self, round_: int) -> Case:
        """The same comparison run again (``--repeats``; its label says which run)."""
        return replace(self, round=round_,
                       label=f"{self.label.split(', run ')[0]}, run {round_ + 1}")


CASES: dict[str, Case] = {
    "a": Case("a", "mnist1d", "MNIST-1D dense, 1024 layers x 32, T=1", 8,
              ("--model", "dense", "--layers", "1024", "--width", "32", "--t-final", "1")),
    "b": Case("b", "mnist1d", "MNIST-1D conv, 256 layers x 16 ch, T=1", 6,
              ("--model", "conv", "--layers", "256", "--width", "16", "--t-final", "1")),
    "c": Case("c", "digits", "digits (bundled: conv, 8 layers)", 8),
    "d": Case("d", "peaks", "Peaks (bundled: 32 layers x 8, T=5)", 20),
    # the accurate cases: each ResNet at its whole recipe (`layerpar.apps.recipes`)
    "e": Case("e", "mnist1d", "MNIST-1D conv ResNet, 128 layers (16/32/64 ch, BN), T=2",
              6, ("--model", "resnet", "--layers", "128", "--width", "16", "--t-final", "2",
                  "--batch-size", "128", "--lr", "0.003")),
    "f": Case("f", "mnist1d", "MNIST-1D pre-norm ResNet, 256 layers x 128, T=16", 10,
              ("--model", "prenorm", "--layers", "256", "--width", "128", "--t-final", "16",
               "--batch-size", "128", "--lr", "0.001")),
}
#: the same cases shrunk, to check the pipeline (not a measurement of time to accuracy:
#: too short for anything to converge).  Its trainings are short, so starting their
#: processes takes most of its time: 12 trainings, each a few seconds to start on a quiet
#: 2-core machine and several times that under load (`main` prints its estimate)
SMOKE: dict[str, Case] = {
    "a": Case("a", "mnist1d", "MNIST-1D dense, 128 layers x 32, T=1 (smoke)", 1,
              ("--model", "dense", "--layers", "128", "--width", "32", "--t-final", "1")),
    "b": Case("b", "mnist1d", "MNIST-1D conv, 32 layers x 8 ch, T=1 (smoke)", 1,
              ("--model", "conv", "--layers", "32", "--width", "8", "--t-final", "1")),
    "c": Case("c", "digits", "digits (smoke: 2 epochs)", 2),
    "d": Case("d", "peaks", "Peaks (smoke: 2 epochs)", 2),
    "e": Case("e", "mnist1d", "MNIST-1D conv ResNet, 12 layers x 4 ch (smoke)", 1,
              ("--model", "resnet", "--layers", "12", "--width", "4", "--t-final", "2",
               "--batch-size", "128", "--lr", "0.003")),
    "f": Case("f", "mnist1d", "MNIST-1D pre-norm ResNet, 32 layers x 16 (smoke)", 1,
              ("--model", "prenorm", "--layers", "32", "--width", "16", "--t-final", "16",
               "--batch-size", "128", "--lr", "0.001")),
}


@dataclass
class Run:
    """One training: its per-epoch history and what it chose."""

    method: str
    ranks: int
    threads: int
    history: list[dict[str, Any]]
    settings: str
    wall_seconds: float
    log: list[str] = field(default_factory=list)
    serial: bool = False  # a serial baseline (the first one sets the target)
    kind: str = "serial"  # "serial", or the `METHODS` name of a parallel run

    @property
    def best_acc(self) -> float:
        return max(r["val_acc"] for r in self.history)

    @property
    def final_acc(self) -> float:
        return self.history[-1]["val_acc"]

    def to_target(self, target: float) -> tuple[Optional[float], Optional[int]]:
        """(training seconds, epochs) until the validation accuracy first reached
        `target` (None, None if it never did)."""
        for r in self.history:
            if r["val_acc"] >= target:
                return r["train_seconds"], r["epoch"]
        return None, None


def worker(argv: list[str]) -> int:
    """``python -m layerpar.apps.tta worker OUT.json PROBLEM [train options]``: train (on
    the ranks of the MPI job, if any) and write the history as JSON from rank 0."""
    from . import cli
    from .launch import world_comm
    from .train import train_from_arguments

    out, rest = argv[0], argv[1:]
    args = cli.parse_args(["train", *rest])
    comm = world_comm() if cli.under_mpi() else None
    res = train_from_arguments(args.model, args, comm)
    if comm is None or comm.Get_rank() == 0:
        keep = {k: getattr(res, k) for k in ("history", "auto_log", "auto_choice", "accuracy_log",
                                    "ranks", "summary", "step_mode", "train_seconds",
                                    "method")}
        keep["history"] = [{k: v for k, v in r.items() if isinstance(v, (int, float, str))
                            or v is None} for r in res.history]
        keep["threads"] = __import__("torch").get_num_threads()
        Path(out).write_text(json.dumps(keep))
    return 0


def _launch(case: Case, extra: list[str], nprocs: int, threads: int,
            timeout: Optional[float]) -> tuple[dict[str, Any], float]:
    """Run `worker` for `case` on `nprocs` processes; its JSON result and wall time."""
    from .launch import job_command, run_job

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "run.json")
        args = ["-m", "layerpar.apps.tta", "worker", out, *case.train_args(), *extra,
                "--no-progress"]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        cmd = job_command(nprocs, args) if nprocs > 1 else [sys.executable, *args]
        t0 = time.perf_counter()
        with open(os.path.join(tmp, "log.txt"), "w+") as log:
            status = run_job(cmd, env=env, timeout=timeout, stdout=log,
                             stderr=subprocess.STDOUT)
            log.seek(0)
            text = log.read()
        wall = time.perf_counter() - t0
        if status.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"{' '.join(cmd)} failed (exit {status.returncode}, timed "
                               f"out {status.timed_out}):\n{text[-3000:]}")
        return json.loads(Path(out).read_text()), wall


#: the parallel methods a comparison may train at P ranks: name -> (``layerpar train``
#: options, the label of its row).  "auto" is ``--auto`` (it chooses among the others);
#: "mgrit" is layer-parallel at auto's own setting (``--auto --method layerparallel``)
METHODS: dict[str, tuple[tuple[str, ...], str]] = {
    "data": (("--method", "data"), "data parallel"),
    "pipeline": (("--method", "pipeline"), "pipeline (best schedule)"),
    "mgrit": (("--auto", "--method", "layerparallel"), "layer-parallel (auto's setting)"),
    "auto": (("--auto",), "auto"),
}

#: where a run writes without ``--out``: a folder git ignores (``/out/`` in .gitignore), so
#: that running the benchmark in a checkout leaves it clean; a run meant to be committed
#: names its folder (``make bench-tta``: docs/results/tta/np2)
OUT = {"run": "out/tta/latest", "smoke": "out/tta/smoke"}
#: ``versus``'s (``make bench-versus``: docs/results/versus/np2)
OUT_VERSUS = {"run": "out/versus/latest", "smoke": "out/versus/smoke"}


def launch_seconds(case: Case, nprocs: int, timeout: Optional[float] = None) -> float:
    """Wall seconds of a training of `case` that stops after its first batch (serial at
    one process, else layer-parallel on a job of `nprocs` ranks), here and now: what
    each training costs beyond its steps (start-up of Python, torch and MPI, the data,
    the net, evaluation).  Measured rather than assumed, because it is most of a short
    run's time and grows with the machine's load (a few seconds on a quiet 2-core
    machine, several times that on a busy one)."""
    extra = ["--time-budget", "1e-9", *(["--serial"] if nprocs == 1 else [])]
    return _launch(case, extra, nprocs, 1, timeout)[1]


def expected_seconds(case: Case, step: float, steps_per_epoch: int,
                     runs: tuple[int, int] = (1, 2),
                     launch: tuple[float, float] = (0.0, 0.0)) -> float:
    """A rough duration of `run_case` from the best serial step time: `runs` trainings
    (serial, layer-parallel; all assumed to step no slower than serial), each with
    evaluation (~10 %) and its process's start-up (`launch`: seconds to start one
    serial process and one layer-parallel job, `launch_seconds`).  A lower bound where
    the layer-parallel runs step slower than serial."""
    train = 1.1 * step * steps_per_epoch * case.epochs
    return sum(runs) * train + runs[0] * launch[0] + runs[1] * launch[1]


#: ``layerpar train`` options of the captured serial baseline on CUDA: one rank in
#: direct mode (``--levels 1``: plain serial autograd through the same modules, what
#: `LayerParallel` runs at one rank), no residual tolerance, so that ``layerpar train``
#: captures each step with `layerpar.parallel.capture_step`
SERIAL_CAPTURED: tuple[str, ...] = ("--levels", "1", "--tol", "0")


def run_case(case: Case, nprocs: int, timeout: Optional[float] = None, say: Any = print,
             probe: Optional[tuple[int, dict[int, float], int]] = None,
             device: str = "cpu", bounds: tuple[Optional[float], ...] = (None,),
             compiled: bool = False, methods: tuple[str, ...] = ("auto",)
             ) -> tuple[list[Run], float, dict[int, float]]:
    """Serial (best thread count) and ``--auto`` at `nprocs` ranks on `case`, once per
    gradient-error bound in `bounds` (``--max-grad-error``; None: the default bound):
    the runs, the target accuracy and the serial step time per thread count (`probe`:
    what `best_threads` measured, if it already ran).  On ``device="cuda"`` both train on
    the GPU (the thread probe is still the host's), and serial twice: eagerly (the
    target's run) and captured in one CUDA graph per step (`SERIAL_CAPTURED`).
    `compiled`: serial once more, the net compiled by ``torch.compile`` (``--serial
    --compile``: its compilation counts in its time).
    `methods`: the parallel runs (`METHODS`; "auto" once per bound).
    Threads: serial runs at the probe's best count; ``--auto`` at one rank too (one
    process, the same cores: its serial candidate is then the serial baseline), at
    several ranks one per rank (the ranks share the cores)."""
    threads, per, _ = best_threads(case) if probe is None else probe
    auto_threads = threads if nprocs == 1 else 1
    dev = ["--device", device]
    say(f"[{case.key}] {case.label}: serial step "
        + ", ".join(f"{1e3 * s:.1f} ms at {k} thread(s)" for k, s in per.items())
        + f" -> serial baseline at {threads} thread(s)")
    runs = []
    got, wall = _launch(case, ["--serial", *dev], 1, threads, timeout)
    where = "" if device == "cpu" else f", {device}"
    runs.append(Run(f"serial ({threads} thr{where})", 1, threads, got["history"],
                    "serial autograd", wall, serial=True))
    say(f"[{case.key}]   serial: {got['summary']} ({wall:.0f} s wall)")
    if device == "cuda":
        got, wall = _launch(case, [*SERIAL_CAPTURED, *dev], 1, threads, timeout)
        mode = got.get("step_mode", "?")
        runs.append(Run(f"serial ({'CUDA graph' if mode == 'captured' else mode}{where})",
                        1, threads, got["history"], f"serial autograd (direct mode), {mode}",
                        wall, serial=True))
        say(f"[{case.key}]   serial, captured: {got['summary']} ({wall:.0f} s wall)")
    if compiled:
        try:
            got, wall = _launch(case, ["--serial", "--compile", *dev], 1, threads, timeout)
        except RuntimeError as exc:  # a compiler that fails (or runs out of time) is
            # reported, the comparison goes on without it (as `layerpar.bench gpu` does)
            say(f"[{case.key}]   serial, compiled: failed: {str(exc)[-600:]}")
        else:
            runs.append(Run(f"serial (torch.compile, {threads} thr{where})", 1, threads,
                            got["history"], "serial autograd, torch.compile", wall,
                            serial=True))
            say(f"[{case.key}]   serial, compiled: {got['summary']} ({wall:.0f} s wall)")
    plan = [(m, b) for m in methods for b in (bounds if m == "auto" else (None,))]
    for method, bound in plan:
        extra = [] if bound is None else ["--max-grad-error", repr(bound)]
        options, label = METHODS[method]
        got, wall = _launch(case, [*options, *dev, *extra], nprocs, auto_threads, timeout)
        name = f"{label} ({nprocs} ranks" + ("" if bound is None else f", err<={bound:g}") \
            + ")"
        settings = got["auto_choice"] or got.get("method") or "?"
        if method == "auto" and got.get("method") not in (None, "layerparallel"):
            settings = f"{got['method']} (chosen by auto)"
        if device != "cpu":  # captured (how often) or eager, and why
            settings += f", {got.get('step_mode', '?')}"
        runs.append(Run(name, nprocs, auto_threads, got["history"], settings, wall,
                        got["auto_log"] + got["accuracy_log"], kind=method))
        say(f"[{case.key}]   {name}: {got['summary']} ({wall:.0f} s wall)")
        for line in got["auto_log"] + got["accuracy_log"]:
            say(f"[{case.key}]     {line}")
    target = runs[0].best_acc - 0.005
    return runs, target, per


def _over_seeds(rows: list[list[Any]], head: list[str]) -> list[str]:
    """README lines: per case run from several seeds (or run several times,
    ``--repeats``), each method's time to target against the best serial's and against
    the best alternative's, per run (each against its own run's serial and
    alternatives) and their median (none for one run)."""
    col = {h: i for i, h in enumerate(head)}
    per: dict[tuple[str, str], list[tuple[str, str, str]]] = {}
    repeated = any(int(r[col["round"]]) for r in rows)
    for r in rows:
        run = f"seed {r[col['seed']]}" + (f" run {int(r[col['round']]) + 1}" if repeated
                                          else "")
        per.setdefault((r[col["case"]], r[col["method"]]), []).append(
            (run, r[col["time_vs_best_serial"]], r[col["time_vs_best_alternative"]]))

    def median(vals: list[str]) -> str:
        got = sorted(float(v) for v in vals if v)
        return f"{statistics.median(got):.2f}" if got else "n/a"

    md: list[str] = []
    for (key, method), got in per.items():
        if len(got) < 2:
            continue
        reached = sum(1 for _, v, _ in got if v)
        md.append(f"| {key} | {method} | " + ", ".join(
            f"{run}: {v or 'not reached'}" for run, v, _ in got)
            + f" | {median([v for _, v, _ in got])} ({reached} of {len(got)} reached) | "
            + median([a for _, _, a in got]) + " |")
    if not md:
        return []
    return ["", "Over seeds and runs (time to target against the best serial's, each "
            "run's own target; the last column: the median against the best "
            "alternative's, each run's own):", "",
            "| case | method | per run | median | median vs best alternative |",
            "|---|---|---|---|---|", *md]


TITLE = "# Time to accuracy (`python -m layerpar.bench tta`)"  # README's first line
PNG_MARKER = "layerpar.bench tta"  # in the plot's metadata
#: per benchmark this module runs: README's first line and the plot's metadata marker
TITLES = {"tta": (TITLE, PNG_MARKER),
          "versus": ("# Against data and pipeline parallelism (`python -m layerpar.bench "
                     "versus`)", "layerpar.bench versus")}
#: the alternatives a user would pick instead of layer-parallel training (a row's
#: `time_vs_best_alternative` is over the fastest of them to the target)
ALTERNATIVES = ("serial", "data", "pipeline")
CSV_HEADS = {"tta.csv": "case,seed,method,", "summary.csv": "case,seed,label,method,"}


def check_outputs(out: Path, bench: str = "tta") -> None:
    """Refuse (`StudyFileError`, a ValueError) before anything trains when ``--out``
    cannot be written or holds a file of this benchmark's names that it did not write
    (a README a person wrote is never replaced: ``docs/results/tta/README.md`` is the status
    table, next to the runs' own folders)."""
    from .studies.files import check_output_dir, first_line, refuse_foreign

    title, marker = TITLES[bench]
    check_output_dir(out, "--out", ("tta.csv", "summary.csv", "tta.png", "README.md"))
    readme = out / "README.md"
    # a folder of this benchmark's: its plots too (those written before the marker)
    ours = readme.exists() and first_line(readme.read_bytes()) == title
    owned = {"README.md": lambda b: first_line(b) == title,
             **{name: (lambda b, h=head: first_line(b).startswith(h))
                for name, head in CSV_HEADS.items()},
             "tta.png": lambda b: ours or marker.encode() in b}
    refuse_foreign(out, owned, "this benchmark")


def _cpu_name() -> str:
    """The processor's model name (a virtual machine's host may change between runs, and
    with it every timing), or the architecture where the system does not say."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _source_commit() -> str:
    """The commit of the checkout the package runs from, marked ``+changes`` where its
    tracked files differ from it; empty outside a git checkout (an installed wheel)."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return ""
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                                "--untracked-files=no", "--", "layerpar"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ""
    return head.stdout.strip() + (" +changes" if dirty.stdout.strip() else "")


def _write(out: Path, results: list[tuple[Case, list[Run], float]], command: str,
           smoke: bool, load: str, device: str = "cpu", bench: str = "tta",
           commit: str = "") -> None:
    import torch

    title, marker = TITLES[bench]
    gpu_name = torch.cuda.get_device_name() if device == "cuda" else ""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "tta.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["case", "seed", "method", "ranks", "threads", "epoch", "train_seconds",
                    "val_acc", "val_loss", "train_loss", "round"])
        for case, runs, _ in results:
            for r in runs:
                for h in r.history:
                    w.writerow([case.key, case.seed, r.method, r.ranks, r.threads, h["epoch"],
                                f"{h['train_seconds']:.3f}", f"{h['val_acc']:.4f}",
                                f"{h['val_loss']:.4f}", f"{h['train_loss']:.4f}",
                                case.round])
    rows = []
    for case, runs, target in results:
        serial_s = runs[0].to_target(target)[0]
        reached = [t for t in (r.to_target(target)[0] for r in runs if r.serial)
                   if t is not None]
        best_s = min(reached) if reached else None
        alt = [t for t in (r.to_target(target)[0] for r in runs if r.kind in ALTERNATIVES)
               if t is not None]
        best_alt = min(alt) if alt else None

        def ratio(s: Optional[float], base: Optional[float]) -> str:
            return "" if s is None or not base else f"{s / base:.2f}"

        for r in runs:
            s, e = r.to_target(target)
            rows.append([case.key, case.seed, case.label, r.method, r.ranks, r.threads,
                         f"{target:.4f}", "" if s is None else f"{s:.2f}",
                         "" if e is None else str(e), f"{r.final_acc:.4f}",
                         f"{r.best_acc:.4f}", ratio(s, serial_s), ratio(s, best_s),
                         ratio(s, best_alt), f"{_ms_per_batch(r):.1f}", r.settings,
                         case.round])
    head = ["case", "seed", "label", "method", "ranks", "threads", "target",
            "seconds_to_target",
            "epochs_to_target", "final_acc", "best_acc", "time_vs_serial",
            "time_vs_best_serial", "time_vs_best_alternative", "ms_per_batch", "settings",
            "round"]
    with open(out / "summary.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(head)
        w.writerows(rows)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 3.4),
                                 squeeze=False)
        for ax, (case, runs, target) in zip(axes[0], results):
            for r in runs:
                ax.plot([h["train_seconds"] for h in r.history],
                        [h["val_acc"] for h in r.history], marker="o", label=r.method)
            ax.axhline(target, color="grey", ls="--", lw=0.8, label="target")
            ax.set_title(f"({case.key}) {case.label}", fontsize=8)
            ax.set_xlabel("training seconds (tuning included)")
            ax.set_ylabel("validation accuracy")
            ax.legend(fontsize=7)
        if smoke:
            fig.suptitle("SMOKE RUN on a shared, loaded machine: not a measurement",
                         color="red", fontsize=9)
        fig.tight_layout()
        fig.savefig(out / "tta.png", dpi=110, metadata={"Software": marker})
        plt.close(fig)
    except ImportError:
        pass
    md = [title, ""]
    if smoke:
        md += ["**SMOKE RUN** (`--smoke`: every case shrunk: fewer layers, 1-2 epochs) on a "
               "shared 2-core machine under load from other jobs "
               f"(load average {load}). It checks the pipeline; its figures are not "
               "a measurement of time to accuracy. The full run is `make bench-{bench}`.", ""]
    md += [f"Command: `{command}`", "",
           f"Machine: {_cpu_name()} ({platform.machine()}), {os.cpu_count()} CPUs "
           f"visible, python "
           f"{platform.python_version()}, torch {__import__('torch').__version__}; load "
           f"average at the start {load}; device {device}"
           + (f" ({gpu_name})" if gpu_name else "") + "."
           + (f" Code: commit {commit}." if commit else ""), "",
           "Target: serial's best validation accuracy minus 0.5 points. Seconds are "
           "training seconds from the first batch (auto-tuning and gradient checks "
           "included, evaluation excluded); `time_vs_serial` is seconds to target over "
           "the first serial run's (eager), `time_vs_best_serial` over the fastest serial "
           "baseline's (on CUDA also the step captured in a CUDA graph), "
           "`time_vs_best_alternative` over the fastest of serial, data parallelism and "
           "the pipeline (what a user would pick instead). `ms_per_batch`: training "
           "seconds over steps (tuning included).", "",
           "| " + " | ".join(head[:2] + head[3:]) + " |",
           "|" + "---|" * (len(head) - 1)]
    md += ["| " + " | ".join(str(c) for c in (r[:2] + r[3:])) + " |" for r in rows]
    md += _over_seeds(rows, head)
    md += ["", "Cases: " + "; ".join(f"({c.key}) {c.label}, {c.epochs} epochs, "
                                     f"`layerpar train {' '.join(c.train_args())}`"
                                     for c, _, _ in results), "",
           "What auto measured and chose:", ""]
    for case, runs, _ in results:
        for r in runs:
            if not r.serial and r.log:  # (a method that chose nothing logged nothing)
                md += [f"({case.key}) {r.method}:", "", "```", *r.log, "```", ""]
    md += ["![accuracy against seconds](tta.png)", ""]
    (out / "README.md").write_text("\n".join(md))


#: per benchmark: (``--cases``, ``--methods``, ``--bounds``, ``--compiled-serial``) defaults
DEFAULTS = {"tta": ("a,b,c,d", "auto", "default,0.15", False),
            "versus": ("a,f,e,c,d", "data,pipeline,mgrit,auto", "default", True)}


def versus_main(argv: Optional[list[str]] = None) -> int:
    """Command line of ``python -m layerpar.bench versus``: `main` with every method at
    P ranks (data parallelism, the best pipeline, layer-parallel at auto's setting and
    auto itself) against the best serial, on the latency-bound dense net, the two
    ResNets at their recipes, digits and Peaks."""
    return main(argv, bench="versus")


def _parser(bench: str) -> OneLineParser:
    """The command line of ``python -m layerpar.bench`` `bench` ("tta" or "versus"):
    the same options, with each benchmark's defaults (`DEFAULTS`)."""
    cases, methods, bounds, compiled = DEFAULTS[bench]
    p = OneLineParser(prog=f"python -m layerpar.bench {bench}",
                      description=__doc__.split("\n")[0] if bench == "tta" else
                      (versus_main.__doc__ or "").split(":")[0])
    p.add_argument("--cases", default=cases, help=f"which cases (default {cases})")
    p.add_argument("--methods", default=methods,
                   help=f"the parallel runs, among {','.join(METHODS)} (default {methods})")
    p.add_argument("--np", type=int, default=2, help="ranks of the layer-parallel runs")
    p.add_argument("--smoke", action="store_true",
                   help="every case shrunk (checks the pipeline; not a measurement)")
    p.add_argument("--out", default=None,
                   help=f"folder for CSV, plot and README (default {OUT['run']}, "
                        f"{OUT['smoke']} with --smoke; for versus under out/versus/: git "
                        "ignores out/); a "
                        "file there that this benchmark did not write is never replaced")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds any one training may take")
    p.add_argument("--bounds", default=bounds,
                   help="one --auto run per gradient-error bound (--max-grad-error), "
                        "'default' for auto's own (measured on the batch's gradient "
                        f"noise; default: {bounds})")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where both methods train (cuda: one GPU, use --np 1)")
    p.add_argument("--compiled-serial", action=argparse.BooleanOptionalAction,
                   default=compiled,
                   help="also train serial compiled by torch.compile (a third serial "
                        f"baseline; its compilation counts in its time; default {compiled})")
    p.add_argument("--seeds", default="0",
                   help="one comparison per seed (data split, initial weights, batch "
                        "order: ``layerpar train --seed``), comma-separated (default 0)")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of each comparison (case and seed), one after the other, "
                        "each of every method in the same order: the machine's drift "
                        "falls alike on each method, and README gives each run's ratios "
                        "and their median (default 1)")
    return p


def main(argv: Optional[list[str]] = None, bench: str = "tta") -> int:
    """Command line of ``python -m layerpar.bench tta`` (and, `bench` "versus", of
    ``versus``: the same comparison with every method)."""
    from .launch import load_average

    argv = sys.argv[1:] if argv is None else list(argv)
    p = _parser(bench)
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"`--repeats` must be >= 1, got {args.repeats}")
    try:
        seeds = [int(v) for v in args.seeds.split(",")]
    except ValueError:
        seeds = []
    if not seeds or any(v < 0 for v in seeds) or len(set(seeds)) < len(seeds):
        p.error(f"`--seeds` must be distinct integers >= 0, comma-separated, got "
                f"{args.seeds!r}")
    table = SMOKE if args.smoke else CASES
    keys = [k.strip() for k in args.cases.split(",") if k.strip()]
    bad = [k for k in keys if k not in table]
    if bad or not keys:
        p.error(f"`--cases` must name cases among {sorted(table)}, got {args.cases!r}")
    if args.np < 1:
        p.error(f"`--np` must be >= 1, got {args.np}")
    chosen = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    if not chosen or any(m not in METHODS for m in chosen) or len(set(chosen)) < len(chosen):
        p.error(f"`--methods` must name distinct methods among {list(METHODS)}, got "
                f"{args.methods!r}")
    from .cli import parse_args as train_command

    for k in keys:  # what each case's trainings would refuse, before training
        for m in chosen:
            try:
                train_command(["train", *table[k].train_args(), "--np", str(args.np),
                               *METHODS[m][0]])
            except ValueError as exc:
                p.error(f"case {k} at `--np` {args.np}, {m}: {exc}")
    if args.timeout is not None and not args.timeout > 0:
        p.error(f"`--timeout` must be > 0, got {args.timeout}")
    try:
        bounds = tuple(None if b.strip() == "default" else float(b)
                       for b in args.bounds.split(","))
    except ValueError:
        bounds = ()
    if not bounds or any(b is not None and not 0 < b < float("inf") for b in bounds):
        p.error(f"`--bounds` must be 'default' or numbers > 0, comma-separated, got "
                f"{args.bounds!r}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            p.error("`--device` cuda: CUDA is not available on this machine")
    out = Path(args.out or (OUT if bench == "tta" else OUT_VERSUS)[
        "smoke" if args.smoke else "run"])
    try:
        check_outputs(out, bench)
    except ValueError as exc:
        p.error(str(exc))
    load = " ".join(f"{v:.2f}" for v in load_average())
    commit = _source_commit()  # the code as it ran, whatever is committed meanwhile
    command = f"python -m layerpar.bench {bench} " + " ".join(argv)
    results = []
    t0 = time.perf_counter()
    probes = {k: best_threads(table[k]) for k in keys}
    first = table[keys[0]]
    serial_start = launch_seconds(first, 1, args.timeout)
    launch = (serial_start, launch_seconds(first, args.np, args.timeout))
    total = time.perf_counter() - t0  # the probes' own time
    runs = (1 + (args.device == "cuda") + args.compiled_serial,
            len(chosen) - 1 + len(bounds) if "auto" in chosen else len(chosen))
    for k in keys:
        threads, per, steps = probes[k]
        est = len(seeds) * args.repeats * expected_seconds(table[k], per[threads], steps,
                                                           runs, launch)
        total += est
        print(f"[{k}] {table[k].label}: {steps} steps per epoch, best serial step "
              f"{1e3 * per[threads]:.1f} ms at {threads} thread(s): expect about "
              f"{_duration(est)}", flush=True)
    print(f"layerpar.bench {bench}: expect about {_duration(total)} in all, or more where "
          f"the layer-parallel runs step slower than serial (starting a training took "
          f"{launch[0]:.1f} s here now, {launch[1]:.1f} s at {args.np} rank(s); time "
          f"budgets in the cases' options shorten it)", flush=True)
    for k, seed, rnd in ((k, seed, rnd) for k in keys for seed in seeds
                         for rnd in range(args.repeats)):
        case = table[k] if seeds == [0] else table[k].with_seed(seed)
        case = case if args.repeats == 1 else case.with_round(rnd)
        runs, target, _ = run_case(case, args.np, args.timeout, probe=probes[k],
                                   device=args.device, bounds=bounds,
                                   compiled=args.compiled_serial, methods=chosen)
        results.append((case, runs, target))
        _write(out, results, command.strip(), args.smoke, load, args.device, bench,
               commit)
        which = ("" if seeds == [0] else f" seed {seed}") + \
            ("" if args.repeats == 1 else f" run {rnd + 1}")
        print(f"[{k}{which}] target {target:.4f}: " + "; ".join(
            f"{r.method} " + _seconds(r.to_target(target)[0]) for r in runs), flush=True)
    print(f"layerpar.bench {bench}: {len(keys)} case(s) in {time.perf_counter() - t0:.0f} s; "
          f"wrote {out}/tta.csv, summary.csv, tta.png, README.md")
    return 0


def _ms_per_batch(r: Run) -> float:
    """Training milliseconds per step of a run (tuning and checks included)."""
    last = r.history[-1]
    return 1000.0 * last["train_seconds"] / max(1, last.get("batches", 1))


def _seconds(s: Optional[float]) -> str:
    return "target not reached" if s is None else f"{s:.2f} s"


def _duration(s: float) -> str:
    return f"{s:.0f} s" if s < 90 else f"{s / 60:.0f} min"


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        sys.exit(worker(sys.argv[2:]))
    sys.exit(main())
