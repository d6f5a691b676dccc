"""One format core: every node kind is registered through tree.register_kind, and tree's tables
are tree's alone ("one format core").

A node kind is a tag, its decoder and the Python types it encodes (format/tree.py). The tests:
no module but format/tree.py writes tree's tables or touches tree's private names (read from the
source, so a new module is checked as it lands); the tags docs/FORMAT.md §6 lists are exactly the
registered ones, each registered once, and the classes the spec names are encoded by their tag; a
second registration of a tag or a type is refused; and in a fresh interpreter ``import tensorcanon``
leaves torch unimported, while a torch.Generator made after ``import torch`` round-trips.
"""

from __future__ import annotations

import ast
import builtins
import collections
import importlib
import json
import os
import pathlib
import random
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import tensorcanon
from tensorcanon import UsageError
from tensorcanon.format import tensorbytes, tree
from tensorcanon.training import rng

ROOT = pathlib.Path(tensorcanon.__file__).resolve().parent
REPO = ROOT.parent.parent
TREE = "tensorcanon.format.tree"
OPTIONAL = "tensorcanon.format.optional"
FORMAT = (REPO / "docs" / "FORMAT.md").read_text(encoding="utf-8")

# Methods that change a container in place: called on one of tree's tables, they write it.
MUTATORS = frozenset({
    "update", "setdefault", "pop", "popitem", "clear", "__setitem__", "__delitem__", "__ior__",
    "append", "extend", "insert", "remove", "sort", "reverse", "add", "discard",
    "difference_update", "intersection_update", "symmetric_difference_update",
})


# ------------------------------------------------------------------------ the scan


def _modules() -> dict[str, pathlib.Path]:
    """Every module of the package: dotted name -> file."""
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = ["tensorcanon", *path.relative_to(ROOT).with_suffix("").parts]
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _tree_privates() -> dict[str, set[str]]:
    """Each class of tree.py -> its private names: ``_``-prefixed methods and the ``self._x``
    attributes its methods use (read from tree.py, so instance attributes count too)."""
    source = (ROOT / "format" / "tree.py").read_text(encoding="utf-8")
    out: dict[str, set[str]] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef):
            names = out.setdefault(node.name, set())
            for sub in ast.walk(node):
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(sub.name):
                    names.add(sub.name)
                elif (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name)
                      and sub.value.id == "self" and _private(sub.attr)):
                    names.add(sub.attr)
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _bound_here(body: list[ast.stmt]) -> set[str]:
    """The plain names a scope's statements bind (not those of the functions and classes in it)."""
    out: set[str] = set()
    todo: list[ast.AST] = list(body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
            continue
        if isinstance(node, ast.Lambda):
            continue
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        todo.extend(ast.iter_child_nodes(node))
    return out


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for a chain of names and attributes, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


class _Scan:
    """The places where one module (not tree.py) writes tree's tables or touches tree's privates."""

    def __init__(self, module: str, is_package: bool, source: str) -> None:
        self.module, self.is_package = module, is_package
        self.syntax = ast.parse(source)
        self.problems: list[str] = []
        self.tree_refs = {TREE}     # dotted names bound to the tree module
        self.from_tree: dict[str, str] = {}  # local name -> the name of tree it is bound to
        self.optional_refs = {OPTIONAL}
        self.on_load_names: set[str] = set()
        self.classes = set(_tree_privates())
        self.privates = _tree_privates()
        self.shadowed: set[str] = set()  # names imported from tree that the scope being walked rebinds
        self._imports()

    # -- what names tree (and optional) here
    def _absolute(self, stmt: ast.ImportFrom) -> str:
        if not stmt.level:
            return stmt.module or ""
        package = self.module.split(".") if self.is_package else self.module.split(".")[:-1]
        package = package[:len(package) - stmt.level + 1]
        return ".".join(package + ([stmt.module] if stmt.module else []))

    def _imports(self) -> None:
        for stmt in ast.walk(self.syntax):
            if isinstance(stmt, ast.Import):
                for a in stmt.names:
                    if a.name in (TREE, OPTIONAL) and a.asname:
                        (self.tree_refs if a.name == TREE else self.optional_refs).add(a.asname)
            elif isinstance(stmt, ast.ImportFrom):
                base = self._absolute(stmt)
                for a in stmt.names:
                    local = a.asname or a.name
                    if f"{base}.{a.name}" == TREE:
                        self.tree_refs.add(local)
                    elif f"{base}.{a.name}" == OPTIONAL:
                        self.optional_refs.add(local)
                    elif base == TREE:
                        self.from_tree[local] = a.name
                        if _private(a.name):
                            self.report(stmt, f"imports tree's private name {a.name}")
                    elif base == OPTIONAL and a.name == "on_load":
                        self.on_load_names.add(local)

    def report(self, node: ast.AST, what: str) -> None:
        self.problems.append(f"{self.module}:{getattr(node, 'lineno', '?')}: {what}")

    # -- what an expression is
    def of_tree(self, node: ast.AST) -> str | None:
        """``tree.X`` (or a name imported from tree) -> "X"; else None."""
        if isinstance(node, ast.Name) and node.id in self.from_tree and node.id not in self.shadowed:
            return self.from_tree[node.id]
        if isinstance(node, ast.Attribute) and _dotted(node.value) in self.tree_refs:
            return node.attr
        return None

    def tree_class(self, annotation: ast.AST | None) -> str | None:
        """The tree class an annotation (``tree.Decoder``, ``Decoder | None``, ``"tree.Encoder"``) names."""
        if annotation is None:
            return None
        if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
            try:
                annotation = ast.parse(annotation.value, mode="eval").body
            except SyntaxError:
                return None
        for sub in ast.walk(annotation):
            name = self.of_tree(sub)
            if name in self.classes:
                return name
        return None

    # -- the walk
    def run(self) -> list[str]:
        self.scope(self.syntax.body, {}, None)
        return self.problems

    def scope(self, body: list[ast.stmt], objects: dict[str, str], tree_base: str | None,
              params: set[str] = frozenset()) -> None:
        """Check a module's, a class's or a function's statements. ``objects``: dotted names known to
        hold an instance of a tree class (-> the class); ``tree_base``: the tree class that the class
        whose body this is derives from (its ``self`` is a tree object whose privates count)."""
        outer = self.shadowed
        if body is not self.syntax.body:  # (at module level an import binds the name to tree's)
            self.shadowed = outer | (params | _bound_here(body)) & set(self.from_tree)
        objects = dict(objects)
        for stmt in body:  # the names bound in here (and below): to a tree object, or annotated as one
            for node in ast.walk(stmt):
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                    cls = self.of_tree(node.value.func)
                    if cls in self.classes:
                        objects.update({d: cls for t in node.targets if (d := _dotted(t))})
                elif isinstance(node, ast.AnnAssign) and (cls := self.tree_class(node.annotation)):
                    if d := _dotted(node.target):
                        objects[d] = cls
        for stmt in body:
            self.visit(stmt, objects, tree_base)
        self.shadowed = outer

    def visit(self, node: ast.AST, objects: dict[str, str], tree_base: str | None) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            inner = dict(objects)
            args = node.args
            for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
                if a is not None and (cls := self.tree_class(a.annotation)):
                    inner[a.arg] = cls
            for e in [*getattr(node, "decorator_list", []), *args.defaults, *args.kw_defaults]:
                if e is not None:
                    self.visit(e, objects, tree_base)
            names = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
                     if a is not None}
            if isinstance(node, ast.Lambda):
                outer, self.shadowed = self.shadowed, self.shadowed | names & set(self.from_tree)
                self.visit(node.body, inner, tree_base)
                self.shadowed = outer
            else:
                self.scope(node.body, inner, tree_base, names)
            return
        if isinstance(node, ast.ClassDef):
            base = next((cls for b in node.bases if (cls := self.of_tree(b)) in self.classes), None)
            for e in [*node.bases, *node.keywords, *node.decorator_list]:
                self.visit(e, objects, tree_base)
            self.scope(node.body, objects, base)
            return
        self.check(node, objects, tree_base)
        for child in ast.iter_child_nodes(node):
            self.visit(child, objects, tree_base)

    def check(self, node: ast.AST, objects: dict[str, str], tree_base: str | None) -> None:
        if isinstance(node, (ast.Attribute, ast.Subscript)) and isinstance(node.ctx, (ast.Store, ast.Del)):
            if isinstance(node, ast.Attribute) and (name := self.of_tree(node)) is not None:
                self.report(node, f"rebinds tree.{name}")
            elif isinstance(node, ast.Subscript) and (name := self.of_tree(node.value)) is not None:
                self.report(node, f"item-assigns tree.{name}")
            elif isinstance(node, ast.Attribute) and (name := self.of_tree(node.value)) is not None:
                self.report(node, f"assigns an attribute of tree.{name}")
        elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name) and node.target.id in self.from_tree:
            self.report(node, f"updates tree.{self.from_tree[node.target.id]} in place")
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in MUTATORS and (name := self.of_tree(func.value)):
                self.report(node, f"calls tree.{name}.{func.attr}()")
            elif isinstance(func, ast.Name) and func.id in ("setattr", "delattr") and node.args and (
                    _dotted(node.args[0]) in self.tree_refs or self.of_tree(node.args[0]) is not None):
                self.report(node, f"calls {func.id}() on tree's objects")
            elif ((isinstance(func, ast.Attribute) and func.attr == "on_load"
                   and _dotted(func.value) in self.optional_refs)
                  or (isinstance(func, ast.Name) and func.id in self.on_load_names)):
                self.report(node, "calls optional.on_load (a node kind names torch's and numpy's classes with "
                                  "tree.LazyType)")
        if isinstance(node, ast.Attribute) and _private(node.attr):
            owner = _dotted(node.value)
            if self.of_tree(node) is not None:
                self.report(node, f"touches tree's private name {node.attr}")
            elif owner in objects:
                self.report(node, f"touches {node.attr}, private to tree.{objects[owner]}")
            elif owner == "self" and tree_base is not None and node.attr in self.privates[tree_base]:
                self.report(node, f"touches {node.attr}, which tree.{tree_base} keeps private")


def scan(module: str, source: str, is_package: bool = False) -> list[str]:
    return sorted(set(_Scan(module, is_package, textwrap.dedent(source)).run()))


RNG = "tensorcanon.training.rng"
# What the modules did before there was one mechanism, and a few other ways to do the same.
CAUGHT = {
    "tree.ENCODERS.update({random.Random: _enc_random})": ["calls tree.ENCODERS.update()"],
    "tree.DECODERS.update(DECODE)": ["calls tree.DECODERS.update()"],
    "optional.on_load(lambda torch: tree.ENCODERS.update({torch.Generator: _enc_torch}))":
        ["calls optional.on_load", "calls tree.ENCODERS.update()"],
    "optional.on_load(_numpy_rows, 'numpy')": ["calls optional.on_load"],
    "from ..format.optional import on_load as hook\nhook(f)": ["calls optional.on_load"],
    "tree.ENCODERS[tensorbytes.Stored] = _encode_stored": ["item-assigns tree.ENCODERS"],
    "try:\n    pass\nexcept KeyError:\n    tree.DECODERS['x'] = f": ["item-assigns tree.DECODERS"],
    "del tree._DECODERS['rng.torch']": ["item-assigns tree._DECODERS", "touches tree's private name _DECODERS"],
    "tree._KINDS.clear()": ["calls tree._KINDS.clear()", "touches tree's private name _KINDS"],
    "tree.DECODERS |= {'x': f}": ["rebinds tree.DECODERS"],
    "tree.Encoder.encode = f": ["assigns an attribute of tree.Encoder"],
    "setattr(tree, 'ENCODERS', {})": ["calls setattr() on tree's objects"],
    "from ..format.tree import _ENCODERS": ["imports tree's private name _ENCODERS"],
    "from ..format.tree import DECODERS\nDECODERS['x'] = f": ["item-assigns tree.DECODERS"],
    "from ..format.tree import DECODERS as D\nD |= {}": ["updates tree.DECODERS in place"],
    "import tensorcanon.format.tree as t\nt.DECODERS.setdefault('x', f)": ["calls tree.DECODERS.setdefault()"],
    "def _nested(dec: tree.Decoder, node, where):\n    dec._path.append(where)":
        ["touches _path, private to tree.Decoder"],
    "def _dec(dec: 'tree.Decoder', node):\n    return paths.join(tuple(dec._path))":
        ["touches _path, private to tree.Decoder"],
    "check = lambda dec: dec._path\ndef f(dec: tree.Decoder | None = None):\n    return [dec._fill for _ in ()]":
        ["touches _fill, private to tree.Decoder"],
    "from ..format.tree import Decoder\nd = Decoder([], 5)\nd._path = ['x']":
        ["touches _path, private to tree.Decoder"],
    "from ..format.tree import Decoder\nclass R:\n    def __init__(self) -> None:\n"
    "        self._decoder: Decoder | None = None\n    def f(self):\n        return self._decoder._fill":
        ["touches _fill, private to tree.Decoder"],
    "from ..format.tree import Encoder\nclass E(Encoder):\n    def f(self, v):\n        return self._by_id":
        ["touches _by_id, which tree.Encoder keeps private"],
}
PASSED = [
    "tree.register_kind('rng.random', _dec_random, {random.Random: _enc_random})",
    "def _nested(dec: tree.Decoder, node, depth):\n    with dec.at('bit_generator'):\n"
    "        return dec.decode(node, depth), dec.path(), dec.current_path()",
    "from ..format.tree import Decoder\nd = Decoder([], 5)\nd.visit = print\nd.uses = []",
    "from ..format.tree import Encoder\nclass E(Encoder):\n    def _own(self):\n        return 1\n"
    "    def f(self):\n        return self._own(), self.current_path()",
    "class Reader:\n    def f(self, v):\n        self._decoder = None\n        return v._local_tensor",
    "tags = {k.tag for k in tree.node_kinds()}\nseen = set(tree.DECODERS)",
    "from ..format.tree import items\ndef f(node):\n    items = []\n    items.append(node)\n    return items",
]


@pytest.mark.parametrize("source", sorted(CAUGHT))
def test_the_scan_catches_each_way_of_writing_trees_tables_or_touching_its_privates(source):
    found = scan(RNG, "from ..format import optional, tree\n" + source)
    assert sorted(p.split(": ", 1)[1].split(" (")[0] for p in found) == sorted(CAUGHT[source]), found


@pytest.mark.parametrize("source", PASSED)
def test_the_scan_passes_the_public_api(source):
    assert scan(RNG, "from ..format import optional, tree\n" + source) == []


def test_no_module_but_tree_writes_trees_tables_or_touches_its_privates():
    modules = _modules()
    assert len(modules) > 50 and TREE in modules
    problems, users = [], set()
    for module, path in modules.items():
        if module == TREE:
            continue
        s = _Scan(module, path.name == "__init__.py", path.read_text(encoding="utf-8"))
        problems += s.run()
        if len(s.tree_refs) > 1 or s.from_tree:
            users.add(module)
    assert {RNG, "tensorcanon.io.reader", "tensorcanon.io.writer", "tensorcanon.dcp.logical"} <= users
    assert sorted(set(problems)) == []


# ------------------------------------------------------------------------ the spec's tags


def _spec_kinds() -> dict[str, str | None]:
    """Tag -> the first name in backquotes of its Python value ("Decodes to", "Python value"), None
    where the cell names none: from every table of FORMAT.md §6 whose first column is "Tag"."""
    section = FORMAT.split("\n## 6. ", 1)[1].split("\n## 7. ", 1)[0]
    found: dict[str, str | None] = {}
    tables = re.findall(r"^\| Tag \|.*?(?=\n\n|\Z)", section, flags=re.M | re.S)
    assert len(tables) == 3, "FORMAT.md §6 has a tag table in §6.2, §6.7 and §6.12"
    for table in tables:
        header, _, *rows = table.splitlines()
        column = [c.strip() for c in header.strip("|").split("|")].index(
            "Decodes to" if "Decodes to" in header else "Python value")
        for row in rows:
            cells = [c.strip() for c in row.strip().strip("|").split("|")]
            tag = re.fullmatch(r"`([a-z.]+)`", cells[0])
            assert tag, row
            value = re.match(r"`([\w.]+)`", cells[column])
            assert tag[1] not in found, f"FORMAT.md lists {tag[1]!r} twice"
            found[tag[1]] = value[1] if value else None
    return found


def _python(name: str) -> object:
    if "." not in name:
        return getattr(builtins, name)
    module, _, attr = name.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def test_every_tag_the_spec_lists_has_exactly_one_kind_and_no_other_is_registered():
    spec = _spec_kinds()
    kinds = tree.node_kinds()
    counts = collections.Counter(k.tag for k in kinds)
    assert set(counts) == set(spec), (set(counts) ^ set(spec))
    assert all(n == 1 for n in counts.values()), counts
    # issue 30 added counter, defaultdict, deque, np.str, np.bytes, np.strings (§6.10, §6.11) and
    # sparse, nested, meta, tensor.attrs (§6.12); format version 3 added ints and records (§6.13)
    assert len(spec) == 31


def test_the_classes_the_spec_names_are_encoded_by_their_tag():
    checked = 0
    for tag, name in _spec_kinds().items():
        if name is None:
            continue
        kind = tree.kind_of(_python(name))
        assert kind is not None and kind.tag == tag, (tag, name, kind)
        checked += 1
    assert checked == 20  # all but np.strings, np.scalar, tensor, obj (no single class) and rng.bitgen (five)
    for cls in (torch.Tensor, torch.nn.Parameter, np.ndarray, tensorbytes.Stored):
        assert tree.kind_of(cls).tag == "tensor", cls
    for cls, _ in rng.BIT_GENERATORS.values():
        assert tree.kind_of(cls).tag == "rng.bitgen", cls
    # numpy scalars and registered classes reach their kinds by the fallback, not by exact type
    assert tree.kind_of(np.float32) is None and tree.kind_of(tensorcanon.DeterminismSettings) is None
    assert tree.kind_of(int) is None and tree.kind_of(str) is None


def test_each_type_a_kind_lists_is_encoded_by_that_kind_alone():
    seen: dict[type, str] = {}
    for kind in tree.node_kinds():
        for t in kind.types:
            cls = t.resolve(importlib.import_module(t.module)) if isinstance(t, tree.LazyType) else t
            assert cls not in seen, f"{cls} is listed by {seen[cls]!r} and {kind.tag!r}"
            seen[cls] = kind.tag
            assert tree.kind_of(cls) is kind
    assert len(seen) == 29  # 10 of Python (Counter, defaultdict, deque too), torch 6, numpy 11, Stored, RngState


# ------------------------------------------------------------------------ refusals


def _dec(decoder, node, depth):
    return None


def _enc(encoder, value, depth):
    return ["test.kind"]


class Fresh:
    pass


def test_a_second_registration_of_a_tag_or_a_type_is_refused_and_registers_nothing():
    before = tree.node_kinds()
    with pytest.raises(UsageError, match=r"the tag 'list' is already registered \(by tensorcanon\.format\.tree\)"):
        tree.register_kind("list", _dec)
    with pytest.raises(UsageError, match=r"the tag 'rng\.torch' is already registered \(by tensorcanon\.training\.rng"):
        tree.register_kind("rng.torch", _dec, {Fresh: _enc})
    with pytest.raises(UsageError, match=r"builtins\.list is already encoded by the node kind 'list' \(registered by "
                                         r"tensorcanon\.format\.tree\)"):
        tree.register_kind("test.kind", _dec, {Fresh: _enc, list: _enc})
    with pytest.raises(UsageError, match=r"torch\.Generator is already encoded by the node kind 'rng\.torch'"):
        tree.register_kind("test.kind", _dec, {tree.LazyType("torch", "Generator"): _enc})
    with pytest.raises(UsageError, match=r"random\.Random is already encoded by the node kind 'rng\.random'"):
        tree.register_kind("test.kind", _dec, {random.Random: _enc})
    with pytest.raises(UsageError, match=r"int values are leaves"):
        tree.register_kind("test.kind", _dec, {int: _enc})
    with pytest.raises(UsageError, match=r"only the modules tensorcanon imports on first use \(torch, numpy\)"):
        tree.LazyType("scipy", "sparse.csr_matrix")
    with pytest.raises(UsageError, match=r"decode must be a function"):
        tree.register_kind("test.kind", None)
    assert tree.node_kinds() == before
    assert tree.kind_of(Fresh) is None
    with pytest.raises(tensorcanon.UnsupportedTypeError, match="cannot save a value of type"):
        tensorcanon.dumps(Fresh())
    with pytest.raises(tensorcanon.FormatError, match="unknown tag 'test.kind'"):
        tree.Decoder([], 10).decode(["test.kind"])


def _fresh(code: str) -> dict:
    """Run ``code`` in a fresh interpreter with this checkout's package; the JSON it prints last."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(REPO / "src"), PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def test_a_kind_registers_once_and_lazily_named_classes_are_checked_when_torch_loads_in_a_fresh_process():
    out = _fresh("""
        import json, sys
        import tensorcanon
        from tensorcanon import UsageError
        from tensorcanon.format import tree

        def refused(f, *args):
            try:
                f(*args)
            except UsageError as e:
                return str(e)
            return None

        dec = lambda decoder, node, depth: ("probe", *(decoder.decode(n, depth) for n in node[1:]))
        enc = lambda encoder, value, depth: ["test.probe", encoder.encode(value.x, depth)]
        class Probe:
            def __init__(self, x): self.x = x
        out = {"torch": "torch" in sys.modules}
        tree.register_kind("test.probe", dec, {Probe: enc})
        out["round_trip"] = list(tensorcanon.loads(tensorcanon.dumps([Probe(7)]))[0])
        out["same_tag"] = refused(tree.register_kind, "test.probe", dec)
        out["same_type"] = refused(tree.register_kind, "test.other", dec, {Probe: enc})
        out["same_name"] = refused(tree.register_kind, "test.other", dec, {tree.LazyType("torch", "Generator"): enc})
        tree.register_kind("test.module", dec, {tree.LazyType("torch", "nn.Module"): enc})
        tree.register_kind("test.alias", dec, {tree.LazyType("torch", "nn.modules.module.Module"): enc})
        out["torch_after"] = "torch" in sys.modules
        import torch
        out["on_load"] = refused(tensorcanon.dumps, 1)
        g = torch.Generator().manual_seed(3)
        out["generator"] = torch.equal(tensorcanon.loads(tensorcanon.dumps(g)).get_state(), g.get_state())
        out["module_kind"] = tree.kind_of(torch.nn.Module).tag
        print(json.dumps(out))
    """)
    assert out["torch"] is False and out["torch_after"] is False
    assert out["round_trip"] == ["probe", 7]
    assert out["same_tag"].startswith("the tag 'test.probe' is already registered (by __main__)")
    assert out["same_type"].startswith("__main__.Probe is already encoded by the node kind 'test.probe'")
    # (torch not loaded: LazyType names are compared by name)
    assert out["same_name"].startswith("torch.Generator is already encoded by the node kind 'rng.torch' "
                                       "(registered by tensorcanon.training.rng)")
    # two names of one class: found when torch loads, the first registration kept, the rest working
    assert out["on_load"] == ("torch was loaded, but the node kinds that name its classes clash: "
                              "torch.nn.modules.module.Module is already encoded by the node kind 'test.module' "
                              "(registered by __main__): a type has one node kind; register the new kind without it")
    assert out["generator"] is True and out["module_kind"] == "test.module"


def test_import_leaves_torch_alone_and_a_generator_made_after_import_torch_round_trips_in_a_fresh_process():
    out = _fresh("""
        import json, sys
        import tensorcanon
        from tensorcanon.format import tree
        out = {"torch": "torch" in sys.modules, "numpy_imported": "numpy" in sys.modules}
        kinds = {k.tag: k for k in tree.node_kinds()}
        out["named"] = [str(t) for t in kinds["rng.torch"].types + kinds["rng.numpy"].types]
        out["after_kinds"] = "torch" in sys.modules or "numpy" in sys.modules
        import torch
        g = torch.Generator().manual_seed(11)
        torch.rand(5, generator=g)
        data = tensorcanon.dumps({"g": g, "t": torch.arange(3)})
        back = tensorcanon.loads(data)
        h = back["g"]
        out["type"] = type(h).__name__
        out["state"] = torch.equal(h.get_state(), g.get_state())
        out["again"] = tensorcanon.dumps({"g": h, "t": back["t"]}) == data  # the same bytes
        out["draws"] = torch.equal(torch.rand(4, generator=h), torch.rand(4, generator=g))
        import numpy as np
        n = np.random.default_rng(5)
        m = tensorcanon.loads(tensorcanon.dumps(n))
        out["numpy"] = [type(m).__name__, m.random() == n.random()]
        out["kind"] = [tree.kind_of(torch.Generator).tag, tree.kind_of(np.random.Generator).tag]
        print(json.dumps(out))
    """)
    assert out["torch"] is False and out["numpy_imported"] is False and out["after_kinds"] is False
    assert out["named"] == ["torch.Generator", "numpy.random.Generator"]
    assert out["type"] == "Generator" and out["state"] and out["draws"] and out["again"]
    assert out["numpy"] == ["Generator", True]
    assert out["kind"] == ["rng.torch", "rng.numpy"]
