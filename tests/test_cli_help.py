"""``layerpar --help`` prints without importing torch (seconds on a quiet machine, tens
under load, only to print text), and ``layerpar train --help`` shows each problem's
actual defaults, read from the recipes the training uses."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from layerpar.apps import cli, nets, recipes
from layerpar.defaults import DEFAULT_TIMEOUT, MGRIT_NRELAX, MGRIT_TOL, TRAINING

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["scale", "--help"],
                                  ["info", "--help"], ["--version"]])
def test_help_does_not_import_torch(argv: list[str]) -> None:
    code = ("import sys\nfrom layerpar.apps.cli import main\ntry:\n    main(sys.argv[1:])\n"
            "except SystemExit:\n    pass\n"
            "print('torch imported:', 'torch' in sys.modules, file=sys.stderr)")
    got = subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert got.returncode == 0, got.stderr
    assert "torch imported: False" in got.stderr, got.stderr
    assert "layerpar" in got.stdout


def test_the_entry_point_module_imports_no_torch_for_help() -> None:
    """``python -m layerpar.cli --help`` (what the console script runs), by -X importtime."""
    got = subprocess.run([sys.executable, "-X", "importtime", "-m", "layerpar.cli", "--help"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in got.stderr.splitlines()
                if line.startswith("import time:")}
    assert "torch" not in imported and "numpy" not in imported, sorted(imported)


def _train_help() -> str:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices["train"].format_help()


def test_train_help_shows_each_problems_defaults() -> None:
    """One row per (problem, recipe): every architecture of every problem appears once,
    beside the recipe it trains with."""
    text = _train_help()
    assert recipes.RECIPES is nets.RECIPES  # the table reads what training uses
    rows = {(line.split()[0], arch): line.split() for line in text.splitlines()
            if line.split() and line.split()[0] in nets.PROBLEMS and len(line.split()) == 8
            for arch in line.split()[1].split("|")}
    assert set(rows) == {(p, a) for p in nets.PROBLEMS for a in nets.ARCHITECTURES[p]}, text
    for (name, arch), row in rows.items():
        r = recipes.recipe_for(name, arch)
        assert row[2:] == [str(r.epochs), str(r.batch_size), f"{r.lr:g}", str(r.n_layers),
                           str(r.width), f"{r.t_final:g}"], row
    # the problem's default architecture leads its first row
    for name in nets.PROBLEMS:
        first = next(line.split() for line in text.splitlines()
                     if line.split()[:1] == [name] and len(line.split()) == 8)
        assert first[1].split("|")[0] == nets.ARCHITECTURES[name][0], first


def test_train_help_shows_the_mgrit_defaults() -> None:
    text = " ".join(_train_help().split("MGRIT (forward and adjoint solves):")[1].split())
    for flag, value in (("--levels", TRAINING.levels), ("--cfactor", TRAINING.cfactor),
                        ("--fwd-iters", TRAINING.fwd_iters),
                        ("--bwd-iters", TRAINING.bwd_iters), ("--nrelax", MGRIT_NRELAX)):
        after = text.split(f"{flag} {flag.lstrip('-').upper().replace('-', '_')}", 1)[1]
        assert f"default {value})" in after.split(" --")[0], (flag, after[:120])
    assert f"default {MGRIT_TOL:g})" in text and f"(default {DEFAULT_TIMEOUT:g})" in text


def test_the_defaults_are_the_engines_own() -> None:
    """The help's MGRIT and timeout values are what the library runs with."""
    from dataclasses import fields

    from layerpar.mgrit import MGRITOptions
    from layerpar.mgrit.transport import DEFAULT_TIMEOUT as transport_timeout

    default = {f.name: f.default for f in fields(MGRITOptions)}
    assert (default["tol"], default["nrelax"]) == (MGRIT_TOL, MGRIT_NRELAX)
    assert transport_timeout == DEFAULT_TIMEOUT


def test_an_examples_help_lists_its_own_problem() -> None:
    """examples/peaks.py and digits.py add the same options for one problem: their help
    lists that problem's defaults (the options say "listed below")."""
    import argparse

    from layerpar.apps.arguments import add_arguments

    text = add_arguments(argparse.ArgumentParser(prog="peaks.py"),
                         problems=("peaks",)).format_help()
    rows = [line.split() for line in text.splitlines() if line.split()[:1] in
            (["peaks"], ["digits"], ["mnist1d"])]
    r = nets.RECIPES["peaks"]
    assert rows == [["peaks", "dense", str(r.epochs), str(r.batch_size), f"{r.lr:g}",
                     str(r.n_layers), str(r.width), f"{r.t_final:g}"]], text
