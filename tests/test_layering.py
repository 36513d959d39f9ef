"""The layering of the package: the library core (`layerpar.mgrit`, `layerpar.ode`,
`layerpar.parallel`, `layerpar._native` and the package root) never imports the
applications (`layerpar.apps`, nor the aliases `layerpar.bench`, `layerpar.cli`,
`layerpar.studies` that lead there).  Read from the source with `ast`, so it also covers
imports inside functions and modules no other test loads."""
from __future__ import annotations

import ast
from pathlib import Path

import layerpar

ROOT = Path(layerpar.__file__).parent
CORE = ("mgrit", "ode", "parallel", "_native")
APPS = ("layerpar.apps", "layerpar.bench", "layerpar.cli", "layerpar.studies")


def _core_files() -> list[Path]:
    files = [ROOT / "__init__.py"]
    for pkg in CORE:
        files += sorted((ROOT / pkg).rglob("*.py"))
    return files


def _package(path: Path) -> str:
    """The package a source file belongs to (for resolving its relative imports)."""
    return ".".join(["layerpar", *path.relative_to(ROOT).parent.parts])


def imported_modules(source: str, package: str) -> list[str]:
    """Every module that `source`, a module of `package`, imports (relative imports
    resolved; ``from X import y`` gives both X and X.y, since y may be a submodule)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found += [mod] + [f"{mod}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(
                node.func, "id", "")) in ("import_module", "__import__"):
            found += [a.value for a in node.args[:1]
                      if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    return found


def _is_app(mod: str) -> bool:
    return any(mod == a or mod.startswith(a + ".") for a in APPS)


def test_core_never_imports_apps():
    files = _core_files()
    assert len(files) > 20 and ROOT / "parallel" / "__init__.py" in files
    bad = [f"{f.relative_to(ROOT.parent)} imports {m}"
           for f in files for m in imported_modules(f.read_text(), _package(f))
           if _is_app(m)]
    assert not bad, "the library core must not import the applications:\n" + "\n".join(bad)


def test_checker_sees_relative_nested_and_dynamic_imports():
    """The checker itself: a relative import two levels up, one inside a function and an
    `importlib.import_module` string are each resolved to the module they name."""
    src = ("import importlib\n"
           "def f():\n"
           "    from ..apps import train\n"
           "    from ..cli import main\n"
           "    importlib.import_module('layerpar.studies.runner')\n"
           "from .model import LayerParallel\n")
    mods = imported_modules(src, "layerpar.parallel")
    assert {"layerpar.apps.train", "layerpar.cli.main", "layerpar.studies.runner",
            "layerpar.parallel.model"} <= set(mods)
    assert not _is_app("layerpar.parallel.model") and not _is_app("layerpar.clip")
