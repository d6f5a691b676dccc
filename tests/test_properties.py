"""Property tests: random object trees round-trip exactly, and their bytes are canonical.

Trees mix every container type, keys of every key type, tensors of random
dtypes and shapes, non-contiguous views, numpy arrays and aliasing (the same
tensor object, or the same view of one storage, in several places).
"""

import collections
import io
import math
import random

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import tensorcanon as tc

from compare import assert_same
from support import WriteOnlyStream, torch_dtypes

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

DTYPES = torch_dtypes("bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64", "float16",
                      "bfloat16", "float32", "float64", "complex32", "complex64", "complex128", "float8_e4m3fn",
                      "float8_e5m2", "float8_e8m0fnu", "uint4", "int2")
NP_DTYPES = [np.bool_, np.uint8, np.int16, np.int32, np.int64, np.uint64, np.float16, np.float32, np.float64,
             np.complex64, np.complex128, ">f4", ">i8"]


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    n = math.prod(shape)
    raw = draw(st.binary(min_size=n * dtype.itemsize, max_size=n * dtype.itemsize))
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)
    if dtype is torch.bool:
        t = (t & 1).bool()
    else:
        t = t.view(dtype)
    t = t.reshape(shape)
    if draw(st.booleans()) and t.dim() >= 2:
        t = t.transpose(0, 1)
    if draw(st.booleans()) and t.dim() >= 1 and t.shape[0] > 1:
        t = t[::2]
    if dtype.is_complex and dtype is not torch.complex32 and draw(st.booleans()):
        t = t.conj()
    if draw(st.booleans()) and dtype.is_floating_point and dtype.itemsize >= 2:
        t = torch.nn.Parameter(t.contiguous(), requires_grad=draw(st.booleans()))
    return t


@st.composite
def arrays(draw):
    dtype = np.dtype(draw(st.sampled_from(NP_DTYPES)))
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
    n = math.prod(shape)
    raw = draw(st.binary(min_size=n * dtype.itemsize, max_size=n * dtype.itemsize))
    a = np.frombuffer(raw, dtype=np.uint8).copy()
    if dtype == np.bool_:
        a = (a & 1).astype(np.bool_)
    else:
        a = a.view(dtype)
    a = a.reshape(shape)
    if draw(st.booleans()) and a.ndim >= 2:
        a = a.T
    return a


keys_scalar = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False), st.text(max_size=5), st.binary(max_size=4),
)
keys = st.recursive(keys_scalar, lambda k: st.one_of(st.tuples(k, k), st.frozensets(k, max_size=3)), max_leaves=4)

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**130), 2**130),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(0, 2**64 - 1).map(lambda b: np.frombuffer(b.to_bytes(8, "little"), np.float64)[0].item()),
    st.complex_numbers(allow_nan=True), st.text(max_size=8), st.binary(max_size=8),
    st.sampled_from([torch.Size([2, 0]), torch.float32, torch.uint4, torch.device("cpu"), torch.device("cuda", 3),
                     np.float32(-0.0), np.int8(-5), np.bool_(False), np.uint64(2**64 - 1)]),
)


def _odict(pairs):
    od = collections.OrderedDict(pairs)
    return od


@st.composite
def trees(draw):
    pool = draw(st.lists(tensors(), min_size=1, max_size=4))
    pool_np = draw(st.lists(arrays(), max_size=2))

    def shared():
        i = draw(st.integers(0, len(pool) - 1))
        t = pool[i]
        # the same object, or a new object that is the same view of the same storage
        if draw(st.booleans()) and type(t) is torch.Tensor:
            return t.detach()
        return t

    ref = st.just(None).map(lambda _: shared())
    leaf = st.one_of(ref, scalars, ref, tensors(), arrays(),
                     st.sampled_from(pool_np) if pool_np else st.nothing())

    def extend(children):
        return st.one_of(
            st.lists(children, max_size=4),
            st.lists(children, max_size=4).map(tuple),
            st.dictionaries(keys, children, max_size=4),
            st.lists(st.tuples(keys, children), max_size=4).map(_odict),
            st.frozensets(keys, max_size=4).map(set),
            st.frozensets(keys, max_size=4),
        )

    tree = draw(st.recursive(leaf, extend, max_leaves=12))
    return {"tree": tree, "pool": pool, "again": shared(), "np": pool_np}


def shuffled(v, rng: random.Random):
    """A copy of ``v`` with every dict and set built in a different insertion order.
    Tensors are kept as the same objects, so aliasing is unchanged."""
    t = type(v)
    if t is dict:
        items = list(v.items())
        rng.shuffle(items)
        return {k: shuffled(x, rng) for k, x in items}
    if t is collections.OrderedDict:
        return collections.OrderedDict((k, shuffled(x, rng)) for k, x in v.items())
    if t in (set, frozenset):
        items = list(v)
        rng.shuffle(items)
        s = set()
        for x in items:
            s.add(x)
        return t(s)
    if t is list:
        return [shuffled(x, rng) for x in v]
    if t is tuple:
        return tuple(shuffled(x, rng) for x in v)
    return v


@SETTINGS
@given(trees())
def test_random_trees_round_trip_exactly(obj):
    data = tc.dumps(obj)
    out = tc.loads(data)
    assert_same(obj, out, aliases={})
    assert tc.dumps(out) == data  # loading and saving again gives the same bytes


@SETTINGS
@given(trees(), st.randoms(use_true_random=False))
def test_insertion_order_never_changes_the_bytes(obj, rng):
    assert tc.dumps(shuffled(obj, rng)) == tc.dumps(obj)


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(trees())
def test_every_way_of_writing_gives_the_same_bytes_and_digest(tmp_path, obj):
    data = tc.dumps(obj)
    fp = tc.fingerprint(obj)
    path = tmp_path / "x.safetensors"
    assert tc.save(obj, path) == fp
    assert path.read_bytes() == data
    stream = WriteOnlyStream()
    assert tc.save(obj, stream) == fp
    assert stream.data == data
    buf = io.BytesIO(b"prefix")
    buf.seek(0, io.SEEK_END)
    assert tc.save(obj, buf) == fp
    assert buf.getvalue() == b"prefix" + data
    assert tc.verify(path) == fp == tc.verify(data)
    with open(path, "rb") as f:
        assert tc.verify(f) == fp


@SETTINGS
@given(st.dictionaries(keys, st.integers(), min_size=2, max_size=8), st.randoms(use_true_random=False))
def test_key_order_is_a_total_order_independent_of_insertion(d, rng):
    items = list(d.items())
    rng.shuffle(items)
    other = dict(items)
    assert tc.dumps(other) == tc.dumps(d)
    assert list(tc.loads(tc.dumps(other))) == list(tc.loads(tc.dumps(d)))


_HEADER_TEXT = st.text(st.characters(codec="utf-8"), max_size=12) | st.text(
    st.characters(min_codepoint=0, max_codepoint=0x7F), max_size=12)  # ASCII, control characters included


@SETTINGS
@given(st.dictionaries(_HEADER_TEXT, _HEADER_TEXT, max_size=5), st.lists(_HEADER_TEXT, max_size=4, unique=True))
def test_header_json_is_the_json_encoders_for_any_names_and_metadata(metadata, names):
    """container.assemble writes plain ASCII metadata values without the JSON encoder (a fast
    path for megabytes of base64); the bytes must be json.dumps' for every input."""
    import json
    import struct

    from tensorcanon.format import container

    entries = [container.Entry(n, "F32", (1,), 4 * i, 4 * i + 4) for i, n in enumerate(names)]
    obj = {e.name: {"data_offsets": [e.begin, e.end], "dtype": "F32", "shape": [1]} for e in entries}
    for meta in (metadata, None):
        full = dict(obj, **({container.META: meta} if meta is not None else {}))
        text = json.dumps(full, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
        text += b" " * (-len(text) % 8)
        want = struct.pack("<Q", len(text)) + text
        if meta is None or container.META not in obj:
            assert container.assemble({e.name: container.entry_text(e.name, e.dtype, e.shape, e.begin, e.end)
                                       for e in entries}, meta) == want
