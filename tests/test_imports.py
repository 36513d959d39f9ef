"""Imports inside `layerpar/parallel/` point one way: no module imports, directly or
through others, a module that imports it.  Every `import` statement counts (also those
inside functions), except those under ``if TYPE_CHECKING:``, which never run."""
from __future__ import annotations

import ast
from pathlib import Path

PARALLEL = Path(__file__).resolve().parent.parent / "layerpar" / "parallel"


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The sibling modules `path` imports (relative imports of the package)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for stmt in child.orelse:
                    visit(stmt)
                continue
            if isinstance(child, ast.ImportFrom) and child.level == 1:
                if child.module:
                    found.add(child.module.split(".")[0])
                else:
                    found.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and \
                    child.module.startswith("layerpar.parallel."):
                found.add(child.module.split(".")[2])
            visit(child)

    visit(ast.parse(path.read_text()))
    return found & modules


def import_graph(folder: Path) -> dict[str, set[str]]:
    """Module -> the sibling modules it imports, for every ``*.py`` of `folder`."""
    modules = {p.stem for p in folder.glob("*.py")} - {"__init__"}
    return {m: _imports(folder / f"{m}.py", modules) for m in sorted(modules)}


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle (its modules in order, the first repeated at the end), or []."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(m: str) -> list[str]:
        state[m] = 1
        path.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                return path[path.index(d):] + [d]
            if d not in state:
                got = walk(d)
                if got:
                    return got
        path.pop()
        state[m] = 2
        return []

    for m in graph:
        if m not in state:
            got = walk(m)
            if got:
                return got
    return []


def test_find_cycle_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == \
        ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []


def test_the_ast_walk_skips_type_checking_only(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                   "    from .b import B\n")
    (tmp_path / "b.py").write_text("def f():\n    from .a import A\n")
    assert import_graph(tmp_path) == {"a": set(), "b": {"a"}}


def test_no_import_cycle_in_parallel() -> None:
    graph = import_graph(PARALLEL)
    assert len(graph) > 10 and graph["runner"]  # the walk sees the package
    cycle = find_cycle(graph)
    assert not cycle, "import cycle in layerpar/parallel: " + " -> ".join(cycle)


def test_public_names_resolve_after_a_plain_import() -> None:
    """Every name in `layerpar.__all__` resolves after ``import layerpar`` alone, the
    subpackages included (README's ``layerpar.parallel.Plan.build(...)`` raised
    AttributeError), and the errors a failure raises on every rank can be caught by
    name from the package (README names them; they lived in `layerpar.mgrit.errors`
    only)."""
    import subprocess
    import sys

    code = ("import layerpar\n"
            "for n in layerpar.__all__: getattr(layerpar, n)\n"
            "from layerpar.mgrit import errors\n"
            "assert layerpar.RemoteError is errors.RemoteError\n"
            "assert layerpar.RankLostError is errors.RankLostError\n"
            "print(layerpar.parallel.Plan.__name__)\n")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert got.returncode == 0 and got.stdout.strip() == "Plan", got.stderr
