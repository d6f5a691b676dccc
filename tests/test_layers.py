"""The package's modules form layers: no import cycles, and docs/ARCHITECTURE.md is the map (issue 20).

The import graph is read from the source (the AST of every module of src/tensorcanon), so the
check needs no import of the package. An edge is an ``import``/``from`` statement within the
package, ``if TYPE_CHECKING:`` blocks included (an annotation is a dependency too); with
``top_level_only`` the imports inside functions (the lazy ones, which keep ``import tensorcanon``
light) are left out. Which layer may import which is import-linter's check (pyproject.toml,
run by .ci/run); this file checks what it does not: cycles within a layer, and that the
architecture page names the modules and layers that exist.
"""

from __future__ import annotations

import ast
import importlib
import os
import pathlib
import re
import sys

import pytest

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


def test_no_import_cycles_even_through_imports_inside_functions():
    assert cycles(import_graph(top_level_only=False)) == []


# ------------------------------------------------------------------------ the architecture page

REPO = pathlib.Path(__file__).resolve().parent.parent
ARCHITECTURE = (REPO / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
LAYER_FOLDERS = ("format", "io", "training", "tools", "sharded", "trace", "store")


def _contract_layers() -> list[str]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        tomllib = pytest.importorskip("tomli")
    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    (contract,) = [c for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers"]
    return contract["layers"]


def test_every_module_path_the_page_names_exists():
    folders = "format|io|training|tools|sharded|trace|store|dcp|integrations"
    named = set(re.findall(rf"\b((?:{folders})/\w+\.py)\b", ARCHITECTURE))
    assert len(named) > 15
    missing = sorted(p for p in named if not os.path.isfile(os.path.join(ROOT, p)))
    assert not missing, f"docs/ARCHITECTURE.md names modules that do not exist: {missing}"


def test_each_layer_folders_modules_are_all_in_its_table_and_no_others():
    for folder in LAYER_FOLDERS:
        heading = re.search(rf"^### `{folder}/`.*?$(.*?)(?=^### |\Z)", ARCHITECTURE, re.M | re.S)
        assert heading, f"docs/ARCHITECTURE.md has no section for {folder}/"
        in_table = set(re.findall(r"`(\w+)\.py`", heading.group(1)))
        on_disk = {n[:-3] for n in os.listdir(os.path.join(ROOT, folder)) if n.endswith(".py") and n != "__init__.py"}
        assert in_table == on_disk, f"{folder}/: the page lists {sorted(in_table)}, the folder holds {sorted(on_disk)}"


def test_the_names_the_page_gives_as_module_dot_attribute_exist():
    """`reader.CheckedFile`, `format/container.in_data_order`...: each is a real attribute."""
    modules = {}  # module name -> the modules of that name (not packages: `io.BytesIO` is the standard io)
    for module, path in _modules().items():
        if not path.endswith("__init__.py"):
            modules.setdefault(module.rsplit(".", 1)[-1], []).append(module)
    checked = 0
    for folder, module, attr in re.findall(r"`(?:(\w+)/)?(\w+)\.(\w+)`", ARCHITECTURE):
        if attr == "py" or module == "tensorcanon" or module not in modules:
            continue
        candidates = [m for m in modules[module] if not folder or m.startswith(f"tensorcanon.{folder}.")]
        assert len(candidates) == 1, f"`{module}.{attr}`: the module is ambiguous or unknown: {candidates}"
        assert hasattr(importlib.import_module(candidates[0]), attr), f"{candidates[0]} has no {attr!r}"
        checked += 1
    assert checked >= 5


def test_the_page_draws_the_layers_import_linter_enforces():
    """The layer diagram, top to bottom, is the layers contract of pyproject.toml."""
    contract = [name.replace("tensorcanon.", "") for layer in _contract_layers() for name in layer.split(" | ")]
    block = ARCHITECTURE.split("## Layers", 1)[1].split("```", 2)[1]
    drawn = []
    for line in block.splitlines():
        m = re.match(r"(\w+)(?:/|\.py)(?:\s*│\s*(\w+)/)?\s", line)
        if m and not line.startswith("tensorcanon/"):
            drawn += [g for g in m.groups() if g]
    assert drawn == [n.removesuffix(".py") for n in contract], (drawn, contract)


def test_the_documented_import_paths_keep_working():
    """tensorcanon.testing, tensorcanon.lockfile, tensorcanon.codecs: the documented names, the same objects."""
    import tensorcanon.codecs as codecs
    import tensorcanon.lockfile as lockfile
    import tensorcanon.testing as testing
    from tensorcanon.format import codecs as format_codecs
    from tensorcanon.tools import lockfile as tools_lockfile, testing as tools_testing

    for facade, module in ((codecs, format_codecs), (lockfile, tools_lockfile), (testing, tools_testing)):
        assert facade.__all__ == module.__all__
        for name in facade.__all__:
            assert getattr(facade, name) is getattr(module, name), (facade.__name__, name)
    for name in tensorcanon.__all__:
        assert getattr(tensorcanon, name) is not None
