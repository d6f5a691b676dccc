"""The package's modules form layers: no import cycles (issue 20).

The import graph is read from the source (the AST of every module of src/tensorcanon), so the
check needs no import of the package. An edge is a module-level ``import``/``from`` statement
within the package, ``if TYPE_CHECKING:`` blocks included (an annotation is a dependency too);
imports inside functions are left out: they are the lazy ones (torch, object storage, the
sharded package for a directory only), which keep ``import tensorcanon`` light.
"""

from __future__ import annotations

import ast
import os

import tensorcanon

ROOT = os.path.dirname(os.path.abspath(tensorcanon.__file__))
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


def _modules() -> dict[str, str]:
    found = {}
    for folder, _, names in os.walk(ROOT):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                parts = ["tensorcanon", *os.path.relpath(path, ROOT)[:-3].split(os.sep)]
                found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _targets(module: str, is_package: bool, stmt: ast.stmt, modules: dict[str, str]) -> set[str]:
    if isinstance(stmt, ast.Import):
        return {a.name for a in stmt.names if a.name in modules}
    assert isinstance(stmt, ast.ImportFrom)
    if stmt.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        base = ".".join(package[:len(package) - stmt.level + 1] + ([stmt.module] if stmt.module else []))
    else:
        base = stmt.module or ""
    out = set()
    for a in stmt.names:
        if f"{base}.{a.name}" in modules:
            out.add(f"{base}.{a.name}")
        elif base in modules:
            out.add(base)
    return out


def import_graph(top_level_only: bool = True) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (module level only, unless told otherwise)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        edges: set[str] = set()
        todo: list[ast.AST] = [tree]
        while todo:
            node = todo.pop()
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    edges |= _targets(module, path.endswith("__init__.py"), child, modules)
                elif not (top_level_only and isinstance(child, _FUNCTIONS)):
                    todo.append(child)
        graph[module] = edges - {module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

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
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read():
    graph = import_graph()
    assert "tensorcanon.sharded.files" in graph["tensorcanon.sharded.layout"]
    assert "tensorcanon.sharded.layout" in graph["tensorcanon.sharded.read"]
    assert "tensorcanon.io.reader" in graph["tensorcanon.api"]


def test_a_cycle_is_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_among_module_level_imports():
    assert cycles(import_graph()) == []
