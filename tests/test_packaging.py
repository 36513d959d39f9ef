"""What a fresh clone installs: `make setup` / `make train` / `make test` fill one .venv
with the extras each needs (Makefile: SETUP_EXTRAS, then `test`); Triton (about 1 GB of
a CPU install) comes only with the `triton` extra of `make test-triton`, and the tests
of the fused Triton steps skip cleanly without it."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _extras() -> dict[str, list[str]]:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["optional-dependencies"]


def _makefile_extras() -> list[str]:
    """The extras `make setup` installs (SETUP_EXTRAS) and the one `make test` adds."""
    text = (ROOT / "Makefile").read_text()
    got = re.search(r"^SETUP_EXTRAS \?= *(\S+)", text, re.M)
    assert got, "the Makefile names its extras in SETUP_EXTRAS"
    test_rule = re.search(r"^\$\(SETUP_TEST\):.*?\n((?:\t.*\n)+)", text, re.M)
    assert test_rule and "EXTRA_REQUIREMENTS) test " in test_rule.group(1)
    return [*got.group(1).split(","), "test"]


def test_make_setup_and_test_install_no_triton() -> None:
    extras = _extras()
    for name in _makefile_extras():
        assert name in extras, name
        assert not any(r.lower().startswith("triton") for r in extras[name]), \
            f"the `{name}` extra (make setup / make test) pulls triton"
    assert any(r.startswith("triton") for r in extras["triton"])


def test_make_test_does_not_depend_on_triton() -> None:
    text = (ROOT / "Makefile").read_text()
    for target in ("test", "test-fast", "train", "setup"):
        line = re.search(rf"^{re.escape(target)}:(.*)$", text, re.M)
        assert line and "TRITON" not in line.group(1), target


def test_triton_tests_skip_cleanly_without_triton() -> None:
    """With `triton` not importable, the files that use it are all skipped, exit 0."""
    code = ("import sys; sys.modules['triton'] = None; import pytest; "
            "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', "
            "'tests/test_triton_kernels.py', 'tests/gpu/test_triton_cuda.py']))")
    got = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert got.returncode == 0, got.stdout + got.stderr
    assert "skipped" in got.stdout and "passed" not in got.stdout and \
        "error" not in got.stdout.lower(), got.stdout
