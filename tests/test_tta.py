"""The time-to-accuracy benchmark (``python -m layerpar.bench tta``), tiny: serial
and ``--auto`` at 2 ranks on an 8-layer Peaks net for one epoch, each in a process of
its own (the serial baseline's thread count given, not probed), then the CSVs, the
plot and the README table; and its bad values."""
from __future__ import annotations

import csv
from pathlib import Path

import pytest

from layerpar.apps import bench, tta
from layerpar.apps.launch import mpiexec_path


@pytest.mark.mpi
def test_tta_tiny(tmp_path: Path) -> None:
    if mpiexec_path() is None:
        pytest.skip("no mpiexec")
    case = tta.Case("t", "peaks", "Peaks tiny", 1, ("--layers", "8", "--batch-size", "500"))
    lines: list[str] = []
    # the thread-count probe (best_threads) is left out here: the smoke run has it
    runs, target, per = tta.run_case(case, 2, timeout=120, say=lines.append,
                                     probe=(1, {1: 0.01}, 10))
    serial, auto = runs
    assert serial.ranks == 1 and auto.ranks == 2 and serial.threads == 1
    assert target == pytest.approx(serial.best_acc - 0.005)
    for r in runs:
        assert len(r.history) == 1 and 0 < r.history[0]["train_seconds"] < r.wall_seconds
    # exact propagation computes what serial training computes: the same accuracy
    assert auto.final_acc == pytest.approx(serial.final_acc, abs=0.01)
    assert any(line.startswith("auto: chose ") for line in auto.log), auto.log
    assert serial.to_target(target)[1] == 1
    tta._write(tmp_path, [(case, runs, target)], "python -m layerpar.bench tta (test)",
               True, "0")
    rows = list(csv.DictReader(open(tmp_path / "summary.csv")))
    assert [r["method"] for r in rows] == [serial.method, auto.method]
    assert rows[0]["time_vs_serial"] == "1.00" and rows[1]["settings"] == auto.settings
    text = (tmp_path / "README.md").read_text()
    assert "SMOKE RUN" in text and "| t | serial" in text
    assert (tmp_path / "tta.png").stat().st_size > 0
    assert len(list(csv.DictReader(open(tmp_path / "tta.csv")))) == 2


@pytest.mark.parametrize("argv,flag", [(["--cases", "z"], "--cases"),
                                       (["--np", "0"], "--np"),
                                       (["--timeout", "0"], "--timeout"),
                                       (["--bounds", "x"], "--bounds")])
def test_tta_bad_values(argv: list[str], flag: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.main(["tta", *argv])
    assert exc.value.code == 2 and f"`{flag}`" in capsys.readouterr().err
