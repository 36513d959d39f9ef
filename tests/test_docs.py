"""The user documentation runs as written: README.md and the guide (docs/guide/*.md).

Convention: every fenced ```python block of README.md and docs/guide/*.md is a complete
script and is run, at one rank, from an empty folder; a block that cannot run here (it
needs CUDA, torchrun or a grid of processes, or is a fragment) is marked by an HTML
comment starting ``<!-- not run`` on the line right before its fence, saying why.  The
README's first script is also run at 2 ranks under ``mpiexec -n 2 python -m mpi4py``
and must print the same line as at one rank (results do not depend on the rank count).

Also: README.md stays short (under 300 lines), and every ``docs/...`` path that README.md
and the guide mention in their prose, and every relative link target, exists.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from mpi_util import run_mpi

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs" / "guide").glob("*.md"))]
NOT_RUN = "<!-- not run"
FENCE = re.compile(r"^```(\w*)\s*$")


def _blocks(page: Path) -> list[tuple[int, str, bool]]:
    """(line number, code, runs) of every fenced ```python block of `page`."""
    lines = page.read_text().splitlines()
    out: list[tuple[int, str, bool]] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        if m.group(1) == "python":
            runs = not (i > 0 and lines[i - 1].lstrip().startswith(NOT_RUN))
            out.append((i + 1, "\n".join(lines[i + 1:end]) + "\n", runs))
        i = end + 1
    return out


def _prose(page: Path) -> str:
    """`page` without its fenced blocks (commands there may name outputs to be made)."""
    text, keep = [], True
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            keep = not keep
            continue
        if keep:
            text.append(line)
    return "\n".join(text)


SCRIPTS = [pytest.param(page, line, code, id=f"{page.relative_to(ROOT)}:{line}")
           for page in PAGES for line, code, runs in _blocks(page) if runs]


def _env() -> dict[str, str]:
    """The environment of a documented script: this checkout first on the path, one
    thread (the machine runs other tests beside it)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")


def test_every_page_has_its_blocks_marked() -> None:
    """The convention holds: the README's first script runs, and every block that does
    not is marked with a reason."""
    first = _blocks(ROOT / "README.md")[0]
    assert first[2], "README.md's first python block must run as written"
    for page in PAGES:
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.lstrip().startswith(NOT_RUN):
                assert lines[i + 1].startswith("```"), f"{page}:{i + 1}: marker not before a fence"
                assert len(line.strip()) > len(NOT_RUN + " -->"), f"{page}:{i + 1}: no reason"


@pytest.mark.parametrize("page,line,code", SCRIPTS)
def test_documented_script_runs_at_one_rank(page: Path, line: int, code: str,
                                            tmp_path: Path) -> None:
    script = tmp_path / "doc_script.py"
    script.write_text(code)
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (f"{page.name}:{line} failed:\n{proc.stdout[-2000:]}"
                                  f"\n{proc.stderr[-4000:]}")


def test_readme_first_script_at_two_ranks(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The first script prints one line, on rank 0, the same at 1 and 2 ranks."""
    code = _blocks(ROOT / "README.md")[0][1]
    script = tmp_path / "first.py"
    script.write_text(code)
    for name, value in _env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)
    one = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=300)
    assert one.returncode == 0, one.stderr[-4000:]
    two = run_mpi(script, 2, timeout=300)
    assert two.returncode == 0, f"{two.stdout[-2000:]}\n{two.stderr[-4000:]}"
    line_one = one.stdout.strip().splitlines()
    line_two = two.stdout.strip().splitlines()
    assert len(line_one) == 1 and len(line_two) == 1, (one.stdout, two.stdout)
    # the residual is a sum over ranks: equal up to round-off, so compare what precedes it
    assert line_one[0].split(", residuals")[0] == line_two[0].split(", residuals")[0]


def test_readme_is_short() -> None:
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n < 300, f"README.md has {n} lines: move detail into docs/guide/"


DOCS_PATH = re.compile(r"(?<![\w/.])docs/[\w./-]*[\w/]")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_mentioned_paths_exist(page: Path) -> None:
    prose = _prose(page)
    missing = [p for p in DOCS_PATH.findall(prose) if not (ROOT / p).exists()]
    for target in LINK.findall(prose):
        if "://" not in target and not (page.parent / target).exists():
            missing.append(target)
    assert not missing, f"{page.relative_to(ROOT)} mentions paths that do not exist: {missing}"


def test_every_readme_figure_is_in_a_result_file() -> None:
    """A figure README states (a number with a unit: ms, s, %, ×, x) is one a file
    under docs/results/ shows, so no claim outlives the run that measured it.  Code
    blocks (commands, example output) are left out; so are one-digit integers
    ("2 ranks", "3 levels"), which are settings, not measurements."""
    text = re.sub(r"```.*?```", "", (ROOT / "README.md").read_text(), flags=re.S)
    figures = set(re.findall(r"(\d[\d,]*\.\d+|\d{2,}[\d,]*)\s*(?:ms|s\b|%|×|x\b)", text))
    assert len(figures) > 10  # the pattern still finds README's figures
    results = [p for p in (ROOT / "docs" / "results").rglob("*")
               if p.is_file() and p.suffix in (".md", ".txt", ".csv", ".json")]
    corpus = "\n".join(p.read_text(errors="ignore") for p in results).replace(",", "")
    missing = sorted(f for f in figures if f.replace(",", "") not in corpus)
    assert not missing, f"README states figures no file under docs/results/ shows: {missing}"
