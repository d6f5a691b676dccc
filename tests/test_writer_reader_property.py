"""Whatever the writer accepts, every reader accepts and gives back (issue 20).

One property over generated values, many of them values a user can build but the format
cannot hold: ``tensorcanon.dumps`` either refuses the value with a :class:`TensorCanonError`
(and ``fingerprint`` refuses it too), or every read path accepts the file (``loads``, a stream,
``load(mmap=True)``, ``tensorcanon.open``, ``verify``; tests/fuzz/hostile_lib.py ``check``),
``loads`` gives back an equal value (:func:`assert_equal`: types, float bits, tensor bytes,
generator states), and saving that value gives the same bytes.

The values: nested containers with keys of every key type (big ints, -0.0, NaN payloads,
lone surrogates, tuples, frozensets); tensors of every dtype and layout (views, non-contiguous,
channels-last, 0-d, zero-size, conj/neg bits, parameters) and arrays; collections.Counter,
defaultdict and deque; registered dataclasses,
NamedTuples, Enums and a custom codec; the built-in codecs (paths, dates and times,
namespaces); every random-state kind, perturbed into states a user can set; and
``DeterminismSettings`` with arbitrary field values.

Runs derandomized (the same examples on every run); TENSORCANON_PROPERTY_SCALE multiplies the
number of examples for a longer local search.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime as dt
import enum
import inspect
import math
import os
import pathlib
import random
import struct
import typing

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings, strategies as st

import tensorcanon
from tensorcanon import DeterminismSettings, RngState
from tensorcanon.format import codecs, stdkinds, tensorbytes
from tensorcanon.format.errors import TensorCanonError
from tensorcanon.format.ordering import sort_key
from tensorcanon.training import rng

ROOT = pathlib.Path(__file__).parent

import hostile_lib
from compare import tensor_content, user_attrs

SCALE = float(os.environ.get("TENSORCANON_PROPERTY_SCALE", "1"))


def budget(n: int) -> settings:
    return settings(max_examples=max(1, int(n * SCALE)), deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much])


# ------------------------------------------------------------------ registered user types


@dataclasses.dataclass
class Point:
    x: typing.Any
    y: typing.Any = None


@dataclasses.dataclass(frozen=True, eq=False)
class Frozen:
    a: typing.Any
    b: typing.Any = dataclasses.field(default=0, init=False)


class Pair(typing.NamedTuple):
    first: typing.Any
    second: typing.Any


class Color(enum.Enum):
    RED = 1
    BIG = 2**70
    NAN = float("nan")
    NEG_ZERO = -0.0
    TUPLE = (1, "a")
    BYTES = b"\x00"
    NONE = None
    FROZEN = frozenset({1, 2})


class Level(enum.IntEnum):
    LOW = 0
    HIGH = 7


class Box:
    """A class with a user codec: its state is any value."""

    def __init__(self, value: typing.Any) -> None:
        self.value = value


class Cfg(dict):
    """A dict subclass registered in one call (yacs's CfgNode, issue 30): saved as its items."""


class Steps(list):
    pass


class OrderedCfg(collections.OrderedDict):
    pass


USER_TYPES = [Point, Frozen, Pair, Color, Level, Cfg, Steps, OrderedCfg]


@pytest.fixture(autouse=True)
def registered():
    for cls in USER_TYPES:
        tensorcanon.register(cls)
    tensorcanon.register(Box, encode=lambda b: b.value, decode=Box)
    tensorcanon.register_builtin_codecs()
    yield
    for cls in [*USER_TYPES, Box]:
        tensorcanon.unregister(cls)


# ------------------------------------------------------------------ the property


def check(value: typing.Any, *, metadata: typing.Any = None, expected: typing.Any = None,
          mapped: bool = True) -> bool:
    """Assert the property for ``value``; True when it was saved (False: refused)."""
    try:
        data = tensorcanon.dumps(value, metadata=metadata)
    except TensorCanonError as e:
        with pytest.raises(type(e)):
            tensorcanon.fingerprint(value, metadata=metadata)
        return False
    assert tensorcanon.fingerprint(value, metadata=metadata) == tensorcanon.verify(data)
    back = tensorcanon.loads(data)  # (first on its own, so that a failure shows the reader's message)
    # every read path accepts the file, and saving what it loads gives the same bytes
    assert hostile_lib.check(data, mapped=mapped) == "ok"
    assert_equal(value if expected is None else expected, back)
    assert_equal(metadata, tensorcanon.read_metadata(data))
    return True


def _float_bits(x: float) -> bytes:
    return struct.pack(">d", x)


def _sorted_items(d: typing.Any) -> list:
    return sorted(d.items(), key=lambda kv: sort_key(kv[0]))


def _seed_seq(bg: typing.Any) -> typing.Any:
    ss = getattr(bg, "seed_seq", None) if hasattr(bg, "seed_seq") else getattr(bg, "_seed_seq", None)
    if ss is None:
        return None
    entropy = ss.entropy
    entropy = int(entropy) if isinstance(entropy, (int, np.integer)) else tuple(int(e) for e in entropy)
    return entropy, tuple(int(k) for k in ss.spawn_key), int(ss.pool_size), int(ss.n_children_spawned)


def _bitgen(bg: typing.Any) -> tuple:
    return type(bg), rng.bitgen_fields(bg.state), _seed_seq(bg)


def assert_equal(a: typing.Any, b: typing.Any, path: str = "$") -> None:
    """``b`` (loaded) is ``a`` (saved): same types, float bits, tensor bytes, generator states."""
    if isinstance(a, pathlib.PurePath):  # a path loads as the standard class it is or derives from
        assert type(b).__name__ == codecs._path_kind(a) and str(a) == str(b), f"{path}: {a!r} != {b!r}"
        return
    if isinstance(a, argparse.Namespace):  # a namespace subclass loads as a Namespace
        assert type(b) is argparse.Namespace, path
        assert_equal(dict(vars(a)), dict(vars(b)), path)
        return
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.requires_grad, a.device) == (b.dtype, b.requires_grad, b.device), path
        assert a.is_nested or a.shape == b.shape, path  # (a strided nested tensor has no shape)
        assert (a.layout, a.is_nested) == (b.layout, b.is_nested), f"{path}: layout"
        assert tensor_content(a) == tensor_content(b), f"{path}: tensor bytes differ"
        if a.layout is torch.strided and not a.is_nested and not a.is_meta:
            assert tensorbytes.memory_format(a) == tensorbytes.memory_format(b), f"{path}: memory format"
        assert_equal(user_attrs(a), user_attrs(b), f"{path}.__dict__")  # attributes set on it (§6.12.4)
    elif isinstance(a, np.ndarray):
        assert a.dtype.newbyteorder("=") == b.dtype and a.shape == b.shape, path
        logical = np.ascontiguousarray(a)
        if a.dtype == np.bool_:  # any non-zero byte is true (and saved as 0x01)
            logical = logical.view(np.uint8) != 0
        assert logical.astype(b.dtype).tobytes() == b.tobytes(), path
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), path
    elif type(a) is float:
        assert _float_bits(a) == _float_bits(b), f"{path}: {a!r} != {b!r}"
    elif type(a) is complex:
        assert _float_bits(a.real) + _float_bits(a.imag) == _float_bits(b.real) + _float_bits(b.imag), path
    elif type(a) in (list, tuple, Steps) or isinstance(a, Pair):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_equal(x, y, f"{path}[{i}]")
    elif type(a) in (set, frozenset):
        assert len(a) == len(b), path
        assert_equal(sorted(a, key=sort_key), sorted(b, key=sort_key), path)
    elif type(a) is collections.deque:
        assert a.maxlen == b.maxlen, f"{path}: maxlen"
        assert_equal(list(a), list(b), path)
    elif isinstance(a, dict):
        if type(a) is collections.defaultdict:
            assert a.default_factory is b.default_factory, f"{path}: default_factory"
        if type(a) in (collections.OrderedDict, OrderedCfg):
            assert_equal(list(a.items()), list(b.items()), path)
            assert hasattr(b, "_metadata") == (getattr(a, "_metadata", None) is not None), f"{path}: _metadata"
            if hasattr(b, "_metadata"):
                assert_equal(a._metadata, b._metadata, f"{path}._metadata")
        else:
            assert_equal(_sorted_items(a), _sorted_items(b), path)
    elif isinstance(a, torch.Generator):
        assert a.device == b.device and torch.equal(a.get_state(), b.get_state()), path
    elif isinstance(a, np.random.Generator):
        assert_equal(_bitgen(a.bit_generator), _bitgen(b.bit_generator), path)
    elif isinstance(a, np.random.RandomState):
        sa, sb = a.get_state(legacy=False), b.get_state(legacy=False)
        assert_equal((sa["has_gauss"], sa["gauss"]), (sb["has_gauss"], sb["gauss"]), path)
        assert_equal(_bitgen(a._bit_generator), _bitgen(b._bit_generator), path)
    elif isinstance(a, np.random.BitGenerator):
        assert_equal(_bitgen(a), _bitgen(b), path)
    elif isinstance(a, random.Random):
        assert_equal(a.getstate(), b.getstate(), path)
    elif isinstance(a, Box):
        assert_equal(a.value, b.value, f"{path}.value")
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_equal(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, enum.Enum):
        assert a is b, f"{path}: {a!r} is not {b!r}"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


# ------------------------------------------------------------------ keys and leaves


def _nan(bits: int) -> float:
    return struct.unpack(">d", struct.pack(">Q", bits))[0]


nans = st.builds(lambda sign, payload: _nan(sign | 0x7FF0000000000000 | payload),
                 st.sampled_from([0, 1 << 63]), st.integers(1, 2**52 - 1))
# (a NaN of fixed bits is a new float object each time: two of them are two dict keys that tie)
floats = st.one_of(st.floats(), nans, st.sampled_from([-0.0, 0.0, math.inf, -math.inf, 5e-324, 2.0**53]),
                   st.sampled_from([0x7FF8000000000000, 0xFFF0000000000001]).map(_nan))
ints = st.one_of(st.integers(-(2**70), 2**70), st.integers(-(2**300), 2**300),
                 st.sampled_from([2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1]))
texts = st.one_of(st.text(max_size=6), st.sampled_from(["", "\ud800", "a\x00", "\u2028", "__metadata__", "é"]))
NUMPY_INTS = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]
numpy_keys = st.one_of(
    st.builds(lambda t, n: t(n % (2 ** (8 * np.dtype(t).itemsize))) if np.dtype(t).kind == "u"
              else t(n % 2 ** (8 * np.dtype(t).itemsize - 1)), st.sampled_from(NUMPY_INTS), st.integers(0, 2**64)),
    st.sampled_from([np.True_, np.False_]), texts.map(np.str_), st.binary(max_size=4).map(np.bytes_))
other_keys = st.sampled_from([torch.float32, torch.int8, torch.bfloat16, *Color, *Level])
key_leaves = st.one_of(st.none(), st.booleans(), ints, floats, texts, st.binary(max_size=5), numpy_keys, other_keys)
keys = st.recursive(key_leaves, lambda k: st.one_of(st.lists(k, max_size=3).map(tuple), st.frozensets(k, max_size=3)),
                    max_leaves=5)

TORCH_VALUES = [torch.Size([2, 0]), torch.Size([]), torch.Size([-1]), torch.Size([2**63 - 1]),
                torch.device("cpu"), torch.device("cuda", 3), torch.device("cpu", 0), torch.device("meta"),
                torch.device("privateuseone", 2), torch.device("cuda", 127)]
TORCH_VALUES += [d for d in vars(torch).values() if isinstance(d, torch.dtype)]
NUMPY_SCALARS = [np.float32(-0.0), np.int8(-5), np.bool_(True), np.uint64(2**64 - 1), np.float16(np.nan),
                 np.complex128(1 - 2j), np.longdouble(1), np.str_("a"), np.bytes_(b"x"), np.datetime64(1, "s"),
                 np.dtype(">f8").type(1.5), np.void(b"ab")]
ODD_VALUES = [Level.HIGH, *Color, collections.defaultdict(int, a=1), collections.Counter("ab"),
              type("StrSub", (str,), {})("s"), Pair(1, 2), collections.namedtuple("Unregistered", "a")(1),
              lambda: 0, print, torch.nn.Linear(1, 1), slice(1), range(3), Ellipsis, bytearray(b"x"),
              memoryview(b"x")]
scalars = st.one_of(key_leaves, st.complex_numbers(allow_nan=True), st.sampled_from(TORCH_VALUES),
                    st.sampled_from(NUMPY_SCALARS), st.sampled_from(ODD_VALUES))


# the default factories a defaultdict may have (docs/FORMAT.md §6.10.2), and some it may not
FACTORIES = st.sampled_from([None, *stdkinds.FACTORIES.values(), lambda: 0, Point, collections.UserDict])


def _odict(pairs: list, metadata: typing.Any) -> collections.OrderedDict:
    od = collections.OrderedDict(pairs)
    if metadata is not None:
        od._metadata = metadata[0]  # type: ignore[attr-defined]
    return od


# lists that format version 3 packs (docs/FORMAT.md §6.13), at the bounds of each element type, and
# lists near them that it does not (a bool, a big int, ints no type holds, a nested value in a dict)
packable_ints = st.one_of(st.integers(-(2**63), 2**64 - 1), st.integers(-200, 300), st.integers(0, 70_000),
                          st.sampled_from([0, 255, 256, -128, -129, 65535, 2**32, -(2**31) - 1, 2**63]))
record_keys = st.one_of(st.sampled_from(["loss", "step", "epoch", "", "é"]), texts)


def packable_lists(children: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(
        st.lists(packable_ints, min_size=15, max_size=20),
        st.lists(st.one_of(packable_ints, st.booleans(), ints), min_size=15, max_size=18),
        st.lists(st.dictionaries(record_keys, st.one_of(key_leaves, floats), max_size=3), min_size=1, max_size=5),
        st.lists(st.dictionaries(record_keys, st.one_of(key_leaves, children), max_size=3), min_size=2, max_size=4),
    )


def containers(children: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(
        packable_lists(children),
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(keys, children, max_size=3),
        st.builds(_odict, st.lists(st.tuples(keys, children), max_size=3), st.none() | st.tuples(children)),
        st.frozensets(keys, max_size=3).map(set),
        st.frozensets(keys, max_size=3),
        st.builds(Point, children, children),
        st.builds(Frozen, children),
        st.builds(Pair, children, children),
        st.builds(Box, children),
        st.dictionaries(keys, children, max_size=3).map(collections.Counter),
        st.dictionaries(keys, children, max_size=3).map(Cfg),
        st.lists(children, max_size=3).map(Steps),
        st.lists(st.tuples(keys, children), max_size=3).map(OrderedCfg),
        st.builds(collections.defaultdict, FACTORIES, st.dictionaries(keys, children, max_size=3)),
        st.builds(collections.deque, st.lists(children, max_size=3), st.none() | st.integers(0, 4)),
    )


@budget(1200)
@given(st.recursive(scalars, containers, max_leaves=8))
def test_containers_keys_and_leaves(value):
    check(value, mapped=False)


# ------------------------------------------------------------------ tensors and arrays

DTYPES = sorted((d for d in vars(torch).values() if isinstance(d, torch.dtype)), key=str)


class Made:
    """A generated tensor or array with a description for failure reports (torch's own repr fails
    for the sub-byte dtypes)."""

    def __init__(self, value: typing.Any, text: str) -> None:
        self.value, self.text = value, text

    def __repr__(self) -> str:
        return self.text


def unwrap(v: typing.Any) -> typing.Any:
    return v.value if isinstance(v, Made) else [unwrap(x) for x in v] if type(v) is list else v
_SAME_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.complex128}


@st.composite
def tensors(draw: st.DrawFn) -> Made:
    dtype = draw(st.sampled_from(DTYPES))
    size = dtype.itemsize
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=5)))
    n = math.prod(shape)
    raw = bytearray(draw(st.binary(min_size=n * size, max_size=n * size)))
    base = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    try:
        t = base.view(_SAME_SIZE[size]).reshape(shape)  # views and layouts on an int of the same size
    except (KeyError, RuntimeError):
        t = base
    ops = draw(st.lists(st.sampled_from(["T", "step", "narrow", "expand", "channels_last", "unsqueeze"]),
                        max_size=3))
    for op in ops:
        if op == "T" and t.dim() >= 2:
            t = t.transpose(0, -1)
        elif op == "step" and t.dim() and t.shape[0] > 1:
            t = t[::2]
        elif op == "narrow" and t.dim() and t.shape[-1] > 1:
            t = t.narrow(-1, 1, t.shape[-1] - 1)
        elif op == "expand" and t.dim() and t.shape[0]:
            t = t[:1].expand(3, *t.shape[1:])
        elif op == "channels_last" and t.dim() in (4, 5):
            t = t.contiguous(memory_format=torch.channels_last if t.dim() == 4 else torch.channels_last_3d)
        elif op == "unsqueeze":
            t = t.unsqueeze(draw(st.integers(0, t.dim())))
    if str(dtype).startswith(("torch.q", "torch.bits")) or dtype.itemsize != t.dtype.itemsize:
        return draw(st.sampled_from([Made(torch.ones(2).to_sparse(), "sparse"),
                                     Made(torch.empty(2, device="meta"), "meta"),
                                     Made(torch.ones(2, 2).to_sparse_csr(), "sparse_csr")]))
    try:
        t = t.view(dtype)
    except RuntimeError:
        assume(False)
    lazy = draw(st.sampled_from(["", "conj", "neg"]))
    if lazy == "conj" and dtype in (torch.complex64, torch.complex128):
        t = t.conj()
    elif lazy == "neg" and dtype in (torch.float32, torch.int64, torch.complex64):
        t = torch._neg_view(t)
    kind = draw(st.sampled_from(["tensor", "parameter", "grad"]))
    if kind != "tensor" and dtype.is_floating_point:
        t = torch.nn.Parameter(t, requires_grad=draw(st.booleans())) if kind == "parameter" \
            else t.clone().requires_grad_()
    return Made(t, f"tensor({dtype}, shape={tuple(t.shape)}, stride={t.stride()}, ops={ops}, lazy={lazy!r}, "
                   f"kind={kind}, {raw.hex()})")


_JAGGED_HINTS = {"min_seqlen", "max_seqlen"} <= set(
    inspect.signature(torch.nested.nested_tensor_from_jagged).parameters)  # (torch 2.4 may lack them)


@st.composite
def tensor_kinds(draw: st.DrawFn) -> Made:
    """docs/FORMAT.md §6.12: sparse tensors of every layout (COO coalesced or not, hybrid, empty), nested
    tensors (strided, jagged, with or without cached lengths), meta tensors, tensors and Parameters
    with attributes set on them (some of values the format refuses), and kinds refused with advice."""
    what = draw(st.sampled_from(["coo", "csr", "csc", "bsr", "bsc", "strided", "jagged", "meta", "attrs",
                                 "refused"]))
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.int16, torch.bool, torch.complex64,
                                  torch.bfloat16]))
    grad = draw(st.booleans()) and (dtype.is_floating_point or dtype.is_complex)
    rows, cols = draw(st.integers(0, 4)), draw(st.integers(0, 4))
    vals = st.integers(-3, 3)
    dense = torch.tensor(draw(st.lists(vals, min_size=rows * cols, max_size=rows * cols)),
                         dtype=torch.int64).reshape(rows, cols).to(dtype)
    if what == "coo":
        nnz = draw(st.integers(0, 5)) if rows and cols else 0
        idx = [[draw(st.integers(0, n - 1)) for _ in range(nnz)] for n in (rows, cols)]
        hybrid = draw(st.integers(0, 2))
        values = torch.tensor(draw(st.lists(vals, min_size=nnz * hybrid or nnz, max_size=nnz * hybrid or nnz)),
                              dtype=torch.int64).reshape((nnz, hybrid) if hybrid else (nnz,)).to(dtype)
        size = (rows, cols, hybrid) if hybrid else (rows, cols)
        t = torch.sparse_coo_tensor(torch.tensor(idx, dtype=torch.int64).reshape(2, nnz), values, size)
        if draw(st.booleans()):
            t = t.coalesce()  # (else uncoalesced, written as it holds its indices)
    elif what in ("csr", "csc"):
        t = dense.to_sparse_csr() if what == "csr" else dense.to_sparse_csc()
    elif what in ("bsr", "bsc"):
        t = torch.cat([dense, dense]).repeat(1, 2)
        t = t.to_sparse_bsr((2, 2)) if what == "bsr" else t.to_sparse_bsc((2, 2))
    elif what in ("strided", "jagged"):
        lengths = draw(st.lists(st.integers(0 if what == "strided" else 1, 3), min_size=1, max_size=3))
        parts = [torch.arange(n * 2, dtype=torch.int64).reshape(n, 2).to(dtype) for n in lengths]
        layout = torch.strided if what == "strided" else torch.jagged
        t = torch.nested.nested_tensor(parts, layout=layout)
        if what == "jagged" and _JAGGED_HINTS and draw(st.booleans()):  # the lengths it caches: none, or by hand
            seqlen = st.one_of(st.none(), st.integers(0, 5))
            t = torch.nested.nested_tensor_from_jagged(t.values(), t.offsets(), min_seqlen=draw(seqlen),
                                                       max_seqlen=draw(seqlen))
    elif what == "meta":
        t = torch.empty(tuple(draw(st.lists(st.integers(0, 5), max_size=3))), dtype=dtype, device="meta")
    elif what == "attrs":
        t = torch.nn.Parameter(dense.clone(), requires_grad=grad) if grad else dense.clone()
        for name in draw(st.lists(st.sampled_from(["foo", "_bar", "é", "labels"]), max_size=3, unique=True)):
            setattr(t, name, draw(st.one_of(key_leaves, st.just([1, "a"]), st.just(print), st.just(torch.ones(1)))))
    else:
        t = draw(st.sampled_from([
            torch.quantize_per_tensor(torch.ones(2), 0.5, 1, torch.quint8),
            torch.nn.parameter.UninitializedParameter(),
            torch.nn.Parameter(torch.nested.nested_tensor([torch.ones(1)])),
            torch.nested.narrow(torch.ones(2, 3), 1, torch.tensor([0, 1]), torch.tensor([1, 2]), layout=torch.jagged),
        ]))
        return Made(t, f"refused {type(t).__name__}")
    if grad and what not in ("attrs", "meta") or (grad and what == "meta"):
        t = t.requires_grad_()
        if what == "jagged" and draw(st.booleans()):
            t.values()  # (torch then caches its sizes in its __dict__: not attributes, issue 37)
    if draw(st.booleans()) and what not in ("attrs", "strided") and not t.requires_grad:
        t.note = draw(st.sampled_from(["x", 1, None]))  # an attribute on a sparse or meta tensor too
    return Made(t, f"{what}({dtype}, {rows}x{cols}, grad={grad})")


NP_DTYPES = ["?", "u1", "i1", "<u2", ">u2", "<i4", ">i8", "<f2", ">f4", "<f8", "<c8", ">c16", "<u8",
             "O", "<U2", "V3", "<M8[s]", "g", "i1,i1"]


@st.composite
def arrays(draw: st.DrawFn) -> Made:
    dtype = np.dtype(draw(st.sampled_from(NP_DTYPES)))
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=4)))
    if dtype.hasobject:
        return Made(np.empty(shape, dtype=dtype), f"array({dtype}, shape={shape})")
    n = math.prod(shape)
    raw = np.frombuffer(draw(st.binary(min_size=n * dtype.itemsize, max_size=n * dtype.itemsize)), np.uint8)
    a = raw.copy().view(dtype).reshape(shape)  # bool arrays may hold bytes other than 0 and 1
    if draw(st.booleans()) and a.ndim >= 2:
        a = a.T
    if draw(st.booleans()) and a.ndim and a.shape[0] > 1:
        a = a[::2]
    return Made(a, f"array({dtype}, shape={a.shape}, strides={a.strides}, {raw.tobytes().hex()})")


@budget(1000)
@given(st.recursive(st.one_of(tensors(), arrays()), lambda c: st.lists(c, max_size=3), max_leaves=4))
def test_tensors_and_arrays(value):
    check(unwrap(value))


@budget(150)
@given(st.recursive(tensor_kinds(), lambda c: st.lists(c, max_size=3), max_leaves=3))
def test_tensor_kinds(value):
    value = unwrap(value)
    check(value)
    check([value, value])  # the same object twice: one object at load (§6.12)


# ------------------------------------------------------------------ built-in codecs

class Zone(dt.tzinfo):
    """A tzinfo that is not a datetime.timezone (as zoneinfo.ZoneInfo and pytz zones are not): refused."""

    def utcoffset(self, when: typing.Any) -> dt.timedelta:
        return dt.timedelta(hours=1)

    def dst(self, when: typing.Any) -> dt.timedelta:
        return dt.timedelta(0)


path_texts = st.one_of(st.text(alphabet="/.a\\:Cc\x00 ", max_size=8), st.text(max_size=4))
PATH_CLASSES = [pathlib.PurePosixPath, pathlib.PureWindowsPath, pathlib.PosixPath,
                type("MyPath", (pathlib.PurePosixPath,), {})]
offsets = st.integers(-86_399_999_999, 86_399_999_999).map(lambda us: dt.timedelta(microseconds=us))
zones = st.one_of(st.none(), st.just(dt.timezone.utc), offsets.map(dt.timezone),
                  st.builds(dt.timezone, offsets, st.text(min_size=1, max_size=3)),
                  st.just(Zone()))


class MyDate(dt.date):
    pass


builtin_values = st.one_of(
    st.builds(lambda cls, text: cls(text), st.sampled_from(PATH_CLASSES), path_texts),
    st.dates(), st.builds(MyDate, st.integers(1, 9999), st.integers(1, 12), st.integers(1, 28)),
    st.times(timezones=zones).flatmap(lambda t: st.sampled_from([t, t.replace(fold=1)])),
    st.datetimes(timezones=zones).flatmap(lambda t: st.sampled_from([t, t.replace(fold=1)])),
    st.timedeltas(),
    st.builds(lambda d: argparse.Namespace(**d), st.dictionaries(texts, scalars, max_size=3)),
    st.builds(lambda k, v: _namespace_with(k, v), keys, scalars),
)


def _namespace_with(key: typing.Any, value: typing.Any) -> argparse.Namespace:
    ns = argparse.Namespace()
    ns.__dict__[key] = value  # a key setattr cannot make: a namespace is refused unless its keys are str
    return ns


@budget(600)
@given(st.recursive(builtin_values, lambda c: st.lists(c, max_size=3), max_leaves=4))
def test_builtin_codecs(value):
    check(value, mapped=False)


# ------------------------------------------------------------------ random state

BITGENS = [np.random.PCG64, np.random.PCG64DXSM, np.random.MT19937, np.random.Philox, np.random.SFC64]
entropies = st.one_of(st.none(), st.integers(0, 2**130), st.lists(st.integers(0, 2**70), max_size=3),
                      st.integers(0, 2**63).map(np.uint64), st.just(range(3)),
                      st.lists(st.integers(0, 2**32 - 1), max_size=3).map(lambda v: np.array(v, dtype=np.uint32)))
seed_seqs = st.builds(np.random.SeedSequence, entropies,
                      spawn_key=st.lists(st.integers(0, 2**70), max_size=3).map(tuple),
                      pool_size=st.sampled_from([4, 5, 1024, 1025]),
                      n_children_spawned=st.sampled_from([0, 3, 2**32 - 1]))
small_ints = st.one_of(st.integers(0, 6), st.integers(0, 2**32 - 1), st.sampled_from([623, 624, 625, 2**64 - 1]))


def _perturbed(state: typing.Any, draw: st.DrawFn) -> typing.Any:
    """``state`` (a bit generator's state dict) with some int fields set to other ints."""
    if isinstance(state, dict):
        return {k: v if k == "bit_generator" else _perturbed(v, draw) for k, v in state.items()}
    if isinstance(state, (int, np.integer)) and draw(st.integers(0, 4)) == 0:
        return draw(small_ints)
    return state


@st.composite
def bit_generators(draw: st.DrawFn, perturb: bool = True) -> typing.Any:
    cls = draw(st.sampled_from(BITGENS))
    how = draw(st.sampled_from(["seed_seq", "legacy", "int"]))
    if how == "legacy":
        bg = np.random.RandomState(draw(st.integers(0, 2**32 - 1)))._bit_generator
    else:
        bg = cls(draw(seed_seqs) if how == "seed_seq" else draw(st.integers(0, 2**64)))
    bg.random_raw(draw(st.integers(0, 700)))
    if perturb and draw(st.booleans()):  # (nothing draws from it afterwards: numpy may crash on it)
        try:
            bg.state = _perturbed(bg.state, draw)
        except (ValueError, TypeError, OverflowError, KeyError):
            pass  # numpy refused it: nobody can save it
    return bg


@st.composite
def legacy_states(draw: st.DrawFn) -> np.random.RandomState:
    rs = np.random.RandomState(draw(bit_generators(perturb=False)) if draw(st.booleans())
                               else draw(st.integers(0, 2**32 - 1)))
    rs.standard_normal(draw(st.integers(0, 3)))
    if draw(st.booleans()):
        st_ = rs.get_state(legacy=False)
        st_["has_gauss"], st_["gauss"] = draw(st.integers(0, 3)), draw(floats)
        try:
            rs.set_state(st_)
        except (ValueError, TypeError, OverflowError):
            pass
    return rs


@st.composite
def pythons(draw: st.DrawFn) -> random.Random:
    r = random.Random(draw(st.integers(0, 2**70)))
    if draw(st.booleans()):
        r.gauss(0.0, 1.0)
    if draw(st.booleans()):
        version, internal, gauss = r.getstate()
        pos = draw(st.integers(0, 700))
        gauss = draw(st.one_of(st.none(), floats, st.integers(), st.just("x")))
        try:
            r.setstate((version, internal[:-1] + (pos,), gauss))
        except (ValueError, TypeError, OverflowError):
            pass
    return r


def _cpu_state(draw: st.DrawFn) -> bytes:
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**64 - 1)))
    torch.rand(draw(st.integers(0, 700)), generator=g)
    if draw(st.booleans()):
        torch.randn(1, generator=g)
    state = bytearray(g.get_state().numpy().tobytes())
    for _ in range(draw(st.integers(0, 2))):
        offset = draw(st.sampled_from([0, 8, 9, 12, 16, 24, 5016, 5024, 5032, 5040, 5044, 5048, 5052, 5053]))
        state[offset] = draw(st.integers(0, 255))
    return bytes(state)


@st.composite
def torch_generators(draw: st.DrawFn) -> torch.Generator:
    g = torch.Generator()
    try:
        g.set_state(torch.frombuffer(bytearray(_cpu_state(draw)), dtype=torch.uint8))
    except RuntimeError:
        pass  # torch refused the perturbed state: the seeded one stays
    return g


philox_states = st.builds(lambda seed, offset: struct.pack("<Qq", seed, offset),
                          st.integers(0, 2**64 - 1), st.integers(-(2**63), 2**63 - 1) | st.sampled_from([-4, 4, 2]))


@st.composite
def rng_states(draw: st.DrawFn) -> RngState:
    r = draw(pythons())
    rs = draw(legacy_states())
    name, fields = rng.bitgen_fields(rs.get_state(legacy=False))
    s = rs.get_state(legacy=False)
    state = RngState(python=r.getstate(), numpy=(name, fields, int(s["has_gauss"]), float(s["gauss"])),
                     torch_cpu=_cpu_state(draw),
                     cuda=tuple(draw(st.lists(philox_states, max_size=2))),
                     mps=draw(st.none() | st.binary(min_size=35, max_size=37)),
                     xpu=tuple(draw(st.lists(philox_states, max_size=1))))
    odd = draw(st.sampled_from(["", "python", "numpy", "cuda"]))
    if odd:  # a field of the wrong shape, as a program may build by hand
        wrong = {"python": (3, (1, 2), None), "numpy": ("PCG64", (1,), 0, 0.0), "cuda": [b"\x00" * 16]}[odd]
        state = dataclasses.replace(state, **{odd: wrong})
    return state


random_values = st.one_of(bit_generators(), bit_generators().map(np.random.Generator), legacy_states(), pythons(),
                          torch_generators(), rng_states())


@budget(800)
@given(st.lists(random_values, min_size=1, max_size=2))
def test_random_state(value):
    check(value, mapped=False)


# ------------------------------------------------------------------ determinism settings

_FIELD_VALUES = st.one_of(st.booleans(), st.integers(-2, 2**70), texts, st.none(), floats,
                          st.sampled_from(["highest", "high", "medium", "ieee", ":4096:8"]),
                          st.lists(texts, max_size=2).map(tuple), st.lists(st.integers(0, 200), max_size=2).map(tuple),
                          st.lists(texts, max_size=1))


@st.composite
def settings_values(draw: st.DrawFn) -> DeterminismSettings:
    """Captured settings with some fields set to arbitrary values, bypassing the constructor's checks
    (a program can: ``object.__setattr__``), so that the writer's own check is exercised."""
    s = DeterminismSettings.capture()
    fields = [f.name for f in dataclasses.fields(s)]
    for name in draw(st.lists(st.sampled_from(fields), max_size=2)):
        kind = type(getattr(s, name))
        same_type = st.from_type(kind) if kind in (bool, int, str) else _FIELD_VALUES
        object.__setattr__(s, name, draw(st.one_of(same_type, _FIELD_VALUES)))
    return s


@budget(400)
@given(settings_values())
def test_determinism_settings(value):
    fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    try:
        DeterminismSettings(**fields)
        built = True
    except TensorCanonError:
        built = False
    saved = check(value, mapped=False)
    # the writer refuses what the constructor refuses, and beyond that only text that is not Unicode
    assert saved == (built and all(_unicode(v) for v in fields.values()))


def _unicode(v: typing.Any) -> bool:
    if type(v) is tuple:
        return all(map(_unicode, v))
    return type(v) is not str or not any(0xD800 <= ord(c) <= 0xDFFF for c in v)


# ------------------------------------------------------------------ user metadata


@budget(200)
@given(st.recursive(scalars, containers, max_leaves=4), st.one_of(st.none(), st.dictionaries(keys, scalars, max_size=2),
                                                             st.just([1]), st.just({"t": torch.ones(1)})))
def test_metadata(value, metadata):
    check(value, metadata=metadata, mapped=False)


# ------------------------------------------------------------------ examples the search found


def test_subclass_of_a_registered_type_is_refused_unless_registered_itself():
    @dataclasses.dataclass
    class Sub(Point):
        pass

    class SubPair(Pair):
        pass

    @dataclasses.dataclass
    class Wider(Point):
        z: int = 0

    for value in (Sub(1, 2), SubPair(1, 2), Wider(1, 2, 3)):  # each would load as its base (issue 30)
        assert not check(value, mapped=False)
    for cls in (Sub, SubPair):
        tensorcanon.register(cls)
    try:
        assert check(Sub(1, 2), mapped=False) and check(SubPair(1, 2), mapped=False)
    finally:
        tensorcanon.unregister(Sub)
        tensorcanon.unregister(SubPair)
    box = type("SubBox", (Box,), {})(3)  # a codec of its own decides: it loads as a Box
    assert check(box, expected=Box(3), mapped=False)


def test_channels_last_tensors_of_every_dtype_load():
    """Found by the search: a channels-last tensor of a dtype torch has no copy kernel for (the sub-byte
    ints, float8_e8m0fnu, float4_e2m1fn_x2) saved, and loading it failed in torch (tensorbytes.in_memory_format)."""
    for dtype in DTYPES:
        if str(dtype).startswith(("torch.q", "torch.bits")):
            continue
        flat = torch.arange(2 * 3 * 2 * 2 * dtype.itemsize, dtype=torch.uint8).view(_SAME_SIZE[dtype.itemsize])
        t = flat.reshape(2, 3, 2, 2).contiguous(memory_format=torch.channels_last).view(dtype)
        assert tensorbytes.memory_format(t) == "channels_last" and check(t), dtype
