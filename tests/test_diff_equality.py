"""One rule for equality: for two tensorcanon files, ``diff`` says identical exactly when their file
digests are equal, in the API and on the command line, for every node kind of docs/FORMAT.md.

A seeded generator makes, for every node kind, pairs of objects that are the same content built
twice (sometimes held differently: insertion order, a view, another storage), or that differ in
exactly one way. Each pair is SAVED TO FILES, and the files are compared by ``tensorcanon.diff``
(paths), by ``tensorcanon diff`` (the command line, in this process: its exit status and last
line) and, loaded, as objects; each answer must agree with the digests. A difference must also be
explained by the walk (a path and a kind), never only by the digests' fallback.

``test_every_node_kind_is_generated`` fails when a node kind is registered that no case makes.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import enum
import io
import random
import struct
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import tensorcanon
from tensorcanon.format import digest, tree
from tensorcanon.io import reader
from tensorcanon.tools import cli

SEEDS = (0, 1, 2)


@dataclasses.dataclass
class Cfg:
    lr: float
    w: torch.Tensor
    name: str = "x"


class Color(enum.Enum):
    RED = 1
    BLUE = 2


@pytest.fixture(autouse=True, scope="module")
def _registered():
    tensorcanon.register(Cfg)
    tensorcanon.register(Color)
    try:
        yield
    finally:
        tensorcanon.unregister(Cfg)
        tensorcanon.unregister(Color)


def _t(r: random.Random, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(r.randrange(2**31))
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def _bump(t: torch.Tensor, i: int = 0) -> torch.Tensor:
    t = t.clone()
    flat = t.view(-1)
    flat[i % flat.numel()] += 1
    return t


def _flip_nan_payload(x: float) -> float:
    bits = struct.unpack("<Q", struct.pack("<d", x))[0]
    return struct.unpack("<d", struct.pack("<Q", bits ^ 1))[0]


# Each case: kind -> make(r, change) -> the object. ``change`` None is the base; a name is one way
# to differ; a name starting with "same:" holds the same content otherwise (it must diff identical).
Make = Callable[[random.Random, "str | None"], Any]
CASES: dict[str, tuple[Make, tuple[str, ...]]] = {}


def case(kind: str, *changes: str) -> Callable[[Make], Make]:
    def add(fn: Make) -> Make:
        CASES[kind] = (fn, changes)
        return fn
    return add


@case("leaves", "int", "float", "zero sign", "nan payload", "str", "bytes", "bool for int", "none", "big int",
      "same:insertion order")
def _leaves(r, c):
    n = r.randrange(-1000, 1000)
    d = {"i": n, "f": r.random(), "z": 0.0, "nan": float("nan"), "s": "abc" + str(n), "b": bytes([n % 256]) * 3,
         "one": 1, "none": None, "big": 2**70 + n}
    if c == "int":
        d["i"] += 1
    elif c == "float":
        d["f"] = struct.unpack("<d", struct.pack("<Q", struct.unpack("<Q", struct.pack("<d", d["f"]))[0] + 1))[0]
    elif c == "zero sign":
        d["z"] = -0.0
    elif c == "nan payload":
        d["nan"] = _flip_nan_payload(d["nan"])
    elif c == "str":
        d["s"] += "\x1b"
    elif c == "bytes":
        d["b"] += b"\x00"
    elif c == "bool for int":
        d["one"] = True
    elif c == "none":
        d["none"] = 0
    elif c == "big int":
        d["big"] += 1
    elif c == "same:insertion order":
        d = dict(reversed(list(d.items())))
    return d


@case("list tuple dict", "list for tuple", "length", "key", "nested value", "same:rebuilt")
def _containers(r, c):
    k = r.randrange(5, 9)
    d = {"l": list(range(k)), "t": tuple(range(k)), "d": {"a": {"b": [1, {"c": k}]}}, str(k): k, 3: "int key",
         (1, "x"): "tuple key", b"k": None}
    if c == "list for tuple":
        d["t"] = list(d["t"])
    elif c == "length":
        d["l"].append(0)
    elif c == "key":
        d[str(k + 1)] = d.pop(str(k))
    elif c == "nested value":
        d["d"]["a"]["b"][1]["c"] += 1
    elif c == "same:rebuilt":
        d = {key: d[key] for key in reversed(list(d))}
    return d


@case("keys", "bool key for int key", "float key for int key", "zero sign of a key", "zero sign in a tuple key")
def _keys(r, c):
    """Keys the file tells apart and Python's == merges: 1, True and 1.0; 0.0 and -0.0."""
    n = r.randrange(9)
    keys = {1: "one", 0.0: "zero", (2, 0.0): "tuple", "n": n}
    if c == "bool key for int key":
        keys = {True: "one", 0.0: "zero", (2, 0.0): "tuple", "n": n}
    elif c == "float key for int key":
        keys = {1.0: "one", 0.0: "zero", (2, 0.0): "tuple", "n": n}
    elif c == "zero sign of a key":
        keys = {1: "one", -0.0: "zero", (2, 0.0): "tuple", "n": n}
    elif c == "zero sign in a tuple key":
        keys = {1: "one", 0.0: "zero", (2, -0.0): "tuple", "n": n}
    return {"keys": keys}


@case("nan keys", "nan key bits")
def _nan_keys(r, c):
    """A NaN key is a NaN object of its own in each build: equal to none in Python, one bit pattern in a file."""
    nan = float("nan") if c is None else _flip_nan_payload(float("nan"))
    return {"nan": {nan: r.randrange(9)}, "s": frozenset([float("nan")])}


@case("odict", "order", "metadata", "metadata value", "dict for odict", "same:copy")
def _odict(r, c):
    o = collections.OrderedDict([("w", r.randrange(9)), ("b", 2), ("c", 3)])
    o._metadata = collections.OrderedDict([("", {"version": 1})])
    if c == "order":
        o.move_to_end("w")
    elif c == "metadata":
        del o._metadata
    elif c == "metadata value":
        o._metadata[""]["version"] = 2
    elif c == "dict for odict":
        return {"o": dict(o)}
    elif c == "same:copy":
        meta = o._metadata
        o = collections.OrderedDict(o)
        o._metadata = meta
    return {"o": o}


@case("set frozenset", "member", "frozenset for set", "zero sign of a member", "bool member for int",
      "same:insertion order")
def _sets(r, c):
    members = [r.randrange(100) for _ in range(6)] + ["a", (1, 2)]
    s, f = set(members), frozenset([1.5, "x", None, 0.0, 1])
    if c == "zero sign of a member":
        f = frozenset([1.5, "x", None, -0.0, 1])
    elif c == "bool member for int":
        f = frozenset([1.5, "x", None, 0.0, True])
    elif c == "member":
        s.add(1000)
    elif c == "frozenset for set":
        s = frozenset(s)
    elif c == "same:insertion order":
        s = set(reversed(members))
    return {"s": s, "f": f}


@case("complex", "imag", "zero sign")
def _complex(r, c):
    z = complex(r.random(), r.random())
    w = complex(0.0, 0.0)
    if c == "imag":
        z = complex(z.real, z.imag + 1)
    elif c == "zero sign":
        w = complex(0.0, -0.0)
    return [z, w]


@case("torch values", "size", "dtype", "device")
def _torch_values(r, c):
    n = r.randrange(1, 9)
    d = {"size": torch.Size([n, 3]), "dtype": torch.float32, "device": torch.device("cpu")}
    if c == "size":
        d["size"] = torch.Size([n, 4])
    elif c == "dtype":
        d["dtype"] = torch.bfloat16
    elif c == "device":
        d["device"] = torch.device("cuda", 1)
    return d


@case("numpy scalars", "value", "dtype", "str", "bytes", "trailing nul")
def _np_scalars(r, c):
    n = r.randrange(100)
    d = {"f": np.float32(n / 7), "i": np.int8(n), "s": np.str_("ab"), "b": np.bytes_(b"ab")}
    if c == "value":
        d["f"] = np.float32(n / 7 + 1)
    elif c == "dtype":
        d["i"] = np.int16(n)
    elif c == "str":
        d["s"] = np.str_("ac")
    elif c == "bytes":
        d["b"] = np.bytes_(b"ac")
    elif c == "trailing nul":
        d["s"] = np.str_("ab\x00")
    return d


@case("numpy strings", "element", "shape", "width", "kind")
def _np_strings(r, c):
    words = [r.choice(["a", "bb", "ccc"]) for _ in range(6)]
    u = np.array(words, dtype="U4").reshape(2, 3)
    s = np.array([w.encode() for w in words], dtype="S3")
    if c == "element":
        u = u.copy()
        u[1, 2] = "zz"
    elif c == "shape":
        u = u.reshape(3, 2)
    elif c == "width":
        u = u.astype("U5")
    elif c == "kind":
        s = s.astype("U3")
    return {"u": u, "s": s}


@case("tensors", "one element", "dtype", "shape", "requires_grad", "parameter", "ndarray", "zero sign",
      "empty shape", "same:view", "same:non-contiguous")
def _tensors(r, c):
    w = _t(r, 4, 3)
    d: dict[str, Any] = {"w": w, "b": _t(r, 3), "e": torch.zeros(0, 2), "z": torch.zeros(2),
                         "i": torch.arange(5, dtype=torch.int64), "a": np.arange(4.0)}
    if c == "one element":
        d["w"] = _bump(w, r.randrange(12))
    elif c == "dtype":
        d["i"] = d["i"].to(torch.int32)
    elif c == "shape":
        d["w"] = w.reshape(3, 4)
    elif c == "requires_grad":
        d["b"] = d["b"].requires_grad_()
    elif c == "parameter":
        d["b"] = torch.nn.Parameter(d["b"], requires_grad=False)
    elif c == "ndarray":
        d["a"] = torch.from_numpy(d["a"])
    elif c == "zero sign":
        d["z"] = torch.tensor([0.0, -0.0])
    elif c == "empty shape":
        d["e"] = torch.zeros(2, 0)
    elif c == "same:view":
        d["w"] = torch.cat([w, w])[:4]
    elif c == "same:non-contiguous":
        d["w"] = w.t().contiguous().t()
    return d


@case("ties", "untied", "tied", "tied elsewhere", "parameter untied", "ndarray untied", "list untied",
      "same:equal values", "same:rebuilt")
def _ties(r, c):
    """A tied pair against an untied copy (issue 37), ties moved, and many tensors of one shape."""
    e, f, g = _t(r, 4, 2), _t(r, 4, 2), _t(r, 4, 2)
    p = torch.nn.Parameter(_t(r, 3))
    a = np.arange(3.0) + r.randrange(9)
    d: dict[str, Any] = {"emb": e, "head": e, "x": f, "y": g, "p": p, "q": p, "na": a, "nb": a, "l": [e, f]}
    if c == "untied":
        d["head"] = e.clone()
    elif c == "tied":
        d["y"] = f
        d["y_values"] = g  # (g's values kept elsewhere: only the tie changes... and a key; see below)
        del d["y_values"]
    elif c == "tied elsewhere":
        d["head"], d["x"] = e.clone(), e
    elif c == "parameter untied":
        d["q"] = torch.nn.Parameter(p.detach().clone())
    elif c == "ndarray untied":
        d["nb"] = a.copy()
    elif c == "list untied":
        d["l"] = [e.clone(), f]
    elif c == "same:equal values":  # other objects, the same ties
        e2 = e.clone()
        d.update(emb=e2, head=e2, l=[e2, f])
    elif c == "same:rebuilt":
        d = dict(reversed(list(d.items())))
    return d


@case("registered", "field", "tensor field", "enum member", "same:rebuilt")
def _registered_values(r, c):
    w = _t(r, 3)
    d = {"cfg": Cfg(r.random(), w), "color": Color.RED, "ns": argparse.Namespace(a=1, b="x"),
         "buf": io.BytesIO(b"abc")}
    if c == "field":
        d["cfg"] = Cfg(d["cfg"].lr, w, "y")
    elif c == "tensor field":
        d["cfg"] = Cfg(d["cfg"].lr, _bump(w))
    elif c == "enum member":
        d["color"] = Color.BLUE
    elif c == "same:rebuilt":
        d["cfg"] = Cfg(d["cfg"].lr, w.clone())
        d["buf"] = io.BytesIO(b"abc")
    return d


@case("stdkinds", "counter count", "counter for dict", "factory", "default item", "maxlen", "deque item")
def _stdkinds(r, c):
    n = r.randrange(1, 9)
    counter = collections.Counter({"a": n, "b": 2})
    dd: collections.defaultdict = collections.defaultdict(list, {"k": [1, 2]})
    dq = collections.deque([1, 2, n], maxlen=5)
    d: dict[str, Any] = {"c": counter, "dd": dd, "dq": dq}
    if c == "counter count":
        counter["a"] += 1
    elif c == "counter for dict":
        d["c"] = dict(counter)
    elif c == "factory":
        d["dd"] = collections.defaultdict(tuple, dd)
    elif c == "default item":
        dd["k"].append(3)
    elif c == "maxlen":
        d["dq"] = collections.deque(dq, maxlen=6)
    elif c == "deque item":
        dq.append(0)
    return d


@case("packed ints", "one item", "length", "width", "sign", "list of floats", "same:copy")
def _ints(r, c):
    n = r.randrange(16, 400)
    ids = [r.randrange(200) for _ in range(n)]
    if c == "one item":
        ids[r.randrange(n)] += 1
    elif c == "length":
        ids.append(5)
    elif c == "width":
        ids[-1] = 70000
    elif c == "sign":
        ids[0] = -1
    elif c == "list of floats":
        ids[3] = float(ids[3])
    elif c == "same:copy":
        ids = list(ids)
    return {"ids": ids, "short": ids[:3]}


@case("packed records", "value", "key", "value type", "one more", "same:key order")
def _records(r, c):
    n = r.randrange(2, 30)
    rows = [{"step": i, "loss": r.random(), "tag": "t"} for i in range(n)]
    if c == "value":
        rows[r.randrange(n)]["loss"] += 1
    elif c == "key":
        rows[0]["tags"] = rows[0].pop("tag")
    elif c == "value type":
        rows[-1]["step"] = float(rows[-1]["step"])
    elif c == "one more":
        rows.append({"step": n})
    elif c == "same:key order":
        rows = [dict(reversed(list(row.items()))) for row in rows]
    return {"log": rows}


@case("sparse", "coo value", "coo index", "csr value", "layout", "same:uncoalesced copy")
def _sparse(r, c):
    dense = torch.zeros(4, 5)
    for _ in range(5):
        dense[r.randrange(4), r.randrange(5)] = float(r.randrange(1, 9))
    coo, csr = dense.to_sparse(), dense.to_sparse_csr()
    if c == "coo value":
        coo = torch.sparse_coo_tensor(coo.indices(), coo.values() + 1, coo.shape).coalesce()
    elif c == "coo index":
        moved = dense.clone()
        moved[3, 4] = 100.0
        coo = moved.to_sparse()
    elif c == "csr value":
        csr = torch.sparse_csr_tensor(csr.crow_indices(), csr.col_indices(), csr.values() * 2, csr.shape)
    elif c == "layout":
        csr = dense.to_sparse_csc()
    elif c == "same:uncoalesced copy":
        coo = torch.sparse_coo_tensor(coo.indices(), coo.values().clone(), coo.shape).coalesce()
    return {"coo": coo, "csr": csr}


@case("nested", "jagged value", "jagged offsets", "strided element", "strided count")
def _nested(r, c):
    a, b = _t(r, 2, 3), _t(r, 4, 3)
    jag = torch.nested.nested_tensor([a, b], layout=torch.jagged)
    strided = torch.nested.nested_tensor([a, b[:1]])
    if c == "jagged value":
        jag = torch.nested.nested_tensor([a, _bump(b)], layout=torch.jagged)
    elif c == "jagged offsets":
        jag = torch.nested.nested_tensor([torch.cat([a, b[:1]]), b[1:]], layout=torch.jagged)
    elif c == "strided element":
        strided = torch.nested.nested_tensor([_bump(a), b[:1]])
    elif c == "strided count":
        strided = torch.nested.nested_tensor([a, b[:1], a])
    return {"jag": jag, "strided": strided}


@case("meta", "shape", "dtype", "requires_grad", "parameter", "dense for meta", "same:other objects")
def _meta(r, c):
    n = r.randrange(1, 5)
    m = torch.empty(n, 3, device="meta")
    d: dict[str, Any] = {"m": m, "m2": torch.empty(n, 3, device="meta")}
    if c == "shape":
        d["m"] = torch.empty(n, 4, device="meta")
    elif c == "dtype":
        d["m"] = torch.empty(n, 3, device="meta", dtype=torch.float16)
    elif c == "requires_grad":
        d["m"] = torch.empty(n, 3, device="meta").requires_grad_()
    elif c == "parameter":
        d["m"] = torch.nn.Parameter(torch.empty(n, 3, device="meta"))
    elif c == "dense for meta":
        d["m"] = torch.zeros(n, 3)
    elif c == "same:other objects":
        d["m"] = torch.empty(n, 3, device="meta")
    return d


@case("tensor attributes", "value", "name", "none", "same:rebuilt")
def _attrs(r, c):
    t = _t(r, 3)
    t.note = {"k": r.randrange(9)}
    if c == "value":
        t.note = {"k": t.note["k"] + 1}
    elif c == "name":
        t.other = t.__dict__.pop("note")
    elif c == "none":
        del t.note
    elif c == "same:rebuilt":
        u = t.detach().clone()
        u.note = dict(t.note)
        t = u
    return {"t": t, "again": t}


@case("rng", "torch", "bitgen", "numpy generator", "legacy", "random", "same:fresh objects")
def _rng(r, c):
    seed = r.randrange(2**31)
    tg = torch.Generator().manual_seed(seed)
    bg = np.random.PCG64(seed)
    ng = np.random.Generator(np.random.PCG64(seed))
    legacy = np.random.RandomState(seed)
    rr = random.Random(seed)
    if c == "torch":
        torch.rand(1, generator=tg)
    elif c == "bitgen":
        bg.advance(1)
    elif c == "numpy generator":
        ng.random()
    elif c == "legacy":
        legacy.random_sample()
    elif c == "random":
        rr.random()
    return {"torch": tg, "bitgen": bg, "numpy": ng, "legacy": legacy, "random": rr}


@case("rng state", "python", "numpy", "torch cpu", "same:captured again")
def _rng_state(r, c):
    seed = r.randrange(2**31)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if c == "python":
        random.random()
    elif c == "numpy":
        np.random.random()
    elif c == "torch cpu":
        torch.rand(1)
    return {"rng": tensorcanon.RngState.capture(), "py": random.getstate()}


@case("determinism settings", "threads", "same:captured again")
def _settings(r, c):
    s = tensorcanon.DeterminismSettings.capture()
    if c == "threads":
        s = dataclasses.replace(s, num_threads=s.num_threads + 1)
    return {"settings": s}


# Node kinds each case makes (the test below checks that every registered kind is made by one).
COVERS = {
    "leaves": ["dict"], "list tuple dict": ["list", "tuple", "dict"], "keys": ["dict"], "nan keys": ["set"],
    "odict": ["odict"],
    "set frozenset": ["set", "frozenset"], "complex": ["complex"], "torch values": ["size", "dtype", "device"],
    "numpy scalars": ["np.scalar", "np.str", "np.bytes"], "numpy strings": ["np.strings"],
    "tensors": ["tensor"], "registered": ["obj"], "stdkinds": ["counter", "defaultdict", "deque"],
    "packed ints": ["ints"], "packed records": ["records"], "sparse": ["sparse"], "nested": ["nested"],
    "meta": ["meta"], "tensor attributes": ["tensor.attrs"],
    "rng": ["rng.torch", "rng.bitgen", "rng.numpy", "rng.legacy", "rng.random"], "rng state": ["rng.state"],
}


def test_every_node_kind_is_generated():
    made = {tag for tags in COVERS.values() for tag in tags}
    registered = {k.tag for k in tree.node_kinds()}
    assert registered <= made, f"node kinds no case generates: {sorted(registered - made)}"
    assert set(COVERS) <= set(CASES)


def _pairs() -> list[tuple[str, str, int]]:
    out = []
    for kind, (_, changes) in CASES.items():
        for seed in SEEDS:
            out.append((kind, "same:built twice", seed))
            out += [(kind, change, seed) for change in changes]
    return out


def _digest(path) -> str:
    with reader.open_file(str(path)) as cf:
        assert cf.digest is not None
        return cf.digest


def _cli_diff(*args: str) -> tuple[int, list[str]]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["diff", *map(str, args)])
    assert not err.getvalue(), err.getvalue()
    return code, out.getvalue().splitlines()


def _save_pair(tmp_path, kind: str, change: str, seed: int, **save: Any) -> tuple[Any, Any]:
    make = CASES[kind][0]
    a = make(random.Random(seed), None)
    b = make(random.Random(seed), None if change == "same:built twice" else change)
    pa, pb = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    tensorcanon.save(a, pa, **save)
    tensorcanon.save(b, pb, **save)
    return pa, pb


@pytest.mark.filterwarnings("ignore::UserWarning")  # (torch's: nested and sparse CSR tensors are prototypes)
@pytest.mark.parametrize(("kind", "change", "seed"), _pairs(), ids=lambda v: str(v).replace(" ", "_"))
def test_diff_says_identical_exactly_when_the_file_digests_are_equal(tmp_path, kind, change, seed):
    pa, pb = _save_pair(tmp_path, kind, change, seed)
    same = _digest(pa) == _digest(pb)
    if change.startswith("same:"):
        assert same, f"{kind}/{change}: the generator meant the same content, the digests differ"
    else:
        assert not same, f"{kind}/{change}: the generator meant a difference, the digests are equal"
    api = tensorcanon.diff(pa, pb)
    assert api.identical == same and bool(api) == (not same), str(api)
    if not same:  # explained by the walk: a path and a kind, not only the digests
        assert any(d.kind != "digest" for d in api), str(api)
    code, lines = _cli_diff(pa, pb)
    assert code == (0 if same else 1), "\n".join(lines)
    assert lines[-1].startswith("identical") == same, "\n".join(lines)
    loaded = tensorcanon.diff(tensorcanon.load(pa), tensorcanon.load(pb))
    assert loaded.identical == same, str(loaded)
    # B against A: the same answer
    assert tensorcanon.diff(pb, pa).identical == same


def test_the_pairs_hold_both_answers_for_every_kind(tmp_path):
    """The generator is not degenerate: each kind has pairs that are the same and pairs that differ."""
    for kind, (_, changes) in CASES.items():
        assert any(not c.startswith("same:") for c in changes), kind


def test_sha256_files_follow_the_same_rule(tmp_path):
    for kind, change in (("ties", "untied"), ("ties", "same:equal values"), ("packed ints", "one item"),
                         ("tensors", "one element"), ("leaves", "zero sign")):
        pa, pb = _save_pair(tmp_path, kind, change, 0, algorithm="sha256")
        same = _digest(pa) == _digest(pb)
        assert tensorcanon.diff(pa, pb).identical == same
        assert _cli_diff(pa, pb)[0] == (0 if same else 1)


def test_same_content_is_the_digest_rule(tmp_path):
    """The shared rule (format/digest.same_content) that diff uses: equal digests of one algorithm and
    format version are the same content; another algorithm or version cannot be decided by digests."""
    pa, pb = _save_pair(tmp_path, "ties", "untied", 0)
    da, db = _digest(pa), _digest(pb)
    assert digest.same_content(da, da) is True
    assert digest.same_content(da, db) is False
    sha = tmp_path / "c.safetensors"
    tensorcanon.save(tensorcanon.load(pa), sha, algorithm="sha256")
    assert digest.same_content(da, _digest(sha)) is None
    assert digest.same_content(da, db, versions=(2, 3)) is None
    with pytest.raises(tensorcanon.UsageError):
        digest.same_content(da, "xxh3-128:00")
    assert tensorcanon.diff(pa, sha).identical  # the walk decides: same content in another algorithm


# ------------------------------------------------------------------ beyond the generated pairs


def test_a_pt_file_and_its_conversion_diff_as_identical(tmp_path):
    """Issue 37: a .pt and the file `convert` made of it reported false ties (every tensor of one
    shape and dtype looked like one through the data-less stand-ins)."""
    g = torch.Generator().manual_seed(0)
    e = torch.randn(4, 2, generator=g)
    state = {"emb": e, "head": e, "b": torch.zeros(3), "b2": torch.zeros(3), "b3": torch.ones(3),
             "p": torch.nn.Parameter(torch.randn(3, generator=g)), "steps": list(range(40))}
    torch.save(state, tmp_path / "m.pt")
    untied = dict(state, head=e.clone())
    torch.save(untied, tmp_path / "untied.pt")
    for name in ("m", "untied"):
        assert cli.main(["convert", str(tmp_path / f"{name}.pt"), str(tmp_path / f"{name}.safetensors")]) == 0
    for a, b in (("m.pt", "m.safetensors"), ("m.safetensors", "m.pt"), ("untied.pt", "untied.safetensors")):
        r = tensorcanon.diff(tmp_path / a, tmp_path / b)
        assert r.identical, str(r)
        assert _cli_diff(tmp_path / a, tmp_path / b)[0] == 0
    (d,) = tensorcanon.diff(tmp_path / "m.pt", tmp_path / "untied.safetensors")
    assert str(d) == '$["head"]: same tensor as $["emb"] in A, a separate tensor in B'
    (d,) = tensorcanon.diff(tmp_path / "m.safetensors", tmp_path / "untied.safetensors")
    assert d.kind == "alias"


def test_user_metadata_is_content(tmp_path):
    def pair(ma, mb):
        pa, pb = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
        tensorcanon.save({"w": torch.ones(2)}, pa, metadata=ma)
        tensorcanon.save({"w": torch.ones(2)}, pb, metadata=mb)
        return pa, pb

    pa, pb = pair({"run": 1, "tags": ["a"]}, {"run": 2, "tags": ["a"]})
    assert [str(d) for d in tensorcanon.diff(pa, pb)] == ['metadata["run"]: value 1 -> 2']
    assert _cli_diff(pa, pb)[0] == 1
    pa, pb = pair(None, {"run": 1})
    assert [str(d) for d in tensorcanon.diff(pa, pb)] == ["metadata: added in B: dict (1 key)"]
    pa, pb = pair({"run": 1}, {"run": 1})
    assert tensorcanon.diff(pa, pb).identical and _cli_diff(pa, pb)[0] == 0


def _on_cuda0(src, dst):
    """``src`` as a writer would have written its tensors from cuda:0: the devices line is outside
    the manifest, so the digest is the same (FORMAT.md §7.2)."""
    from tensorcanon.format import container, manifest

    data = src.read_bytes()
    with reader.open_file(str(src)) as cf:
        header, m = cf.header, cf.manifest
    new_header = container.build(header.entries, manifest.header_metadata(m.raw, ["cuda:0"] * len(m.tensors)))
    dst.write_bytes(new_header + data[len(header.raw):])


def test_devices_are_placement_not_content(tmp_path):
    tensorcanon.save({"w": torch.ones(2)}, tmp_path / "cpu.safetensors")
    _on_cuda0(tmp_path / "cpu.safetensors", tmp_path / "gpu.safetensors")
    assert _digest(tmp_path / "cpu.safetensors") == _digest(tmp_path / "gpu.safetensors")
    r = tensorcanon.diff(tmp_path / "cpu.safetensors", tmp_path / "gpu.safetensors")
    assert r.identical and r.same_digest and not r.differences
    assert [str(n) for n in r.notes] == ['$["w"]: device cpu -> cuda:0']
    code, lines = _cli_diff(tmp_path / "cpu.safetensors", tmp_path / "gpu.safetensors")
    assert code == 0 and lines[-1].endswith("; 1 tensor recorded on other devices"), lines


def test_digests_that_differ_are_never_identical_even_when_the_walk_sees_nothing(tmp_path, monkeypatch):
    """The last resort: a walk that misses a difference (a bug) still cannot make diff say
    identical; the difference is reported at the level of the digests."""
    from tensorcanon.tools import diff as diff_module

    pa, pb = _save_pair(tmp_path, "leaves", "int", 0)
    monkeypatch.setattr(diff_module._Differ, "compare", lambda self, a, b, trail, depth: None)
    r = tensorcanon.diff(pa, pb)
    (d,) = r.differences
    assert d.kind == "digest" and (d.a, d.b) == (_digest(pa), _digest(pb)) and not r.identical
    assert "a bug in tensorcanon" in str(d)
    assert _cli_diff(pa, pb)[0] == 1


def test_equal_digests_walk_nothing(tmp_path, monkeypatch):
    """Equal digests decide alone: the trees are not even built (memory: the manifests only)."""
    from tensorcanon.tools import diff as diff_module

    pa, pb = _save_pair(tmp_path, "packed ints", "same:copy", 0)
    monkeypatch.setattr(diff_module._Differ, "compare", lambda *args: pytest.fail("walked"))
    assert tensorcanon.diff(pa, pb).identical
