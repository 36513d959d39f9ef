"""Command lines check their values first (issue 10, items 10 and 11).

``layerpar train``, ``layerpar scale`` and ``python -m layerpar.bench`` refuse a bad
value before anything runs, with one line naming the option and exit status 2:
``--np`` above the layer count, values the engine's C ints or torch's 64-bit seeds
cannot hold, a negative warm-up, a zero timeout, rank counts above every layer count,
31 levels, a NaN learning rate, zero repeats, an unwritable CSV.

Measurements are replaced by a function that fails the test if called.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from layerpar.apps import bench, cli
from layerpar.apps.studies import cli as scale_cli
from layerpar.apps.studies import perfmodel as pmodel
from layerpar.apps.studies import runner
from layerpar.apps.train import RECIPES, train


class Measured(Exception):
    """Raised by the stand-ins of every measurement: the command got past its checks."""


def _measured(*args: Any, **kwargs: Any) -> Any:
    raise Measured("a measurement started")


# --- layerpar train ---------------------------------------------------------------------------


@pytest.mark.parametrize("model", sorted(RECIPES))
def test_train_np_above_the_layer_count(model: str, capsys: pytest.CaptureFixture) -> None:
    layers = RECIPES[model].n_layers
    cli.parse_args(["train", model, "--np", str(layers)])  # one layer per rank: fine
    with pytest.raises(ValueError, match=rf"`--np` must be <= {layers}"):
        cli.parse_args(["train", model, "--np", str(layers + 1)])
    assert cli.main(["train", model, "--np", str(layers + 1)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "`--np`" in err, err


@pytest.mark.parametrize("flag,value", [
    ("--seed", 2**64), ("--seed", 2**70), ("--cfactor", 2**31), ("--fwd-iters", 2**31),
    ("--bwd-iters", 2**40), ("--nrelax", 2**31)])
def test_train_values_beyond_what_is_held(flag: str, value: int,
                                          capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(ValueError, match=f"`{flag}` must be <="):
        cli.parse_args(["train", "peaks", flag, str(value)])
    assert cli.main(["train", "peaks", flag, str(value)]) == 2
    assert f"`{flag}`" in capsys.readouterr().err


def test_train_function_seed_bound() -> None:
    with pytest.raises(ValueError, match=r"`seed` must be an int in \[0, 2\*\*64 - 1\]"):
        train("peaks", serial=True, epochs=1, seed=2**64)
    cli.parse_args(["train", "peaks", "--seed", str(2**64 - 1)])  # the largest is fine


# --- layerpar scale ---------------------------------------------------------------------------


@pytest.fixture
def no_measuring(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "serial_baseline", _measured)
    monkeypatch.setattr(pmodel, "measure_costs", _measured)
    monkeypatch.setattr(runner, "_launch", _measured)
    monkeypatch.setattr(runner, "run_pingpong", _measured)


SCALE_BAD = [
    (["--warmup", "-1"], "`--warmup` must be >= 0"),
    (["--steps", "0"], "`--steps` must be >= 1"),
    (["--diag-iters", "-2"], "`--diag-iters` must be in [0, "),
    (["--timeout", "0"], "`--timeout` must be a finite number of seconds > 0"),
    (["--timeout", "nan"], "`--timeout`"),
    (["--timeout", "-5"], "`--timeout`"),
    (["--ranks", "1,8", "--layers", "4"], "`--ranks` 8 is more than every layer count (4)"),
    (["--levels", "31"], "`--levels` must be in [1, 30]"),
    (["--levels", "0"], "`--levels` must be in [1, 30]"),
    (["--cfactor", "1"], "`--cfactor` must be in [2, "),
    (["--cfactor", str(2**31)], "`--cfactor` must be in [2, 2147483647]"),
    (["--fwd-iters", str(2**31)], "`--fwd-iters` must be in [1, 2147483647]"),
    (["--layers", str(2**31)], "`--layers` must be in [1, 2147483646]"),
    (["--lr", "nan"], "`--lr` must be a finite number > 0"),
    (["--lr", "0"], "`--lr`"),
    (["--seed", str(2**64)], "`--seed` must be in [0, 18446744073709551615]"),
    (["--seed", "-1"], "`--seed`"),
    (["--model", "resnet"], "`--model` must be one of"),
    (["--width", "0"], "`--width` must be >= 1"),
    # refused in a line, not an allocator's traceback minutes in
    (["--width", str(2**31)], "`--layers` 64 x `--width` 2147483648 (batch 16): a run needs"),
    (["--max-cores", "0"], "`--max-cores` must be a whole number >= 1"),
    (["--max-cores", "1", "--ranks", "2", "--threads", "1"], "the grid has no run"),
    (["--serial-threads", "0"], "`--serial-threads` must be >= 1"),
    (["--levels", "2.5"], "`--levels` takes comma-separated integers"),
]


@pytest.mark.parametrize("argv,message", SCALE_BAD, ids=[" ".join(a) for a, _ in SCALE_BAD])
def test_scale_bad_value_is_one_line_exit_2(argv: list[str], message: str, tmp_path: Path,
                                            capsys: pytest.CaptureFixture,
                                            no_measuring: None) -> None:
    out = tmp_path / "study"
    args = scale_cli.build_parser().parse_args(
        ["--quick", "--no-progress", "--no-plots", "--out", str(out), *argv])
    assert scale_cli.run(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("python -m layerpar.studies: error: ") and message in err, err
    assert not out.exists()  # refused before anything was created


def test_scale_through_the_layerpar_command(tmp_path: Path, capsys: pytest.CaptureFixture,
                                            no_measuring: None) -> None:
    code = cli.main(["scale", "--quick", "--warmup", "-1", "--out", str(tmp_path / "s")])
    err = capsys.readouterr().err
    assert code == 2 and err == "layerpar scale: error: `--warmup` must be >= 0, got -1\n"


def test_scale_ranks_above_some_layer_counts_still_runs_the_rest() -> None:
    runs = runner.expand_grid({"ranks": [1, 4], "layers": [2, 8]})
    assert sorted((r["ranks"], r["layers"]) for r in runs) == [(1, 2), (1, 8), (4, 8)]


def test_study_api_names_grid_keys() -> None:
    with pytest.raises(ValueError, match="`warmup` must be >= 0"):
        runner.expand_grid({"warmup": -1})
    with pytest.raises(ValueError, match="`timeout_per_run` must be a finite number > 0"):
        runner.run_study({"ranks": [1], "layers": 4}, "unused.csv", timeout_per_run=0)


def test_study_seed_beyond_float_precision_resumes_exactly() -> None:
    seed = 2**64 - 1  # float(seed) rounds it: keys must compare exactly
    assert runner._canon(seed) == runner._canon(str(seed)) == str(seed)
    assert runner._canon(seed) != runner._canon(seed - 1)
    assert runner._typed({"seed": str(seed)})["seed"] == seed


# --- python -m layerpar.bench -----------------------------------------------------------------


@pytest.mark.parametrize("argv,flag", [
    (["--repeats", "0"], "--repeats"), (["--repeats", "-3"], "--repeats"),
    (["--threads", "0"], "--threads"),
    (["--csv", "/nonexistent-folder/bench.csv"], "--csv"), (["--csv", "."], "--csv")])
def test_bench_bad_value_before_any_measurement(argv: list[str], flag: str,
                                                monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(bench, "run", _measured)
    with pytest.raises(SystemExit) as info:
        bench.main(argv)
    assert info.value.code == 2
    assert f"error: `{flag}`" in capsys.readouterr().err


@pytest.mark.parametrize("argv,flag", [
    (["ops", "--quick", "--csv", "."], "--csv"),
    (["engines", "--quick", "--csv", "/nonexistent-folder/x.csv"], "--csv"),
    (["gpu", "--unmeasured", "--csv", "."], "--csv"), (["gpu", "--models", ","], "--models"),
    (["paths", "--quick", "--timeout", "0"], "--timeout"),
    (["paths", "--quick", "--timeout", "nan"], "--timeout"),
    (["paths", "--quick", "--csv", "."], "--csv"),
    (["grid", "--quick", "--np", "3"], "--np"), (["grid", "--timeout", "-1"], "--timeout"),
    (["grid", "--quick", "--csv", "."], "--csv"),
    (["sync", "--quick", "--gbits", "inf"], "--gbits"),
    (["sync", "--quick", "--gbits", "1e-300"], "--gbits"),
    (["sync", "--quick", "--batches", "0"], "--batches"),
    (["sync", "--quick", "--layers", "0"], "--layers"),
    (["sync", "--quick", "--csv", "."], "--csv"),
    (["sync", "--quick", "--timeout", "inf"], "--timeout"),
    (["--threads", "99999999999"], "--threads")])
def test_bench_subcommands_refuse_before_running(argv: list[str], flag: str,
                                                capsys: pytest.CaptureFixture) -> None:
    """Every benchmark command refuses a bad value or an output it cannot write in one
    line naming the option, exit 2, before it measures anything (a `--csv` folder used
    to end the whole measurement in a traceback, `--batches 0` silently meant 14)."""
    with pytest.raises(SystemExit) as info:
        bench.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"error: `{flag}`" in err and "Traceback" not in err
    # one line, as README promises for every command (argparse's usage block came first)
    assert err.count("\n") == 1 and err.startswith("python -m layerpar.bench"), err


@pytest.mark.parametrize("argv,message", [
    (["grid", "--np", "0"], "`--np` must be >= 1, got 0"),
    (["tta", "--np", "0"], "`--np` must be >= 1, got 0"),
    (["ops", "--bogus"], "unrecognized arguments: --bogus"),
    (["tta", "--smoke", "--cases", "d", "--np", "64"],
     "case d at `--np` 64, auto: `--np` must be <= 32, the number of residual layers of "
     "peaks"),
])
def test_bench_errors_are_one_line(argv: list[str], message: str, tmp_path: Path,
                                   capsys: pytest.CaptureFixture) -> None:
    """argparse's own errors too; and `bench tta --np N` with more ranks than a case has
    layers is refused before any training (it trained serial, then failed in 64 MPI
    ranks' tracebacks)."""
    with pytest.raises(SystemExit) as info:
        bench.main([*argv, *(["--out", str(tmp_path / "o")] if argv[0] == "tta" else [])])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert err.startswith(f"python -m layerpar.bench {argv[0]}: error: "), err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("argv", [["--quick"], ["ops", "--quick"], ["grid", "--quick"],
                                  ["engines", "--quick"], ["gpu", "--unmeasured"],
                                  ["sync", "--quick"], ["paths", "--quick"]])
def test_bench_csv_refuses_a_file_that_is_no_benchmarks_csv(argv: list[str], tmp_path: Path,
                                                            capsys: pytest.CaptureFixture
                                                            ) -> None:
    """`--csv` replaced whatever was there (a person's notes, the repository's README
    given by mistake, a person's own CSV table); now only the same benchmark's earlier
    CSV (its first columns) is replaced, anything else refused before running."""
    for text in ("my precious notes\n", "# layerpar\n\nsome prose, with a comma\n",
                 "name,value\nfoo,1\n", "model,layers\nmine,3\n"):
        mine = tmp_path / "mine.csv"
        mine.write_text(text)
        with pytest.raises(SystemExit) as info:
            bench.main([*argv, "--csv", str(mine)])
        assert info.value.code == 2 and mine.read_text() == text
        err = capsys.readouterr().err
        assert "exists and is not this benchmark's CSV" in err and "Traceback" not in err


def test_check_output_file_replaces_a_benchmarks_csv(tmp_path: Path) -> None:
    from layerpar.apps.studies.files import StudyFileError, check_output_file

    for text in ("benchmark,case,ranks,steps\nx,y,1,2\n", "benchmark,case,ranks\r\n1,2,3\r\n",
                 ""):
        path = tmp_path / "old.csv"
        path.write_text(text)
        assert check_output_file(path, "--csv", header="benchmark,case,ranks") == path
    path.write_text("benchmark,case,rankings\n1,2,3\n")  # another table's columns
    with pytest.raises(StudyFileError, match="does not start with the columns"):
        check_output_file(path, "--csv", header="benchmark,case,ranks")


def test_check_output_file_leaves_an_existing_file_as_it_was(tmp_path: Path) -> None:
    from layerpar.apps.studies.files import StudyFileError, check_output_file

    mine = tmp_path / "mine.csv"
    mine.write_text("my notes\n")
    assert check_output_file(mine, "--csv") == mine and mine.read_text() == "my notes\n"
    check_output_file(tmp_path / "new.csv", "--csv")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.csv"]  # no probe left
    with pytest.raises(StudyFileError, match="`--csv` .* is a folder"):
        check_output_file(tmp_path, "--csv")
    with pytest.raises(StudyFileError, match="its folder .* does not exist"):
        check_output_file(tmp_path / "no" / "x.csv", "--csv")


@pytest.mark.parametrize("argv, message", [
    (["--np", "4", "--data-parallel", "3"], "`--data-parallel` 3 must divide `--np` 4"),
    (["--np", "4", "--data-parallel", "0"], "`--data-parallel` must be >= 1"),
    (["--np", "2", "--data-parallel", "2", "--batch-size", "5"],
     "the batch size 5 must be divisible by `--data-parallel` 2"),
    (["--np", "66", "--data-parallel", "2"],
     "`--np` / `--data-parallel` (ranks per replica) must be <= 32"),
    (["--np", "4", "--data-parallel", "2", "--adaptive"],
     "`--adaptive` decides from each replica's own batches: not with `--data-parallel`"),
    (["--np", "4", "--data-parallel", "2", "--auto"],
     "`--auto` chooses layer-parallel settings: not with `--serial`"),
    # it trained serially on every process, the replicas dropped without a word
    (["--np", "2", "--data-parallel", "2", "--serial"],
     "`--data-parallel` makes replicas of a layer-parallel model: not with `--serial`"),
])
def test_train_data_parallel_values(argv: list[str], message: str,
                                    capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["train", "peaks", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_train_launcher_choices(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        cli.parse_args(["train", "peaks", "--launcher", "srun"])
    assert "invalid choice: 'srun'" in capsys.readouterr().err
    assert cli.parse_args(["train", "peaks", "--np", "2", "--launcher",
                           "torchrun"]).launcher == "torchrun"


def test_torchrun_workers_do_not_get_the_launch_options() -> None:
    argv = ["train", "peaks", "--np", "4", "--launcher=torchrun", "--data-parallel", "2"]
    assert cli._without(argv, "--np", "--launcher") == ["train", "peaks",
                                                        "--data-parallel", "2"]


@pytest.mark.parametrize("kw, err, message", [
    ({"data_parallel": 0}, ValueError, "`data_parallel` must be a positive int, got 0"),
    ({"data_parallel": True}, TypeError, "`data_parallel` must be a positive int, got bool"),
    ({"data_parallel": 2, "batch_size": 5}, ValueError,
     "`data_parallel`=2 must divide the 1 process(es)"),
])
def test_train_function_data_parallel(kw: dict, err: type, message: str) -> None:
    from layerpar.apps.train import train

    with pytest.raises(err, match=re.escape(message)):
        train("peaks", epochs=1, **kw)


# --- late failures turned into one line before any process starts (issue 16, item 9) ----


def test_train_nested_beyond_the_layers(capsys: pytest.CaptureFixture) -> None:
    layers = RECIPES["peaks"].n_layers  # 32: halves 5 times to 1 layer
    cli.parse_args(["train", "peaks", "--nested", "3", "--np", "4"])  # 4 layers, 4 ranks
    for argv in (["--nested", "4", "--np", "4"], ["--nested", "6"]):
        with pytest.raises(ValueError, match=rf"`--nested` {argv[1]}: peaks's {layers} "):
            cli.parse_args(["train", "peaks", *argv])
        assert cli.main(["train", "peaks", *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "`--nested`" in err, err


def test_train_data_parallel_not_dividing_a_torchrun_job(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    # a process that a bare torchrun started: the job's size (WORLD_SIZE) decides
    for var, value in (("RANK", "0"), ("WORLD_SIZE", "3"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", "29500"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(var, value)
    for var in ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match=r"`--data-parallel` 2 must divide the job's "
                                         r"processes \(3\)"):
        cli.parse_args(["train", "peaks", "--data-parallel", "2"])
    assert cli.main(["train", "peaks", "--data-parallel", "2"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    cli.parse_args(["train", "peaks", "--data-parallel", "3", "--batch-size", "60"])


def test_train_timeout_flag(capsys: pytest.CaptureFixture) -> None:
    assert cli.parse_args(["train", "peaks", "--timeout", "30"]).timeout == 30.0
    for bad in ("0", "-1", "nan", "inf"):
        assert cli.main(["train", "peaks", "--timeout", bad]) == 2
        assert "`--timeout` must be a positive number" in capsys.readouterr().err


def test_bench_only_an_unknown_benchmark(monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(bench, "run", _measured)
    with pytest.raises(SystemExit) as exc:
        bench.main(["--only", "bogus"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "`--only` bogus: no such benchmark" in err


def test_accuracy_policy_bound_message() -> None:
    from layerpar.parallel.adaptive import AccuracyPolicy

    with pytest.raises(ValueError, match=r"max_rel_error` must be a finite number > 0, "
                                         r"got inf"):
        AccuracyPolicy(max_rel_error=float("inf"))


# --- sizes, engines and options that act only with another (a new user's trial) -----------


@pytest.mark.parametrize("argv, message", [
    (["--layers", "-3"], "`--layers` must be >= 1, got -3"),  # not an `--np` message
    (["--layers", str(2**31)], "`--layers` must be <= 2147483647"),
    (["--width", str(2**31)], "`--width` must be <= 2147483647"),
    (["--layers", str(10**9)], "`--layers` 1000000000 x `--width` 8: the net needs about"),
    (["--layers", "1000", "--width", str(10**6)], "the net needs about"),
    (["--sync", "daso"], "`--sync` acts between data replicas"),
    (["--slow-link", "1"], "`--slow-link` acts between data replicas"),
    (["--launcher", "torchrun"], "`--launcher` torchrun starts the processes of `--np`"),
    (["--nested-epochs", "3"], "`--nested-epochs` sets the epochs of each `--nested`"),
    (["--auto", "--check-every", "5"], "`--check-every` with `--auto`: auto spreads"),
    # the settings auto chooses itself, even at their defaults' values, were ignored
    (["--auto", "--levels", "3"], "`--levels` with `--auto`: auto chooses the MGRIT"),
    (["--auto", "--fwd-iters", "3"], "`--fwd-iters` with `--auto`"),
    (["--cfactor", "8", "--auto"], "`--cfactor` with `--auto`"),
    (["--auto", "--tol=0"], "`--tol` with `--auto`"),
    (["--auto", "--engine", "native"], "`--engine` with `--auto`"),
    # the serial oracle ran and dropped them without a word
    (["--serial", "--levels", "2"], "`--levels` with `--serial`: the serial oracle runs no"),
    (["--serial", "--tol", "1e-3"], "`--tol` with `--serial`"),
    (["--serial", "--engine", "xbraid"], "`--engine` with `--serial`"),
    (["--nodes", "1"], "`--nodes` acts between data replicas"),
])
def test_train_refuses_in_one_line_before_building(argv: list, message: str,
                                                   capsys: pytest.CaptureFixture) -> None:
    """Each of these used to run (building 10^9 layers; ignoring the option) or end in a
    traceback; now one line naming the option, exit 2, before any layer is built."""
    with pytest.raises(ValueError, match=re.escape(message)):
        cli.parse_args(["train", "peaks", *argv])
    assert cli.main(["train", "peaks", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_train_engine_xbraid_not_built_is_one_line(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture) -> None:
    from layerpar.apps import train as train_mod

    monkeypatch.setattr(train_mod, "xbraid_available", lambda: False)
    with pytest.raises(ValueError, match="`--engine` xbraid: layerpar's XBraid engine was "
                                         "not built: build it from an XBraid source tree"):
        cli.parse_args(["train", "peaks", "--engine", "xbraid"])
    assert cli.main(["train", "peaks", "--engine", "xbraid"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_argparse_errors_are_one_line(capsys: pytest.CaptureFixture) -> None:
    """An unknown problem or a value of the wrong type: argparse's own errors read like
    every checked value's (one line, ``layerpar: error:``, exit 2), not the usage block
    first under another prefix."""
    for argv, message in ((["train", "cifar10"], "invalid choice: 'cifar10'"),
                          (["train", "peaks", "--layers", "x"], "invalid int value: 'x'"),
                          (["bogus"], "invalid choice: 'bogus'")):
        with pytest.raises(SystemExit) as info:
            cli.parse_args(argv)
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("layerpar: error: "), err
        assert message in err and "usage" not in err and "--help" in err, err


@pytest.mark.parametrize("env, says", [
    ({}, True), ({"PMI_RANK": "0", "PMI_SIZE": "2"}, True),
    ({"PMI_RANK": "1", "PMI_SIZE": "2"}, False),
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4"}, False),
    ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, False),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, True),
    ({"RANK": "1"}, True)])  # RANK alone is no torchrun job: say it
def test_a_jobs_bad_command_line_is_said_once(env: dict, says: bool,
                                              monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture) -> None:
    """Under ``mpiexec -n 2 layerpar train ...`` every rank refuses a bad value alike;
    rank 0 alone says it (each rank printed the line)."""
    for name in ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "PMIX_SIZE", "OMPI_COMM_WORLD_RANK",
                 "OMPI_COMM_WORLD_SIZE", "RANK", "WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", cli.LAUNCHED_ENV):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert cli.main(["train", "peaks", "--layers", "-1"]) == 2
    err = capsys.readouterr().err
    assert err == ("layerpar: error: `--layers` must be >= 1, got -1\n" if says else ""), err


@pytest.mark.parametrize("built", [True, False], ids=["xbraid-built", "xbraid-not-built"])
@pytest.mark.parametrize("argv, message", [
    (["--np", "2", "--adaptive"], "`--engine xbraid` with `--adaptive`"),
    (["--adaptive"], "`--engine xbraid` with `--adaptive`"),
    (["--np", "4", "--data-parallel", "2"], "`--engine xbraid` with `--data-parallel`"),
    (["--np", "2", "--launcher", "torchrun"], "`--engine xbraid` with `--launcher torchrun`"),
    (["--np", "3"], "a segment of 32 layers on 3 ranks would give a rank different layers"),
    (["--np", "4", "--layers", "20", "--nested", "1"], "a segment of 10 layers on 4 ranks"),
    (["--serial"], "`--engine` with `--serial`"),
    (["--auto"], "`--engine` with `--auto`"),
])
def test_xbraid_runs_it_cannot_do_are_one_line(argv: list, message: str, built: bool,
                                               monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture) -> None:
    """What XBraid cannot run ended in a traceback on every rank (its LayerParallel
    refused it); now one line before any process starts, exit 2.  A conflict between
    options is a usage error: the same line whether or not the XBraid engine was built
    (not "was not built" on a clone without XBraid beside it)."""
    from layerpar.apps import train as train_mod

    monkeypatch.setattr(train_mod, "xbraid_available", lambda: built)
    assert cli.main(["train", "peaks", "--engine", "xbraid", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


# --- one training configuration: TrainConfig, from argv or keywords ----------------------


def _keywords(message: str) -> str:
    """`message` with each command-line flag in backticks spelt as its keyword."""
    from layerpar.apps.config import _FLAGS

    keyword = {flag: name for name, flag in reversed(list(_FLAGS.items()))}
    keyword.update({"--adaptive": "adaptive", "--model": "arch", "--layers": "n_layers"})
    return re.sub(r"`(--[a-z-]+)`", lambda m: f"`{keyword[m.group(1)]}`", message)


CONFLICTS = [
    (["--compile"], {"compile": True}),
    (["--serial", "--compile", "--nested", "1"], {"serial": True, "compile": True,
                                                  "nested": 1}),
    (["--serial", "--adaptive"], {"serial": True, "adaptive": True}),
    (["--serial", "--check-every", "3"], {"serial": True, "check_every": 3}),
    (["--auto", "--check-every", "5"], {"auto": True, "check_every": 5}),
    (["--auto", "--nested", "1"], {"auto": True, "nested": 1}),
    (["--np", "2", "--adaptive", "--data-parallel", "2"], {"adaptive": True,
                                                          "data_parallel": 2}),
    (["--sync", "daso"], {"sync": "daso"}),
    (["--slow-link", "1"], {"slow_link": 1.0}),
    (["--nested-epochs", "3"], {"nested_epochs": 3}),
    (["--serial", "--engine", "xbraid"], {"serial": True, "engine": "xbraid"}),
    (["--auto", "--engine", "native"], {"auto": True, "engine": "native"}),
    (["--schedule", "gpipe"], {"schedule": "gpipe"}),
    (["--microbatches", "2", "--method", "data"], {"microbatches": 2, "method": "data"}),
    (["--method", "data", "--serial"], {"method": "data", "serial": True}),
    (["--method", "pipeline", "--adaptive"], {"method": "pipeline", "adaptive": True}),
    (["--method", "data", "--nested", "1"], {"method": "data", "nested": 1}),
    (["--method", "pipeline", "--engine", "native"], {"method": "pipeline",
                                                      "engine": "native"}),
]


@pytest.mark.parametrize("method", ["data", "pipeline"])
def test_train_method_needs_two_processes(method: str) -> None:
    with pytest.raises(ValueError, match=f'`--method` "{method}" shares the work'):
        cli.parse_args(["train", "peaks", "--method", method])
    cli.parse_args(["train", "peaks", "--method", method, "--np", "2"])  # fine


@pytest.mark.parametrize("argv, kw", CONFLICTS, ids=[" ".join(a) for a, _ in CONFLICTS])
def test_a_conflict_is_one_rule_for_argv_and_keywords(argv: list, kw: dict) -> None:
    """Each conflict between options is written once (`TrainConfig`): the command line
    and the Python API raise the same message, naming flags and keywords alike."""
    from layerpar.apps.config import TrainConfig

    with pytest.raises(ValueError) as by_argv:
        cli.parse_args(["train", "peaks", *argv])
    with pytest.raises(ValueError) as by_keywords:
        TrainConfig(model="peaks", **kw)
    assert "`--" in str(by_argv.value) and "`--" not in str(by_keywords.value)
    assert _keywords(str(by_argv.value)) == str(by_keywords.value)
    with pytest.raises(ValueError, match=re.escape(str(by_keywords.value))):
        train("peaks", **kw)  # refused before anything is built


def test_train_config_is_frozen_resolved_and_the_same_from_both_doors() -> None:
    import dataclasses

    from layerpar.apps.config import TrainConfig

    got = TrainConfig.from_args(cli.parse_args(["train", "peaks", "--epochs", "2", "--lr",
                                                "0.01", "--layers", "8", "--float64"]))
    import torch

    assert got == TrainConfig(model="peaks", epochs=2, lr=0.01, n_layers=8,
                              dtype=torch.float64)
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.epochs = 3  # type: ignore[misc]
    plain = TrainConfig(model="peaks")  # the recipe's values, resolved
    r = RECIPES["peaks"]
    assert (plain.epochs, plain.batch_size, plain.lr, plain.optimizer,
            plain.nested_epochs) == (r.epochs, r.batch_size, r.lr, "adam", 2)
    assert TrainConfig(model="peaks", data_parallel=2, sync="lioncub").lr == r.lr / 3
    assert plain.fwd is None and plain.mgrit_options()[0].max_iter == 2


@pytest.mark.parametrize("argv, kw, flag, keyword", [
    (["--check-every", "-1"], {"check_every": -1}, "--check-every", "check_every"),
    (["--layers", "0"], {"n_layers": 0}, "--layers", "n_layers"),
    (["--model", "conv"], {"arch": "conv"}, "--model", "arch"),
    (["--threads", "0"], {"threads": 0}, "--threads", "threads"),
    (["--target-acc", "2"], {"target_acc": 2.0}, "--target-acc", "target_acc"),
    (["--data-parallel", "2", "--nodes", "3", "--np", "2"], {"data_parallel": 2,
                                                            "nodes": 3}, "--nodes", "nodes"),
])
def test_train_config_names_the_flag_or_the_keyword(argv: list, kw: dict, flag: str,
                                                    keyword: str,
                                                    capsys: pytest.CaptureFixture) -> None:
    from layerpar.apps.config import TrainConfig

    assert cli.main(["train", "peaks", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"layerpar: error: `{flag}`") and err.count("\n") == 1, err
    with pytest.raises(ValueError, match=f"^`{keyword}`"):
        TrainConfig(model="peaks", **kw)


def test_threads_flag_is_checked(capsys: pytest.CaptureFixture) -> None:
    from layerpar.apps.config import TrainConfig

    for bad in ("0", "-2", str(2**31)):
        assert cli.main(["train", "digits", "--serial", "--threads", bad]) == 2
        assert "`--threads` must be" in capsys.readouterr().err
    assert cli.parse_args(["train", "digits", "--serial", "--threads", "3"]).threads == 3
    with pytest.raises(TypeError, match="`threads` must be an int"):
        TrainConfig(model="digits", threads=1.5)
    with pytest.raises(ValueError, match="`threads`='best' measures the serial net: give "
                                         "`serial`"):
        TrainConfig(model="digits", threads="best")
