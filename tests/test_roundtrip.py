"""Every saveable type comes back with the same type, value and aliasing."""

import collections
import io
import math
import struct

import numpy as np
import pytest
import torch

import tensorcanon as tc

from support import WriteOnlyStream, have_dtypes, torch_dtype


def _raw(t):
    """A tensor's bytes as a flat uint8 tensor (an empty one for no elements)."""
    return t.contiguous().view(-1).view(torch.uint8) if t.numel() else t.new_empty(0, dtype=torch.uint8)


def same(a, b):
    """Exact equality, including types, bits of floats, dtypes and devices."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device
        assert a.requires_grad == b.requires_grad
        assert torch.equal(_raw(a.detach().resolve_conj().resolve_neg()), _raw(b.detach()))
    elif isinstance(a, np.ndarray):
        assert a.dtype.newbyteorder("=") == b.dtype and a.shape == b.shape
        assert np.ascontiguousarray(a).astype(b.dtype).tobytes() == b.tobytes()
    elif isinstance(a, float):
        assert struct.pack(">d", a) == struct.pack(">d", b)
    elif isinstance(a, complex):
        assert struct.pack(">dd", a.real, a.imag) == struct.pack(">dd", b.real, b.imag)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            same(x, y)
    elif isinstance(a, dict):
        assert list(a) == list(b) if isinstance(a, collections.OrderedDict) else set(a) == set(b)
        for k in a:
            same(a[k], b[k])
        assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None)
    else:
        assert a == b


SCALARS = [None, True, False, 0, -1, 2**63 - 1, -(2**63), 2**64 - 1, 2**64, -(2**63) - 1, 2**200, -(2**200),
           0.0, -0.0, 1.5, math.inf, -math.inf, struct.unpack(">d", bytes.fromhex("7ff8000000000123"))[0],
           1 + 2j, complex(-0.0, math.nan), "", "héllo ✓", b"", b"\x00\xff", torch.Size([2, 0, 3]), torch.Size([]),
           torch.float8_e4m3fn, torch.qint8, torch.device("cpu"), torch.device("cuda", 1),
           np.float32(1.5), np.int64(-3), np.bool_(True), np.uint16(7), np.complex128(1 - 1j), np.float16(0.5)]


@pytest.mark.parametrize("value", SCALARS, ids=repr)
def test_scalar_values_round_trip(value):
    same(value, tc.loads(tc.dumps(value)))


def test_containers_keep_their_types():
    od = collections.OrderedDict([("z", 1), ("a", 2)])
    obj = {"list": [1, [2]], "tuple": (1, (2,)), "set": {3, 1, 2}, "fs": frozenset({"b", "a"}), "od": od,
           "empty": [(), {}, set(), frozenset(), collections.OrderedDict()], 3: "int key", (1, "x"): "tuple key"}
    out = tc.loads(tc.dumps(obj))
    same(obj, out)
    assert list(out["od"]) == ["z", "a"]


ALL_DTYPES = ["bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64", "float16",
              "bfloat16", "float32", "float64", "complex32", "complex64", "complex128", "float8_e5m2",
              "float8_e4m3fn", "float8_e5m2fnuz", "float8_e4m3fnuz", "float8_e8m0fnu"]


def random_tensor(dtype, shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (math.prod(shape) * dtype.itemsize,), dtype=torch.uint8, generator=g)
    if dtype is torch.bool:
        return (raw[: math.prod(shape)] & 1).bool().reshape(shape)
    return raw.view(dtype).reshape(shape)


@pytest.mark.parametrize("dtype", have_dtypes(ALL_DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 3), (2, 0, 4)], ids=str)
def test_every_dtype_and_shape(dtype, shape):
    t = random_tensor(torch_dtype(dtype), shape)
    out = tc.loads(tc.dumps({"t": t}))["t"]
    same(t, out)


def test_views_are_written_as_logical_values():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    views = {"t": base.t(), "slice": base[1:3, ::2], "expand": torch.tensor([1.0, 2.0]).expand(3, 2),
             "conj": torch.tensor([1 + 2j, 3 - 1j]).conj(), "neg": torch.tensor([1 + 2j]).conj().imag}
    out = tc.loads(tc.dumps(views))
    for k, v in views.items():
        assert torch.equal(out[k], v.resolve_conj().resolve_neg()), k
        assert out[k].is_contiguous() and not out[k].is_conj()
    # a 2-element view of a big tensor writes 2 elements, not the storage
    assert len(tc.dumps({"v": torch.zeros(1_000_000)[:2]})) < 2000


def test_bool_is_stored_as_zero_or_one():
    weird = torch.tensor([0, 2, 255], dtype=torch.uint8).view(torch.bool)
    assert tc.dumps(weird) == tc.dumps(torch.tensor([False, True, True]))


def test_tied_tensors_stay_tied_and_overlapping_ones_do_not():
    w = torch.randn(4, 4)
    obj = {"a": w, "b": w, "c": w.detach(), "row": w[0], "row2": w[0]}
    out = tc.loads(tc.dumps(obj))
    assert out["a"] is out["b"] is out["c"]
    assert out["row"] is out["row2"] and out["row"] is not out["a"]
    out["a"].add_(1)
    assert not torch.equal(out["row"], out["a"][0])  # overlapping views are separate copies


def test_module_state_dict_with_tied_weights():
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    sd = model.state_dict()
    out = tc.loads(tc.dumps(sd))
    same(sd, out)
    assert out["emb.weight"] is out["head.weight"]
    fresh = torch.nn.ModuleDict({"emb": torch.nn.Embedding(10, 4), "head": torch.nn.Linear(4, 10, bias=False)})
    fresh.load_state_dict(out)
    assert torch.equal(fresh["head"].weight, emb.weight)


def test_parameters_and_requires_grad():
    p = torch.nn.Parameter(torch.randn(3))
    frozen = torch.nn.Parameter(torch.randn(3), requires_grad=False)
    leaf = torch.randn(2, requires_grad=True)
    out = tc.loads(tc.dumps({"p": p, "frozen": frozen, "leaf": leaf, "nonleaf": leaf * 2}))
    assert type(out["p"]) is torch.nn.Parameter and out["p"].requires_grad
    assert type(out["frozen"]) is torch.nn.Parameter and not out["frozen"].requires_grad
    assert type(out["leaf"]) is torch.Tensor and out["leaf"].requires_grad and out["leaf"].is_leaf
    assert out["nonleaf"].requires_grad and out["nonleaf"].is_leaf


@pytest.mark.parametrize("dtype", ["bool", "u1", "i1", "<u2", ">i2", "<u4", ">i4", "<u8", "<i8", "<f2", ">f4", "<f8",
                                   "<c8", ">c16"])
def test_numpy_arrays_come_back_as_numpy(dtype):
    a = (np.arange(12) % 3).astype(dtype).reshape(3, 4)[:, ::2]
    out = tc.loads(tc.dumps({"a": a}))["a"]
    assert type(out) is np.ndarray and out.dtype == a.dtype.newbyteorder("=")
    np.testing.assert_array_equal(out, a)


def test_same_values_same_tensor_digest_across_layouts():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert tc.fingerprint({"x": t}) == tc.fingerprint({"x": t.t().contiguous().t()})
    assert tc.fingerprint({"x": t}) == tc.fingerprint({"x": torch.arange(12, dtype=torch.float32).reshape(3, 4)})


def test_metadata_round_trip_and_digest():
    d1 = tc.dumps({"w": torch.ones(2)}, metadata={"epoch": 3, "note": "x"})
    assert tc.read_metadata(d1) == {"epoch": 3, "note": "x"}
    with_metadata = tc.fingerprint({"w": torch.ones(2)}, metadata={"epoch": 3, "note": "x"})
    assert with_metadata != tc.fingerprint({"w": torch.ones(2)})
    with pytest.raises(tc.UnsupportedTypeError):
        tc.dumps({}, metadata={"t": torch.ones(1)})


def test_file_objects_seekable_and_not(tmp_path):
    obj = {"w": torch.randn(100), "n": [1, 2]}
    buf = io.BytesIO()
    d = tc.save(obj, buf)

    pipe = WriteOnlyStream()
    assert tc.save(obj, pipe) == d
    assert pipe.data == buf.getvalue() == tc.dumps(obj)
    buf.seek(0)
    same(obj, tc.load(buf))
    assert tc.save(obj, tmp_path / "x.tc") == d
    assert (tmp_path / "x.tc").read_bytes() == buf.getvalue()
    assert tc.verify(tmp_path / "x.tc") == d == tc.verify(str(tmp_path / "x.tc"), expect=d)
