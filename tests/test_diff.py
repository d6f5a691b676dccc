"""tensorcanon.diff: what counts as a difference, and how each one is reported."""

import collections
import copy
import dataclasses
import math
import struct
import sys

import numpy as np
import pytest
import torch

import tensorcanon
from tensorcanon.tools.diff import Difference, DiffResult, tensor_stats

from support import have_dtypes, torch_dtype


def kinds(result):
    return [(d.path, d.kind) for d in result]


def test_identical_objects_give_an_empty_falsy_result():
    obj = {"w": torch.randn(3, 4), "n": [1, 2.5, "x", None], "t": (b"\x00", {3, 4})}
    clone = {"w": obj["w"].clone(), "n": list(obj["n"]), "t": (b"\x00", {4, 3})}
    r = tensorcanon.diff(obj, clone)
    assert isinstance(r, DiffResult) and r.identical and not r and len(r) == 0
    assert str(r) == "identical (bit-exact)"


def test_one_element_reports_count_max_differences_and_first_index():
    a = torch.zeros(3, 4)
    b = a.clone()
    b[1, 2] = 0.5
    b[2, 0] = -2.0
    (d,) = tensorcanon.diff({"m": {"w": a}}, {"m": {"w": b}})
    assert d.path == '$["m"]["w"]' and d.kind == "values"
    s = d.stats
    assert (s.numel, s.count, s.first_index, s.first_a, s.first_b) == (12, 2, (1, 2), 0.0, 0.5)
    assert s.max_abs == 2.0 and s.max_rel == 1.0  # |0 - 0.5| / 0.5 and |0 - -2| / 2
    assert str(d) == '$["m"]["w"]: 2 of 12 elements differ; max abs diff 2, max rel diff 1; first at [1, 2]: 0.0 -> 0.5'


def test_relative_difference_is_relative_to_b():
    (d,) = tensorcanon.diff(torch.tensor([1.0, 10.0]), torch.tensor([1.0, 8.0]))
    assert d.stats.max_abs == 2.0 and d.stats.max_rel == pytest.approx(0.25)
    (d,) = tensorcanon.diff(torch.tensor([1.0]), torch.tensor([0.0]))
    assert d.stats.max_rel == math.inf


def test_structure_changes_by_path():
    a = {"keep": 1, "gone": torch.ones(2), "t": torch.ones(2), "s": torch.ones(2), "l": [1, 2, 3], "k": [1]}
    b = {"keep": 1, "new": 5, "t": torch.ones(2, dtype=torch.float64), "s": torch.ones(3), "l": [1, 2], "k": (1,)}
    assert kinds(tensorcanon.diff(a, b)) == [
        ('$["gone"]', "removed"), ('$["k"]', "type"), ('$["l"]', "length"),
        ('$["new"]', "added"), ('$["s"]', "shape"), ('$["t"]', "dtype"),
    ]
    r = tensorcanon.diff(a, b)
    assert str(r.differences[0]) == '$["gone"]: only in A: tensor float32[2]'
    assert str(r.differences[3]) == '$["new"]: added in B: int 5'
    assert str(r.differences[5]) == '$["t"]: dtype float32 -> float64'


def test_scalar_types_are_exact():
    (d,) = tensorcanon.diff([1, True, 1.0], [True, 1, 1])  # a list of values: one line, 3 items differ
    assert (d.path, d.kind, d.count, d.total) == ("$", "items", 3, 3)
    assert (d.first.path, d.first.kind) == ("$[0]", "type")
    assert kinds(tensorcanon.diff({"a": 1, "b": True, "c": 1.0}, {"a": True, "b": 1, "c": 1})) == [
        ('$["a"]', "type"), ('$["b"]', "type"), ('$["c"]', "type")]
    assert kinds(tensorcanon.diff({"x": "a"}, {"x": "b"})) == [('$["x"]', "value")]


def test_bit_exact_by_default_for_signed_zero_and_nan_payloads():
    nan1 = struct.unpack("<f", struct.pack("<I", 0x7FC00000))[0]
    a = torch.tensor([0.0, nan1])
    b = torch.tensor([-0.0, nan1])
    (d,) = tensorcanon.diff(a, b)
    assert d.stats.count == 1 and d.stats.max_abs == 0.0
    assert d.stats.first_a == 0.0 and d.stats.first_b == -0.0
    # NaN equal to the same NaN, different from another payload
    other = torch.tensor([nan1]).view(torch.int32).add(1).view(torch.float32)
    assert not tensorcanon.diff(torch.tensor([nan1]), torch.tensor([nan1]))
    (d,) = tensorcanon.diff(torch.tensor([nan1]), other)
    assert d.stats.first_a == "nan (0x7fc00000)" and d.stats.first_b == "nan (0x7fc00001)"
    # with a tolerance, values are compared as numbers
    assert not tensorcanon.diff(a, b, atol=1e-9)
    assert not tensorcanon.diff(torch.tensor([nan1]), other, atol=1e-9)
    # python floats follow the same rule
    assert kinds(tensorcanon.diff(0.0, -0.0)) == [("$", "value")]
    assert not tensorcanon.diff(0.0, -0.0, atol=1e-12)


def test_tolerances():
    a, b = torch.tensor([1.0, 2.0, 100.0]), torch.tensor([1.0, 2.01, 101.0])
    assert len(tensorcanon.diff(a, b, atol=0.005)) == 1
    (d,) = tensorcanon.diff(a, b, atol=0.02)
    assert d.stats.count == 1 and d.stats.first_index == (2,)
    assert not tensorcanon.diff(a, b, rtol=0.01)
    assert not tensorcanon.diff({"lr": 0.1}, {"lr": 0.1000001}, rtol=1e-5)
    with pytest.raises(ValueError):
        tensorcanon.diff(a, b, atol=-1)


def test_one_nan_against_a_number_is_an_infinite_difference():
    (d,) = tensorcanon.diff(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 2.0]))
    assert d.stats.max_abs == math.inf and d.stats.first_index == (1,)


# Every dtype with values torch can convert to float64/complex128 gets max_abs/max_rel; the
# sub-byte and float4 dtypes (no arithmetic in torch) are compared by their bits.
_ARITHMETIC = ["bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64", "float16",
               "bfloat16", "float32", "float64", "complex32", "complex64", "complex128", "float8_e5m2",
               "float8_e4m3fn", "float8_e5m2fnuz", "float8_e4m3fnuz", "float8_e8m0fnu"]
_BITS_ONLY = ["float4_e2m1fn_x2", *(f"uint{n}" for n in range(1, 8)), *(f"int{n}" for n in range(1, 8))]


def test_dtype_lists_cover_the_dtype_table():
    from tensorcanon.format import dtypes

    assert sorted(_ARITHMETIC + _BITS_ONLY) == sorted(dtypes.BY_NAME)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("name", have_dtypes(_ARITHMETIC + _BITS_ONLY))
def test_every_dtype_compares(name):
    dtype = torch_dtype(name)
    raw = torch.arange(8 * dtype.itemsize, dtype=torch.uint8) % (2 if dtype is torch.bool else 7)
    raw_b = raw.clone()  # (built as bytes: torch has no copy kernel for some of these dtypes)
    raw_b[-1] ^= 1
    a, b = raw.view(dtype), raw_b.view(dtype)
    (d,) = tensorcanon.diff(a, b)
    assert d.kind == "values" and d.stats.count == 1 and d.stats.first_index == (a.numel() - 1,)
    assert (d.stats.max_abs is not None) == (name in _ARITHMETIC)
    # the same through files, as `tensorcanon diff` compares them
    (f,) = tensorcanon.diff(tensorcanon.loads(tensorcanon.dumps(a)), tensorcanon.loads(tensorcanon.dumps(b)))
    assert f.stats == d.stats


def test_int_differences_are_exact_and_large_values_do_not_overflow():
    big = torch.tensor([2**62, -(2**62)], dtype=torch.int64)
    (d,) = tensorcanon.diff(big, -big)
    assert d.stats.first_a == 2**62 and d.stats.first_b == -(2**62)
    assert d.stats.max_abs == float(2**63)


@pytest.mark.parametrize("name", have_dtypes(["float4_e2m1fn_x2", "uint4"]))
def test_dtypes_without_arithmetic_compare_bits(name):
    dtype = torch_dtype(name)
    a = torch.zeros(4, dtype=torch.uint8).view(dtype)
    b = torch.tensor([0, 0, 3, 0], dtype=torch.uint8).view(dtype)
    (d,) = tensorcanon.diff(a, b)
    assert d.stats.count == 1 and d.stats.max_abs is None
    assert (d.stats.first_a, d.stats.first_b) == ("0x00", "0x03")


def test_zero_dim_and_empty_tensors():
    (d,) = tensorcanon.diff(torch.tensor(1.0), torch.tensor(2.0))
    assert d.stats.first_index == () and d.stats.numel == 1
    assert not tensorcanon.diff(torch.zeros(0, 3), torch.zeros(0, 3))


def test_large_tensors_are_compared_in_chunks(monkeypatch):
    diff_module = sys.modules["tensorcanon.tools.diff"]  # tensorcanon.diff is the function

    monkeypatch.setattr(diff_module, "_CHUNK_ELEMENTS", 7)
    a = torch.arange(100.0)
    b = a.clone()
    b[50] = -1
    b[93] = 500
    (d,) = tensorcanon.diff(a, b)
    assert (d.stats.count, d.stats.first_index, d.stats.max_abs) == (2, (50,), 407.0)


def test_views_and_lazy_conjugates_compare_by_value():
    base = torch.arange(12.0).reshape(3, 4)
    assert not tensorcanon.diff(base.t(), base.t().contiguous())
    z = torch.tensor([1 + 2j, 3 - 1j])
    assert not tensorcanon.diff(z.conj(), z.conj().resolve_conj())


def test_tensor_kinds_devices_grad_and_numpy():
    t = torch.ones(2)
    r = tensorcanon.diff({"p": torch.nn.Parameter(t.clone()), "g": t},
                         {"p": t.clone(), "g": t.clone().requires_grad_()})
    assert kinds(r) == [('$["g"]', "requires_grad"), ('$["p"]', "type"), ('$["p"]', "requires_grad")]
    r = tensorcanon.diff(np.arange(3.0), torch.arange(3.0, dtype=torch.float64))
    assert kinds(r) == [("$", "type")]
    (d,) = tensorcanon.diff(np.arange(3.0), np.array([0.0, 1.0, 5.0]))
    assert d.stats.first_index == (2,) and d.stats.first_b == 5.0
    assert not tensorcanon.diff(np.arange(3, dtype=">i4"), np.arange(3, dtype="<i4"))


def test_shared_tensors_are_part_of_the_comparison():
    t = torch.ones(3)
    (d,) = tensorcanon.diff({"a": t, "b": t}, {"a": t, "b": t.clone()})
    assert d.kind == "alias" and str(d) == '$["b"]: same tensor as $["a"] in A, a separate tensor in B'


def test_ordered_dicts_compare_order_and_metadata():
    a = collections.OrderedDict([("x", 1), ("y", 2)])
    b = collections.OrderedDict([("y", 2), ("x", 1)])
    assert kinds(tensorcanon.diff(a, b)) == [("$", "order")]
    assert not tensorcanon.diff({"x": 1, "y": 2}, {"y": 2, "x": 1})  # plain dicts: order is not content
    c = collections.OrderedDict(a)
    c._metadata = {"": {"version": 1}}
    assert kinds(tensorcanon.diff(a, c)) == [("$", "metadata")]
    assert kinds(tensorcanon.diff(dict(a), a)) == [("$", "type")]  # then compared key by key


def test_sets_report_members_on_each_side():
    (d,) = tensorcanon.diff({1, 2, 3}, {2, 3, 4})
    assert (d.a, d.b) == ("{1} only in A", "{4} only in B")


@dataclasses.dataclass
class Cfg:
    lr: float
    w: torch.Tensor


def test_registered_types_compare_field_by_field():
    tensorcanon.register(Cfg)
    try:
        (d,) = tensorcanon.diff(Cfg(0.1, torch.zeros(2)), Cfg(0.1, torch.tensor([0.0, 1.0])))
        assert d.kind == "values" and d.stats.first_index == (1,)
    finally:
        tensorcanon.unregister(Cfg)


def test_files_of_every_format_and_device_agnostic_loading(tmp_path):
    obj = {"w": torch.arange(6.0).reshape(2, 3)}
    tensorcanon.save(obj, tmp_path / "a.safetensors")
    torch.save(obj, tmp_path / "a.pt")
    np.savez(tmp_path / "a.npz", w=obj["w"].numpy())
    assert not tensorcanon.diff(tmp_path / "a.safetensors", str(tmp_path / "a.pt"))
    r = tensorcanon.diff(tmp_path / "a.pt", tmp_path / "a.npz")
    assert kinds(r) == [('$["w"]', "type")] and r.a.endswith("a.pt")
    assert str(r).splitlines()[0] == f"A: {tmp_path / 'a.pt'}"


def test_pickle_is_never_used_for_pt_files(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    torch.save({"x": Evil()}, tmp_path / "evil.pt", _use_new_zipfile_serialization=True)
    with pytest.raises(tensorcanon.FormatError, match=r"torch.load\(weights_only=True\) cannot read it"):
        tensorcanon.diff(tmp_path / "evil.pt", {})


def test_to_dict_is_json_ready():
    import json

    r = tensorcanon.diff({"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([1.0, float("inf")]), "x": 1})
    data = json.loads(json.dumps(r.to_dict(), allow_nan=False))
    assert data["differences"][0]["stats"]["max_abs"] == "inf"
    assert data["differences"][1] == {"path": '$["x"]', "kind": "added", "a": None, "b": "int 1"}


def test_difference_text_for_every_kind():
    assert str(Difference("$", "dtype", "float32", "int8")) == "$: dtype float32 -> int8"
    assert str(Difference("$[0]", "removed", "int 1", None)) == "$[0]: only in A: int 1"
    assert tensor_stats(torch.ones(2), torch.ones(2)) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_compare_by_value_and_report_the_device(tmp_path):
    a = torch.arange(6.0, device="cuda").reshape(2, 3)
    b = a.clone()
    b[1, 1] = 9
    (d,) = tensorcanon.diff({"w": a}, {"w": b})
    assert d.stats.first_index == (1, 1) and d.stats.first_b == 9.0
    # the device is placement, not content (the digest does not cover it): a note, not a difference
    r = tensorcanon.diff({"w": a}, {"w": a.cpu()})
    assert r.identical and kinds(r.notes) == [('$["w"]', "device")]
    tensorcanon.save({"w": a}, tmp_path / "g.safetensors")
    tensorcanon.save({"w": a.cpu()}, tmp_path / "c.safetensors")
    r = tensorcanon.diff(tmp_path / "g.safetensors", tmp_path / "c.safetensors")
    assert r.identical and r.same_digest and [str(x) for x in r.notes] == ['$["w"]: device cuda:0 -> cpu']


# ---------------------------------------------------------------- what mutation testing found untested
# (shared/MUTATION.md, "tools/diff.py (equality)": each test below kills mutants that survived)


def test_under_a_tolerance_a_number_against_nan_still_differs():
    nan = float("nan")
    assert kinds(tensorcanon.diff(1.0, nan, atol=10)) == [("$", "value")]
    assert kinds(tensorcanon.diff({"x": nan}, {"x": 1.0}, rtol=1.0)) == [('$["x"]', "value")]
    (d,) = tensorcanon.diff(torch.tensor([1.0, nan]), torch.tensor([1.0, 1.0]), atol=10)
    assert d.stats.count == 1 and d.stats.first_index == (1,)


def test_nans_of_other_bits_differ_bit_exactly_and_match_under_a_tolerance():
    nan1 = struct.unpack("<d", struct.pack("<Q", 0x7FF8000000000000))[0]
    nan2 = struct.unpack("<d", struct.pack("<Q", 0x7FF8000000000001))[0]
    assert kinds(tensorcanon.diff(nan1, nan2)) == [("$", "value")]
    r = tensorcanon.diff(nan1, nan2, atol=1e-9)
    assert not r and r.tolerated == 1 and not r.identical
    assert tensorcanon.diff(nan1, nan1).identical


def test_the_tolerance_boundary_matches():
    # |a - b| == atol + rtol * |b| exactly (all these are exact binary fractions)
    for a, b, atol, rtol in ((1.0, 1.5, 0.5, 0.0), (1.0, 2.0, 0.5, 0.25), (3, 4, 1, 0)):
        r = tensorcanon.diff(a, b, atol=atol, rtol=rtol)
        assert not r and r.tolerated == 1, (a, b)
        assert tensorcanon.diff(a, b, atol=atol * 0.99, rtol=rtol * 0.99), (a, b)  # just inside: differs
    r = tensorcanon.diff(torch.tensor([1.0]), torch.tensor([1.5]), atol=0.5)
    assert not r and r.tolerated == 1
    assert tensorcanon.diff(torch.tensor([1.0]), torch.tensor([1.5]), atol=0.499)


def test_complex_and_numpy_scalars_under_a_tolerance():
    assert kinds(tensorcanon.diff(1 + 1j, 2 + 2j, rtol=1e-3)) == [("$", "value")]
    assert not tensorcanon.diff(1 + 1j, 1 + 1.0000001j, rtol=1e-3)
    r = tensorcanon.diff(np.float32(1.0), np.float32(1.0000001), rtol=1e-5)
    assert not r and r.tolerated == 1
    assert tensorcanon.diff(np.float32(1.0), np.float32(1.0000001))  # bit-exact: they differ


def test_a_negative_rtol_is_a_usage_error():
    for atol, rtol in ((0, -0.5), (-1, 0), (math.nan, 0), (0, math.inf)):
        with pytest.raises(tensorcanon.UsageError, match="atol and rtol"):
            tensorcanon.diff(1.0, 1.0, atol=atol, rtol=rtol)


def test_negative_zero_is_one_element_that_differs_by_nothing():
    (d,) = tensorcanon.diff(torch.tensor([0.0, 1.0]), torch.tensor([-0.0, 1.0]))
    assert (d.stats.count, d.stats.max_abs, d.stats.max_rel) == (1, 0.0, 0.0)  # (not inf: 0 / 0 is no difference)
    assert d.stats.first_a == 0.0 and math.copysign(1, d.stats.first_b) == -1


class _EqualOthers:
    def __init__(self, tag):
        self.tag = tag

    def __eq__(self, other):
        return isinstance(other, _EqualOthers)

    __hash__ = None

    def __repr__(self):
        return f"E({self.tag})"


class _RaisingEq:
    def __init__(self, tag):
        self.tag = tag

    def __eq__(self, other):
        raise RuntimeError("no comparing")

    __hash__ = None

    def __repr__(self):
        return f"R({self.tag})"


def test_user_objects_compare_by_eq_and_by_repr_when_eq_raises():
    assert tensorcanon.diff(_EqualOthers(1), _EqualOthers(2)).identical  # == True, reprs differ
    assert tensorcanon.diff(_RaisingEq(1), _RaisingEq(1)).identical  # == raises: repr decides
    (d,) = tensorcanon.diff(_RaisingEq(1), _RaisingEq(2))
    assert (d.kind, d.a, d.b) == ("value", "R(1)", "R(2)")


@dataclasses.dataclass
class Box:
    inner: object


def test_nesting_deeper_than_max_depth_is_a_limit_error():
    limits = tensorcanon.Limits(max_depth=5)
    deep: object = 1
    for _ in range(10):
        deep = [deep, 0]
    with pytest.raises(tensorcanon.LimitError, match="max_depth=5"):
        tensorcanon.diff(deep, copy.deepcopy(deep), limits=limits)
    tensorcanon.register(Box)
    try:  # through registered objects
        boxed: object = 1
        for _ in range(10):
            boxed = Box(boxed)
        with pytest.raises(tensorcanon.LimitError):
            tensorcanon.diff(boxed, boxed, limits=limits)
    finally:
        tensorcanon.unregister(Box)
    a, b = torch.ones(1), torch.ones(1)  # through a tensor's attributes
    a.note, b.note = deep, copy.deepcopy(deep)
    with pytest.raises(tensorcanon.LimitError):
        tensorcanon.diff(a, b, limits=limits)


def test_a_numpy_array_of_a_dtype_tensorcanon_does_not_save_is_refused():
    day = np.array(["2020-01-01"], dtype="datetime64[D]")
    with pytest.raises(tensorcanon.UnsupportedTypeError, match="datetime64"):
        tensorcanon.diff({"d": day}, {"d": day.copy()})


@dataclasses.dataclass
class Holder:
    tensors: list


def test_tensors_only_corner_cases():
    tensorcanon.register(Holder)
    try:
        r = tensorcanon.diff(Holder([torch.ones(1)]), Holder([]), tensors_only=True)
        assert kinds(r) == [('$["tensors"]', "length")]
    finally:
        tensorcanon.unregister(Holder)
    t = torch.ones(2)
    t.note = "x"
    assert kinds(tensorcanon.diff({"a": np.ones(2, dtype=np.float32)}, {"a": t})) == [('$["a"]', "type")]
