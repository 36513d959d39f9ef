"""The scalar and heat examples (`examples/01_dahlquist.py`, `examples/02_heat.py`)
print what their docstrings say: one line per MGRIT iteration, numbered by its index
from 0 as the closing ``converged in N iterations`` counts them, iteration 0 saying
that it has no residual.  The training examples are run in test_training.py and
test_sharing.py."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from mpi_util import run_mpi

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _iterations(stdout: str) -> tuple[list[int], list[int], int]:
    """(the numbered iterations, those without a residual, the closing count)."""
    lines = re.findall(r"^  iteration +(\d+)  (no residual|residual)", stdout, re.M)
    count = re.search(r"^(?:not )?converged (?:in|after) (\d+) iterations", stdout, re.M)
    assert count, stdout
    return ([int(k) for k, _ in lines], [int(k) for k, what in lines if what != "residual"],
            int(count.group(1)))


@pytest.mark.parametrize("script", ["01_dahlquist.py", "02_heat.py"])
@pytest.mark.parametrize("argv", [[], ["--levels", "1"]])
def test_iterations_numbered_as_counted(script: str, argv: list[str]) -> None:
    """Iteration 0 has no residual: with skip it does no fine-level work; at one level it
    is the one sequential sweep."""
    proc = subprocess.run([sys.executable, str(EXAMPLES / script), "--steps", "64", *argv],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    numbers, without, count = _iterations(proc.stdout)
    assert numbers == list(range(count)), proc.stdout
    assert without == [0], proc.stdout


@pytest.mark.mpi
def test_dahlquist_two_ranks_numbers_as_one() -> None:
    proc = run_mpi(EXAMPLES / "01_dahlquist.py", 2, "--steps", "64", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    numbers, without, count = _iterations(proc.stdout)
    assert numbers == list(range(count)) and without == [0], proc.stdout
