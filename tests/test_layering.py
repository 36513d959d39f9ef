"""The layering of the package: the library core (`layerpar.mgrit`, `layerpar.ode`,
`layerpar.parallel`, `layerpar._native` and the package root) never imports the
applications (`layerpar.apps`, nor the aliases `layerpar.bench`, `layerpar.cli`,
`layerpar.studies` that lead there).  Read from the source with `ast`, so it also covers
imports inside functions and modules no other test loads."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

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


def _from_module(node: ast.ImportFrom, package: str) -> str:
    """The module X of ``from X import ...`` in a module of `package` (relative resolved)."""
    if not node.level:
        return node.module or ""
    base = package.split(".")
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imported_modules(source: str, package: str) -> list[str]:
    """Every module that `source`, a module of `package`, imports (relative imports
    resolved; ``from X import y`` gives both X and X.y, since y may be a submodule)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = _from_module(node, package)
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


# ------------------------------------------------------------------------------------------
# import cycles inside a package
# ------------------------------------------------------------------------------------------
#: the packages whose modules must import each other without a circle
ACYCLIC = ("apps", "mgrit", "ode", "_native", "parallel")
#: the packages that still hold import cycles, to be cleared (their test is a strict
#: xfail: it fails the suite once they are clear, so that they move to ACYCLIC)
CYCLES_TO_CLEAR: tuple[str, ...] = ()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_edges(source: str, module: str, package: str, known: set[str]) -> set[str]:
    """The modules of `known` that `module` (a module of `package`) imports anywhere in
    `source`: at the top, inside functions, under ``if TYPE_CHECKING:`` (type-only
    imports are part of the graph too).  ``from X import y`` names the submodule X.y
    where there is one and X otherwise; a name outside `known` is cut back to the
    longest known module above it; a package that contains `module` is left out (it is
    being imported already when `module` runs)."""
    edges = set()
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = _from_module(node, package)
            names = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod
                     for a in node.names]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module and not module.startswith(name + "."):
                edges.add(name)
    return edges


def import_graph(pkg: str) -> dict[str, set[str]]:
    """Module -> the modules it imports, among the modules of layerpar/`pkg`."""
    files = {_module_name(f): f for f in sorted((ROOT / pkg).rglob("*.py"))}
    known = set(files)
    return {m: import_edges(f.read_text(), m, _package(f), known) for m, f in files.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The cycles of a module graph: its strongly connected components of more than one
    module, each sorted (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def _cycle_params() -> list:
    return [*ACYCLIC, *(pytest.param(p, marks=pytest.mark.xfail(
        strict=True, reason=f"layerpar/{p} still holds import cycles"))
        for p in CYCLES_TO_CLEAR)]


@pytest.mark.parametrize("pkg", _cycle_params())
def test_no_import_cycles(pkg: str) -> None:
    graph = import_graph(pkg)
    assert graph, f"no modules in layerpar/{pkg}"
    cycles = find_cycles(graph)
    assert not cycles, f"import cycles in layerpar/{pkg} (each: the modules that import " \
        "one another, type-only imports included):\n" + "\n".join(
            " <-> ".join(c) for c in cycles)


def test_cycle_finder_sees_type_only_and_nested_imports() -> None:
    """The cycle finder itself: a circle closed by an import inside a function or under
    ``if TYPE_CHECKING:`` is a cycle; ``from . import sibling`` goes to the sibling, not
    to the package, and an import of the package a module sits in is no edge."""
    known = {"p", "p.a", "p.b", "p.c"}
    a = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n"
    b = "def f():\n    from . import a\n"
    c = "import p\nfrom . import b\n"
    assert import_edges(a, "p.a", "p", known) == {"p.b"}
    assert import_edges(b, "p.b", "p", known) == {"p.a"}
    assert import_edges(c, "p.c", "p", known) == {"p.b"}
    assert import_edges("from .a import helper\n", "p.b", "p", known) == {"p.a"}
    graph = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": {"p.a"}, "p.e": set()}
    assert find_cycles(graph) == [["p.a", "p.b", "p.c"]]
    assert find_cycles({"p.a": {"p.b"}, "p.b": set()}) == []


# ------------------------------------------------------------------------------------------
# long functions
# ------------------------------------------------------------------------------------------
MAX_FUNCTION_LINES = 120
#: the functions of layerpar/ still longer than MAX_FUNCTION_LINES ("path:qualname"),
#: each to be split into named steps; the list may only shrink (the test fails on a
#: function that is short enough again while still listed)
LONG_FUNCTIONS_TO_SPLIT: frozenset[str] = frozenset()


def long_functions(limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """"path:qualname" -> lines (decorators to the last line) of every function or
    method in layerpar/ longer than `limit` lines."""
    found = {}

    def visit(node: ast.AST, prefix: str, path: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                if not isinstance(child, ast.ClassDef):
                    first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                    lines = (child.end_lineno or child.lineno) - first + 1
                    if lines > limit:
                        found[f"{path}:{name}"] = lines
                visit(child, name + ".", path)
            else:
                visit(child, prefix, path)

    for f in sorted(ROOT.rglob("*.py")):
        visit(ast.parse(f.read_text()), "", f.relative_to(ROOT).as_posix())
    return found


def test_no_function_longer_than_the_limit() -> None:
    found = long_functions()
    new = {k: v for k, v in found.items() if k not in LONG_FUNCTIONS_TO_SPLIT}
    assert not new, f"functions over {MAX_FUNCTION_LINES} lines (split them into named " \
        "steps):\n" + "\n".join(f"{k}: {v} lines" for k, v in sorted(new.items()))
    cleared = LONG_FUNCTIONS_TO_SPLIT - set(found)
    assert not cleared, "no longer over the limit: remove from LONG_FUNCTIONS_TO_SPLIT: " \
        + ", ".join(sorted(cleared))


# ------------------------------------------------------------------------------------------
# no bare asserts
# ------------------------------------------------------------------------------------------
#: the packages with no `assert` statement: a guard raises an error that says what broke
#: (an assert vanishes under ``python -O``); narrowing a type is written out
NO_ASSERTS = ("apps", "mgrit", "ode", "_native", "parallel")
#: the files of those packages that still hold asserts, to be rewritten (the list may
#: only shrink: a listed file without asserts fails the test)
ASSERTS_TO_REPLACE: frozenset[str] = frozenset()


@pytest.mark.parametrize("pkg", NO_ASSERTS)
def test_no_assert_statements(pkg: str) -> None:
    files = sorted((ROOT / pkg).rglob("*.py"))
    found = {f.relative_to(ROOT).as_posix(): [node.lineno for node in ast.walk(
        ast.parse(f.read_text())) if isinstance(node, ast.Assert)] for f in files}
    bad = [f"layerpar/{f}:{line}" for f, lines in found.items()
           if f not in ASSERTS_TO_REPLACE for line in lines]
    assert not bad, f"assert statements in layerpar/{pkg} (raise an error naming what " \
        "broke instead):\n" + "\n".join(bad)
    cleared = [f for f in ASSERTS_TO_REPLACE if f in found and not found[f]]
    assert not cleared, f"no asserts left: remove from ASSERTS_TO_REPLACE: {cleared}"


#: the policies above the model (`layerpar.parallel.auto.Auto` drives them), which the
#: model's own module never imports
ABOVE_THE_MODEL = ("autotune", "adaptive", "auto")


def test_the_model_imports_no_policy_above_it():
    """`LayerParallel` runs one setting; tuning and adaptive accuracy sit above it and
    import it, never the other way (type-only and function-level imports counted)."""
    graph = import_graph("parallel")
    above = sorted(m for m in graph["layerpar.parallel.model"]
                   if m.rpartition(".")[2] in ABOVE_THE_MODEL)
    assert "layerpar.parallel.runner" in graph["layerpar.parallel.model"]
    assert not above, f"model.py imports the policies above it: {above}"


def test_layer_parallel_stays_small():
    """`LayerParallel` runs one setting and offers a narrow seam: at most 500 lines
    (the passes, agreements, checkpoints and policies above it live in their modules)."""
    tree = ast.parse((ROOT / "parallel" / "model.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LayerParallel")
    assert cls.end_lineno - cls.lineno + 1 <= 500
