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


PARALLEL = ROOT / "parallel"
#: the policies above the model (`layerpar.parallel.auto.Auto` drives them), which the
#: model's own module never imports
ABOVE_THE_MODEL = ("autotune", "adaptive", "auto")


def _parallel_graph() -> dict[str, set[str]]:
    """Module of `layerpar/parallel/` -> the sibling modules it imports, counting every
    import statement: module level, inside functions and under ``TYPE_CHECKING``."""
    mods = {p.stem for p in PARALLEL.glob("*.py")} - {"__init__"}
    graph = {}
    for m in sorted(mods):
        got = imported_modules((PARALLEL / f"{m}.py").read_text(), "layerpar.parallel")
        graph[m] = {g.split(".")[2] for g in got if g.startswith("layerpar.parallel.")
                    and g.count(".") >= 2 and g.split(".")[2] in mods} - {m}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of `graph` (its modules in order, the first repeated at the end), or []."""
    done: set[str] = set()
    path: list[str] = []

    def walk(m: str) -> list[str]:
        path.append(m)
        for d in sorted(graph[m]):
            if d in path:
                return path[path.index(d):] + [d]
            if d not in done:
                got = walk(d)
                if got:
                    return got
        path.pop()
        done.add(m)
        return []

    for m in sorted(graph):
        if m not in done:
            got = walk(m)
            if got:
                return got
    return []


def test_parallel_has_no_import_cycle():
    """Imports inside `layerpar/parallel/` point one way, type-only and function-level
    imports included, and the model imports none of the policies above it."""
    graph = _parallel_graph()
    assert len(graph) > 20 and "runner" in graph["model"]  # the walk sees the package
    cycle = _cycle(graph)
    assert not cycle, "import cycle in layerpar/parallel: " + " -> ".join(cycle)
    above = sorted(graph["model"] & set(ABOVE_THE_MODEL))
    assert not above, f"model.py imports the policies above it: {above}"


def test_the_cycle_check_counts_type_only_and_nested_imports():
    src = ("from typing import TYPE_CHECKING\n"
           "if TYPE_CHECKING:\n"
           "    from .model import LayerParallel\n"
           "def f():\n"
           "    from .auto import Auto\n")
    mods = imported_modules(src, "layerpar.parallel")
    assert {"layerpar.parallel.model", "layerpar.parallel.auto"} <= set(mods)
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) == []
