"""Training end to end: `layerpar.apps.train`, the examples and the ``layerpar`` command.

- exact mode (one MGRIT level) trains exactly like the serial oracle, step for step;
- the examples and ``layerpar train --np 2`` run under MPI and print a summary line;
- inexact MGRIT training (3 levels, cfactor 4, 2 forward / 1 adjoint iteration) on 2
  ranks reaches the serial oracle's Peaks validation accuracy within 1 point;
- the digits ODE-net reaches 90 % validation accuracy.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from mpi_util import describe, mpi_available, run_mpi
from tolerances import F64

from layerpar import MGRITOptions
from layerpar.apps import cli, launch
from layerpar.apps.train import (
    TrainResult,
    _exact_kind,
    _summary_notes,
    add_arguments,
    check_arguments,
    format_summary,
    parse_summary,
    train,
)
from layerpar.parallel.adaptive import AccuracyPolicy

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
EXACT = MGRITOptions(max_levels=1)


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """In-process training on one thread: these nets are tiny, and the MPI ranks and
    other jobs share the cores (two spinning threads per process only thrash)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _summary(proc: subprocess.CompletedProcess) -> dict:
    """The single summary line of a finished job (only rank 0 prints one)."""
    assert proc.returncode == 0, describe(proc)
    lines = [ln for ln in proc.stdout.splitlines() if ":" in ln and "val_acc" in ln]
    assert len(lines) == 1, describe(proc)
    return parse_summary(lines[0])


# -- (a) exact mode = serial oracle ----------------------------------------------------------

def test_exact_layer_parallel_trains_like_serial_oracle() -> None:
    kw = dict(epochs=1, batch_size=500, seed=3, progress=False, dtype=torch.float64)
    ref = train("peaks", serial=True, **kw)
    got = train("peaks", serial=False, comm=None, fwd=EXACT, bwd=EXACT, **kw)
    assert len(got.batch_losses) == len(ref.batch_losses) == 10
    assert got.batch_losses == pytest.approx(ref.batch_losses, rel=F64.roundoff, abs=0)
    assert got.val_acc == ref.val_acc
    params = got.module.gather_state_dict()
    for name, p in ref.module.state_dict().items():
        torch.testing.assert_close(params[name], p, rtol=F64.converged, atol=0)
    # one level: sequential sweeps, no MGRIT cycle; the summary says so
    assert got.fwd_iters is got.bwd_iters is None
    assert (got.exact_kind, got.exact_steps, got.last_epoch_steps) == \
        ("sequential sweeps", 10, 10)
    assert isinstance(got, TrainResult) and got.summary == format_summary(got)
    assert "| exact (sequential sweeps) |" in got.summary
    assert parse_summary(got.summary)["exact_kind"] == "sequential sweeps"
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.val_acc = 0.0  # type: ignore[misc]


def test_compiled_serial_trains_like_eager_serial(capsys: pytest.CaptureFixture) -> None:
    """``--serial --compile`` (issue 20's torch.compile serial baseline): the same
    training as eager serial up to the compiled kernels' rounding, its mode said;
    asked for without ``--serial``, or with ``--nested``, a clear error first."""
    kw = dict(epochs=1, batch_size=500, seed=3, progress=False, dtype=torch.float64)
    ref = train("peaks", serial=True, **kw)
    import sys

    limit = sys.getrecursionlimit()
    got = train("peaks", serial=True, compile=True, **kw)
    assert sys.getrecursionlimit() == limit  # raised for inductor, given back
    assert got.step_mode.startswith("compiled") and ref.step_mode == "eager"
    assert got.batch_losses == pytest.approx(ref.batch_losses, rel=1e-9, abs=0)
    assert got.val_acc == ref.val_acc
    assert "step on cpu: compiled" in capsys.readouterr().out
    with pytest.raises(ValueError, match="`compile`.*`serial`"):
        train("peaks", serial=False, compile=True, **kw)
    with pytest.raises(ValueError, match="`compile` with `nested`"):
        train("peaks", serial=True, compile=True, nested=1, **kw)
    with pytest.raises(ValueError, match="`--compile`.*`--serial`"):
        cli.parse_args(["train", "peaks", "--compile"])
    assert cli.main(["train", "peaks", "--compile", "--nested", "1", "--serial"]) == 2
    assert "`--compile` with `--nested`" in capsys.readouterr().err


def test_training_freezes_the_collector_only_while_it_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`train` hides its setup from the cyclic collector (`gc.freeze`: before the
    clock starts and after the first step) and gives it back at the end, unless the
    caller had frozen objects itself."""
    import gc

    frozen: list[int] = []
    freeze = gc.freeze
    monkeypatch.setattr(gc, "freeze", lambda: (freeze(), frozen.append(gc.get_freeze_count())))
    gc.unfreeze()
    train("peaks", serial=True, epochs=1, n_layers=4, batch_size=1000, progress=False)
    # before the clock runs (torch, the data, the net), and after the first step
    assert len(frozen) >= 2 and frozen[0] > 0 and gc.get_freeze_count() == 0
    freeze()  # the caller's own freeze stays
    train("peaks", serial=True, epochs=1, n_layers=4, batch_size=1000, progress=False)
    assert gc.get_freeze_count() > 0
    gc.unfreeze()


# -- fast checks of the front doors ----------------------------------------------------------

def test_summary_line_round_trip() -> None:
    res = {"model": "peaks", "serial": False, "val_acc": 0.873, "train_loss": 0.321,
           "ms_per_batch": 12.34, "fwd_iters": 2.0, "fwd_res": 0.031, "bwd_iters": 1.0,
           "bwd_res": None, "ranks": 4}
    line = format_summary(res)
    assert line == ("peaks: val_acc 0.873 | train_loss 0.321 | 12.3 ms/batch | fwd iters 2 "
                    "(res 3.1e-02) | bwd iters 1 (res n/a) | ranks 4")
    back = parse_summary("noise\n" + line + "\n")
    assert back["fwd_res"] == pytest.approx(0.031) and back["bwd_res"] is None
    assert back["ranks"] == 4 and not back["serial"]
    serial = format_summary({**res, "serial": True, "ranks": 1})
    assert parse_summary(serial)["serial"]
    exact = format_summary({**res, "fwd_iters": None, "bwd_iters": None,
                            "exact_kind": "replicated serial"})
    assert "| exact (replicated serial) | ranks 4" in exact
    back = parse_summary(exact)
    assert back["exact_kind"] == "replicated serial" and back["fwd_iters"] is None
    assert parse_summary(line)["exact_kind"] is None
    unknown = format_summary({**res, "fwd_iters": None, "bwd_iters": None})  # (replayed)
    assert "fwd iters n/a (res 3.1e-02) | bwd iters n/a (res n/a)" in unknown
    assert parse_summary(unknown)["fwd_iters"] is None
    with pytest.raises(ValueError, match="`text`"):
        parse_summary("no summary here")


def test_summary_notes_say_why_training_stopped_and_what_ran(
        capsys: pytest.CaptureFixture) -> None:
    """An early stop by the time budget, steps that ran exactly and a residual that
    reads "n/a" are each explained above the summary (a new user's trial: the summary
    alone looked like a finished training with unexplained figures)."""
    one = MGRITOptions(max_levels=2, cfactor=2, max_iter=1, tol=0.0)
    got = train("peaks", fwd=one, bwd=one, epochs=3, batch_size=500, n_layers=4,
                time_budget=1e-9, progress=False)
    out = capsys.readouterr().out
    assert got.stopped_by_budget and len(got.history) == 1 and got.last_epoch_steps == 1
    assert "peaks: stopped by the time budget (1e-09 s) after" in out
    assert "in epoch 1 of 3 after 1 of its 10 batches" in out
    assert got.fwd_iters == 1 and got.fwd_res is None and "peaks: res n/a: " in out
    assert got.exact_steps == 0 and "ran sequential sweeps" not in out
    assert out.strip().splitlines()[-1] == got.summary
    # a full training: no budget note, and the iteration means of MGRIT steps only
    whole = train("peaks", fwd=one, bwd=one, epochs=1, batch_size=500, n_layers=4,
                  progress=False)
    assert not whole.stopped_by_budget and "time budget" not in capsys.readouterr().out
    mixed = dataclasses.replace(whole, exact_steps=4, exact_kind="replicated serial")
    notes = _summary_notes(mixed, None, 10, 1)
    assert any(n.startswith("4 of the last epoch's 10 steps ran replicated serial")
               for n in notes)


def test_exact_kind_names_what_a_step_ran() -> None:
    from layerpar.mgrit.result import MGRITResult

    def res(levels: int) -> MGRITResult:
        return MGRITResult(iterations=1, converged=True, n_levels=levels, timings={})

    assert _exact_kind(None) is None  # the serial oracle
    assert _exact_kind([]) == "replicated serial"
    assert _exact_kind([res(1), res(1)]) == "sequential sweeps"
    assert _exact_kind([res(1)], plain=True) == "serial autograd"  # auto, one rank
    assert _exact_kind([res(3)], plain=True) is None
    assert _exact_kind([res(1), res(3)]) is None


@pytest.mark.parametrize("flag, value", [
    ("--levels", "0"), ("--levels", "31"), ("--cfactor", "1"), ("--fwd-iters", "0"),
    ("--bwd-iters", "0"), ("--nrelax", "-1"), ("--epochs", "0"), ("--batch-size", "0"),
    ("--seed", "-1"), ("--tol", "-1"), ("--lr", "0"), ("--np", "0"),
    ("--check-every", "-1"), ("--nested", "-1"), ("--nested-epochs", "0")])
def test_bad_cli_values_name_their_option(flag: str, value: str,
                                          capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(ValueError, match=f"`{flag}`"):
        cli.parse_args(["train", "peaks", flag, value])
    assert cli.main(["train", "peaks", flag, value]) == 2
    assert f"`{flag}`" in capsys.readouterr().err


def test_example_options_checked_like_cli() -> None:
    args = add_arguments(argparse.ArgumentParser()).parse_args(["--cfactor", "1"])
    with pytest.raises(ValueError, match="`--cfactor`"):
        check_arguments(args)


def test_train_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="`model_name`"):
        train("mnist", serial=True)
    with pytest.raises(ValueError, match="`epochs`"):
        train("peaks", serial=True, epochs=0)
    with pytest.raises(ValueError, match="`lr`"):
        train("peaks", serial=True, lr=-1.0)


def test_accuracy_options_are_checked() -> None:
    with pytest.raises(ValueError, match="`--adaptive` and `--check-every`"):
        cli.parse_args(["train", "peaks", "--serial", "--adaptive"])
    with pytest.raises(ValueError, match="`check_every` must be an int >= 0"):
        train("peaks", check_every=-2)
    with pytest.raises(ValueError, match="`adaptive` and `check_every` need"):
        train("peaks", serial=True, check_every=5)
    with pytest.raises(TypeError, match="`accuracy` must be None, a bool or an"):
        train("peaks", adaptive="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`nested`=6: peaks's 32 layers must halve"):
        train("peaks", nested=6)


def test_checks_nesting_and_adaptive_decisions_reach_the_results() -> None:
    """--check-every records the gradient error per epoch; --nested trains 8 then 16
    layers (the refined net carries on); --adaptive logs its decisions."""
    got = train("peaks", epochs=1, n_layers=16, nested=1, nested_epochs=1, check_every=25,
                progress=False, adaptive=AccuracyPolicy(
                    check_every=25, min_cosine=0.9999, prefer_cheaper=False))
    assert [r["layers"] for r in got.history] == [8, 16]
    assert len(got.checks) == 4 and all(-1 <= c["cosine"] <= 1 for c in got.checks)
    assert got.history[-1]["grad_error"] == got.checks[-1]["rel_error"]
    assert got.module._runners[1].n == 16
    assert got.accuracy_log and "iterations ->" in got.accuracy_log[0]


def test_adaptive_checks_at_the_interval_asked_for() -> None:
    """--adaptive --check-every K: the controller checks every K batches (it used to keep
    its own default of 10 and ignore K)."""
    got = train("peaks", epochs=1, n_layers=16, check_every=7, adaptive=True, progress=False)
    batches = [c["batch"] for c in got.checks]
    assert len(batches) >= 3 and all(b % 7 == 0 for b in batches), batches


def test_missing_mpiexec_is_a_clear_error(monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(launch, "mpiexec_path", lambda: None)  # what job_command finds
    monkeypatch.delenv(cli.LAUNCHED_ENV, raising=False)
    for var in cli._MPI_ENV:
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(FileNotFoundError, match=r"layerpar\[mpich\]"):
        cli.launch(2, ["train", "peaks"])
    assert cli.main(["train", "peaks", "--np", "2"]) == 1
    assert "layerpar[mpich]" in capsys.readouterr().err


def test_info_reports_versions_and_engine() -> None:
    text = cli.info()
    assert f"torch {torch.__version__}" in text
    assert "native engine: ok" in text
    assert "MPI " in text or "mpi4py/MPI: not usable" in text


# -- (b) the example under MPI ------------------------------------------------------------------

@pytest.mark.mpi
def test_peaks_example_two_ranks() -> None:
    proc = run_mpi(EXAMPLES / "peaks.py", 2, "--epochs", "2", "--no-progress", timeout=120)
    s = _summary(proc)
    assert s["model"] == "peaks" and s["ranks"] == 2 and not s["serial"]
    assert s["fwd_iters"] == 2 and s["bwd_iters"] == 1
    assert s["fwd_res"] is not None and s["fwd_res"] > 0  # inexact: a residual is left
    assert 0.6 <= s["val_acc"] <= 1.0 and 0 < s["train_loss"] < 1.6


@pytest.mark.parametrize("script, argv, message", [
    ("peaks.py", ["--model", "conv"], "`--model` must be one of ['dense'] for peaks"),
    ("digits.py", ["--model", "dense"], "`--model` must be one of ['conv'] for digits"),
    ("peaks.py", ["--nested", "9"], "`--nested` 9: peaks's 32 layers must halve 9 time(s)"),
    ("peaks.py", ["--levels", "x"], "argument --levels: invalid int value: 'x'")])
def test_examples_refuse_in_one_line(script: str, argv: list[str], message: str) -> None:
    """The examples refuse what `layerpar train` refuses, in one line and exit 2 (a
    traceback on each rank before, or argparse's usage block first)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, str(EXAMPLES / script), *argv],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr


# -- (c) inexact training reaches the serial accuracy ------------------------------------------

@pytest.mark.mpi
@pytest.mark.slow  # about 25 s on 2 idle cores, 40 s on busy ones
def test_inexact_mgrit_training_matches_serial_accuracy() -> None:
    """Peaks, 20 epochs (the recipe), seed 0: 2-rank inexact MGRIT vs the serial oracle."""
    ref = train("peaks", serial=True, seed=0, progress=False)
    proc = run_mpi(EXAMPLES / "peaks.py", 2, "--levels", "3", "--cfactor", "4",
                   "--fwd-iters", "2", "--bwd-iters", "1", "--seed", "0", "--no-progress",
                   timeout=240)  # ~15 s idle; far more when other jobs share the cores
    s = _summary(proc)
    assert s["fwd_iters"] == 2 and s["bwd_iters"] == 1
    n_val = 200  # accuracies are multiples of 1/200: compare counts, not floats
    diff = abs(round(s["val_acc"] * n_val) - round(ref.val_acc * n_val))
    assert diff <= n_val // 100, f"serial {ref.val_acc:.3f} vs inexact {s['val_acc']:.3f}"


# -- (d) digits ---------------------------------------------------------------------------------

def test_digits_serial_reaches_90_percent() -> None:
    r = train("digits", serial=True, progress=False)
    assert r.val_acc >= 0.90, r.summary


@pytest.mark.mpi
def test_digits_two_ranks_inexact_reaches_90_percent() -> None:
    proc = run_mpi(EXAMPLES / "digits.py", 2, "--levels", "3", "--cfactor", "4",
                   "--fwd-iters", "2", "--bwd-iters", "1", "--no-progress", timeout=120)
    s = _summary(proc)
    assert s["ranks"] == 2 and s["val_acc"] >= 0.90, proc.stdout


# -- (e) the command line relaunches itself under mpiexec --------------------------------------

def _run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the ``layerpar`` console script (else ``python -m layerpar.cli``) in its own
    session; on a timeout kill the whole process group (mpiexec and its ranks)."""
    script = Path(sys.executable).parent / "layerpar"
    cmd = [str(script)] if script.is_file() else [sys.executable, "-m", "layerpar.cli"]
    cmd += list(args)
    env = {k: v for k, v in os.environ.items()
           if k not in (cli.LAUNCHED_ENV, *cli._MPI_ENV)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"timed out after {timeout:g} s: {cmd}\n{out}\n{err}", pytrace=False)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.mark.mpi
def test_cli_train_np2_relaunches_under_mpiexec() -> None:
    if not mpi_available():
        pytest.skip("no MPI (mpi4py and mpiexec) available")
    s = _summary(_run_cli("train", "peaks", "--np", "2", "--epochs", "1", "--no-progress"))
    assert s["model"] == "peaks" and s["ranks"] == 2 and s["fwd_iters"] == 2


@pytest.mark.mpi
def test_cli_propagates_the_jobs_exit_status() -> None:
    if not mpi_available():
        pytest.skip("no MPI (mpi4py and mpiexec) available")
    # the ranks' own parser rejects the model: every rank exits 2, and so must launch()
    assert cli.launch(2, ["train", "no-such-model"]) == 2


def test_cli_serial_runs_in_process(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["train", "digits", "--serial", "--np", "2", "--epochs", "1",
                     "--no-progress"]) == 0
    got = capsys.readouterr()
    s = parse_summary(got.out)
    assert s["serial"] and s["ranks"] == 1
    assert "--serial trains the plain net in this one process; --np 2 ignored" in got.err


def test_levels_the_net_cannot_have_are_named(capsys: pytest.CaptureFixture) -> None:
    """Asked for MGRIT levels its layers cannot have, a run says it trains exact
    propagation and why (7 layers at cf 4 did so without a word)."""
    o = MGRITOptions(max_levels=3, cfactor=4, max_iter=1)
    train("peaks", epochs=1, n_layers=7, fwd=o, bwd=o, progress=False)
    out = capsys.readouterr().out
    assert ("3 MGRIT levels asked, one built: a segment of 7 residual layers is too "
            "short to coarsen (a coarser level needs at least 2 intervals of cf 4), so "
            "every step runs exact propagation") in out, out
    # fewer levels than asked, but some: MGRIT's ordinary cap, no note
    train("peaks", epochs=1, n_layers=16, fwd=dataclasses.replace(o, max_levels=4), bwd=o,
          progress=False)
    assert "levels asked" not in capsys.readouterr().out


def test_batches_are_the_data_loaders_batches() -> None:
    """`Batches` (what ``layerpar train`` iterates) gives the batches of
    ``DataLoader(TensorDataset(...), shuffle=True, generator=g)``, in the same order,
    epoch after epoch from one generator, a short last batch included; the
    generator's state can be saved and restored to peek at an epoch's first batch."""
    from layerpar.apps.loop import Batches

    x, y = torch.randn(1000, 7), torch.randint(0, 10, (1000,))
    ref = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=128,
                                      shuffle=True, generator=torch.Generator().manual_seed(3))
    got = Batches(x, y, batch_size=128, generator=torch.Generator().manual_seed(3))
    assert len(got) == len(ref) == 8
    for _ in range(3):  # epochs: the generators move on alike
        pairs = list(zip(ref, got, strict=True))
        assert [len(b[0]) for _, b in pairs][-1] == 1000 - 7 * 128
        for (rx, ry), (gx, gy) in pairs:
            assert torch.equal(rx, gx) and torch.equal(ry, gy)
    state = got.generator.get_state()
    first = next(iter(got))[1]
    got.generator.set_state(state)
    assert torch.equal(next(iter(got))[1], first)
    # off the CPU the epoch's indices are sent at once (one copy, no wait per batch):
    # the same batches (that path, run here on the CPU)
    cpu = torch.device("cpu")
    state = got.generator.get_state()
    whole = list(got._indices(cpu, whole=True))
    got.generator.set_state(state)
    per_batch = list(got._indices(cpu))
    assert len(whole) == 8 and all(torch.equal(a, b) for a, b in zip(whole, per_batch))
    with pytest.raises(ValueError, match="same length"):
        Batches(x, y[:5], batch_size=4)


def test_captured_steps_never_wait_for_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The training loop over captured replays queues them without a host-device
    synchronisation per step (it synchronised twice a step): each step's time is a
    `SpanTimer` span (CUDA events on a GPU; `perf_counter` here, the same code path),
    read once; a batch of another shape is skipped; a `Step`'s own seconds are 0."""
    from layerpar.apps.train import _captured_steps
    from layerpar.parallel.timing import SpanTimer

    def no_sync(*a: object) -> None:
        raise AssertionError("the loop waited for the GPU")

    monkeypatch.setattr(torch.cuda, "synchronize", no_sync)

    class Replay:
        x = torch.zeros(4, 3)

        def __init__(self) -> None:
            self.calls = 0

        def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            return (x.sum() + y.sum()).float()

    class Schedule:
        steps = 0

        def step(self) -> None:
            self.steps += 1

    batches = [(torch.ones(4, 3), torch.ones(4)), (torch.ones(2, 3), torch.ones(2)),
               (torch.ones(4, 3), 2 * torch.ones(4))]
    timer, replay, schedule = SpanTimer(torch.device("cpu")), Replay(), Schedule()
    steps = list(_captured_steps(replay, batches, schedule, None, timer))
    assert replay.calls == schedule.steps == len(steps) == 2  # the short batch skipped
    assert [float(s.loss) for s in steps] == [16.0, 20.0]
    assert all(s.seconds == 0.0 and s.output is None for s in steps)
    seconds, count = timer.total()
    assert count == 2 and seconds > 0 and timer.mean() == pytest.approx(seconds / 2)


def test_span_timer_sums_its_spans() -> None:
    """`SpanTimer` on the CPU: spans summed as they are read, a `stop` without
    `start` is an error (a loop that lost track of its steps)."""
    import time

    from layerpar.parallel.timing import SpanTimer

    timer = SpanTimer(torch.device("cpu"))
    assert timer.mean() is None and timer.total() == (0.0, 0)
    for _ in range(3):
        timer.start()
        time.sleep(0.002)
        timer.stop()
    seconds, count = timer.total()
    assert count == 3 and 0.006 <= seconds < 1.0
    timer.start()
    timer.stop()
    assert timer.total()[1] == 4 and timer.total()[0] >= seconds  # read again: the same
    with pytest.raises(RuntimeError, match="without start"):
        timer.stop()


# -- the serial baseline's thread count ------------------------------------------------------


def test_thread_probe_chooses_the_fastest_count() -> None:
    from layerpar.apps.threads import fastest_threads, thread_counts

    assert thread_counts(1) == [1] and thread_counts(6) == [1, 2, 4, 6]
    assert thread_counts(8) == [1, 2, 4, 8]
    fake = {1: 0.30, 2: 0.10, 4: 0.20, 8: 0.10}  # seconds per batch at each count
    before = torch.get_num_threads()
    best, per = fastest_threads(lambda: fake[torch.get_num_threads()], [1, 2, 4, 8])
    assert (best, per) == (2, fake)  # the fastest; on a tie the fewer threads
    assert torch.get_num_threads() == before  # left as it was


def test_serial_probe_times_the_net_it_will_train() -> None:
    from layerpar.apps.threads import serial_threads, thread_counts

    rng = torch.get_rng_state()
    best, per = serial_threads("peaks", 4, batch_size=100, batches=1)
    assert sorted(per) == thread_counts() and best in per and all(s > 0 for s in per.values())
    assert torch.equal(torch.get_rng_state(), rng)  # `train` seeds after it


@pytest.mark.parametrize("env, says", [
    (None, "peaks: serial on 1 torch thread(s): its batch ran fastest here (ms at 1: 10.0, "
           "2: 20.0; `--threads` N sets it)"),
    ("1", "peaks: serial on 1 torch thread(s), as OMP_NUM_THREADS=1 asks")])
def test_cli_serial_says_its_thread_count(env: str, says: str,
                                          monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture) -> None:
    """``layerpar train --serial`` runs at the count whose batch is fastest here
    (measured at start), or as OMP_NUM_THREADS or ``--threads`` say, and says which."""
    from layerpar.apps import train as train_mod

    probed = []
    monkeypatch.setattr(train_mod, "serial_threads",
                        lambda *a, **k: probed.append(a) or (1, {1: 0.01, 2: 0.02}))
    if env is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", env)
    argv = ["train", "peaks", "--serial", "--epochs", "1", "--layers", "4", "--batch-size",
            "1000", "--no-progress"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == says, out
    assert len(probed) == (env is None)
    assert cli.main([*argv, "--threads", "1"]) == 0
    assert "peaks: serial on 1 torch thread(s), as `--threads` asks" in capsys.readouterr().out
    assert len(probed) == (env is None)  # given: not measured
