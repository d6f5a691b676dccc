"""Sparse, nested and meta tensors, attributes set on tensors, tensor subclasses (docs/FORMAT.md
§6.12), and the advice of every tensor refusal, applied as written.

Hostile files are crafted from valid ones: the parts of a tensor are saved as a dict (or list) at
the tensor's path, then that node is rewritten into a ``sparse``/``nested`` node, so the table, the
names and every digest stay valid and only the rule under test is broken.
"""

from __future__ import annotations

import collections
import io
import pathlib
import warnings

import pytest
import torch

import tensorcanon as tc
from tensorcanon import FormatError, UnsupportedTypeError

import hostile_lib as h
from compare import assert_same, tensor_content

warnings.filterwarnings("ignore", message=".*(Sparse|sparse|nested|prototype|quantiz).*")


def round_trip(value, **load):
    data = tc.dumps(value)
    back = tc.loads(data, **load)
    assert tc.dumps(back) == data, "saving what was loaded gives other bytes"
    assert tc.verify(data) == tc.fingerprint(value)
    return back


def coo():
    # uncoalesced: (0, 1) twice
    return torch.sparse_coo_tensor(torch.tensor([[0, 0, 1], [1, 1, 0]]), torch.tensor([1.0, 2.0, 3.0]), (2, 3))


# ------------------------------------------------------------------ attributes (§6.12.4)


def test_attributes_set_on_a_tensor_or_parameter_come_back():
    t = torch.arange(4.0)
    t.foo, t.bar = {"a": [1, 2]}, torch.ones(2)
    p = torch.nn.Parameter(torch.ones(3))
    p.sharded = True
    back = round_trip({"t": t, "again": t, "p": p})
    assert back["t"].__dict__.keys() == {"foo", "bar"} and back["t"].foo == {"a": [1, 2]}
    assert torch.equal(back["t"].bar, t.bar) and back["again"] is back["t"]
    assert type(back["p"]) is torch.nn.Parameter and back["p"].sharded is True
    assert_same({"t": t, "again": t, "p": p}, back, aliases={})


def test_a_tensor_with_attributes_is_not_merged_with_another_view_of_its_memory():
    base = torch.arange(4.0)
    view = base.view(4)
    view.note = "x"
    back = round_trip([base, view])
    assert back[0] is not back[1] and not back[0].__dict__ and back[1].note == "x"


def test_an_attribute_the_format_cannot_hold_is_refused_naming_it():
    t = torch.ones(1)
    t.callback = print
    with pytest.raises(UnsupportedTypeError) as info:
        tc.dumps({"w": t})
    assert info.value.path == '$["w"]["callback"]' and "builtins.print" in str(info.value)


def test_a_later_use_carrying_attributes_is_rejected():
    t = torch.ones(1)
    t.a = 1
    data = tc.dumps([t, t])

    def edit(m):
        m["root"][2] = ["tensor.attrs", ["tensor", 0], ["dict", "a", 1]]
    with pytest.raises(FormatError, match=r"first use .* at \$\[1\]"):
        tc.loads(h.with_manifest(data, edit))


# ------------------------------------------------------------------ sparse (§6.12.1)


def test_coo_is_saved_as_it_holds_its_indices_coalesced_or_not():
    s = coo()
    assert not s.is_coalesced()
    back = round_trip(s)  # uncoalesced: its indices and values in its order, (0, 1) twice (issue 37)
    assert not back.is_coalesced() and back.layout is torch.sparse_coo
    assert torch.equal(back._indices(), s._indices()) and torch.equal(back._values(), s._values())
    c = s.coalesce()
    assert tc.dumps(c) != tc.dumps(s)  # two values torch tells apart (is_coalesced(), _indices())
    back = round_trip(c)
    assert back.is_coalesced() and torch.equal(back._indices(), c._indices())
    assert torch.equal(back.to_dense(), s.to_dense())


def test_zero_dimensional_sparse_tensors_round_trip():
    s = torch.tensor(1.5).to_sparse()  # no sparse dimension, one value
    assert s.sparse_dim() == 0
    back = round_trip(s)
    assert back.layout is torch.sparse_coo and back.shape == () and torch.equal(back.to_dense(), torch.tensor(1.5))
    two = torch.sparse_coo_tensor(torch.zeros(0, 2, dtype=torch.int64), torch.tensor([1.0, 2.0]), ())
    assert torch.equal(round_trip(two).to_dense(), torch.tensor(3.0))  # coalesced: summed


@pytest.mark.parametrize("layout", ["csr", "csc", "bsr", "bsc"])
def test_compressed_layouts_round_trip(layout):
    dense = torch.arange(16.0).reshape(4, 4) * (torch.arange(16).reshape(4, 4) % 3 == 0)
    s = getattr(dense, f"to_sparse_{layout}")(*([(2, 2)] if layout.startswith("b") else []))
    back = round_trip({"s": s, "t": s})
    assert back["s"].layout is s.layout and back["s"] is back["t"]
    assert torch.equal(back["s"].to_dense(), dense)
    assert tensor_content(back["s"]) == tensor_content(s)


def test_hybrid_coo_requires_grad_and_parameters():
    s = torch.sparse_coo_tensor(torch.tensor([[1, 0]]), torch.ones(2, 3), (4, 3)).requires_grad_()
    p = torch.nn.Parameter(torch.eye(3).to_sparse())
    back = round_trip({"s": s, "p": p})
    assert back["s"].requires_grad and back["s"].dense_dim() == 1
    assert type(back["p"]) is torch.nn.Parameter and back["p"].layout is torch.sparse_coo
    assert_same({"s": s, "p": p}, back)


def _as_sparse(parts: dict, layout: str, size: list) -> bytes:
    """A file whose root is a ``layout`` sparse node over ``parts`` (saved as an OrderedDict at $, in the
    node's order: the same paths, names and table)."""
    names = {"coo": ("indices", "values"), "csr": ("crow_indices", "col_indices", "values")}[layout]
    assert sorted(parts) == sorted(names)
    data = tc.dumps(collections.OrderedDict((n, parts[n]) for n in names))  # (the parts' paths and order)

    def edit(m):
        m["root"] = ["sparse", layout, ["size", *size], "tensor", False, *(["tensor", i] for i in range(len(names)))]
    return h.with_manifest(data, edit)


class _Stream(io.RawIOBase):
    """A file that can only be read forward (a pipe): verify keeps the bytes it checks as they pass."""

    def __init__(self, data: bytes):
        self._f = io.BytesIO(data)

    def readable(self):
        return True

    def readinto(self, b):
        return self._f.readinto(b)


def _rejected(data: bytes, match: str):
    """Load rejects ``data`` naming the path, and so does verify, which builds nothing (a file that
    verifies loads, docs/FORMAT.md §6.12), from bytes and from a stream, with the same message."""
    with pytest.raises(FormatError, match=match) as info:
        tc.loads(data)
    assert "at $" in str(info.value)
    for source in (data, _Stream(data)):
        with pytest.raises(FormatError) as verified:
            tc.verify(source)
        assert str(verified.value) == str(info.value)
    return info.value


def test_coo_indices_out_of_range_are_rejected_before_building():
    good = _as_sparse({"indices": torch.tensor([[0, 1]]), "values": torch.ones(2)}, "coo", [2])
    assert torch.equal(tc.loads(good).to_dense(), torch.ones(2))
    _rejected(_as_sparse({"indices": torch.tensor([[0, 5]]), "values": torch.ones(2)}, "coo", [2]), "out of range")
    _rejected(_as_sparse({"indices": torch.tensor([[-1, 1]]), "values": torch.ones(2)}, "coo", [2]), "out of range")


def test_uncoalesced_coo_in_a_file_is_rejected():
    _rejected(_as_sparse({"indices": torch.tensor([[1, 0]]), "values": torch.ones(2)}, "coo", [2]), "coalesced")
    _rejected(_as_sparse({"indices": torch.tensor([[1, 1]]), "values": torch.ones(2)}, "coo", [2]), "coalesced")


def test_coo_shapes_that_do_not_fit_are_rejected():
    _rejected(_as_sparse({"indices": torch.tensor([[0, 1]], dtype=torch.int32), "values": torch.ones(2)}, "coo",
                         [2]), "int64")
    _rejected(_as_sparse({"indices": torch.tensor([[0, 1]]), "values": torch.ones(3)}, "coo", [2]), "do not fit")


def test_csr_with_decreasing_or_short_compressed_indices_is_rejected():
    parts = {"crow_indices": torch.tensor([0, 2, 1]), "col_indices": torch.tensor([0, 1]), "values": torch.ones(2)}
    _rejected(_as_sparse(parts, "csr", [2, 2]), "end at the number of specified elements")
    parts["crow_indices"] = torch.tensor([0, 1, 2])
    assert tc.loads(_as_sparse(parts, "csr", [2, 2])).layout is torch.sparse_csr
    parts["col_indices"] = torch.tensor([0, 7])
    _rejected(_as_sparse(parts, "csr", [2, 2]), "out of range")
    parts["crow_indices"], parts["col_indices"] = torch.tensor([0, 2, 2]), torch.tensor([1, 1])
    _rejected(_as_sparse(parts, "csr", [2, 2]), "strictly increase within each compressed row")
    parts["crow_indices"], parts["col_indices"] = torch.tensor([1, 2, 2]), torch.tensor([0, 1])
    _rejected(_as_sparse(parts, "csr", [2, 2]), "must start at 0 and end")
    parts["crow_indices"] = torch.tensor([0, 3, 2])
    _rejected(_as_sparse(parts, "csr", [2, 2]), "nor grow by more than 2")
    parts["crow_indices"] = torch.tensor([0, 2, 1, 2])
    _rejected(_as_sparse(parts, "csr", [3, 2]), "must not decrease")
    parts["crow_indices"] = torch.tensor([0, 2])
    _rejected(_as_sparse(parts, "csr", [2, 2]), "not one more than")
    parts["col_indices"] = torch.tensor([0, 1], dtype=torch.int32)
    _rejected(_as_sparse(parts, "csr", [2, 2]), "int32 or both int64")


def test_a_sparse_node_structure_is_checked_without_building():
    bad = _as_sparse({"indices": torch.tensor([[0, 1]]), "values": torch.ones(2)}, "coo", [2])

    def edit(m):
        m["root"][1] = "dia"
    with pytest.raises(FormatError, match="layout"):
        tc.verify(h.with_manifest(bad, edit))


# ------------------------------------------------------------------ meta (§6.12.3)


def test_meta_tensors_have_no_bytes_and_come_back_on_meta():
    m = torch.empty(3, 4, dtype=torch.bfloat16, device="meta", requires_grad=True)
    p = torch.nn.Parameter(torch.empty(5, device="meta"))
    data = tc.dumps({"m": m, "p": p})
    assert h.header_names(data) == []
    back = round_trip({"m": m, "p": p}, map_location="cpu")
    assert back["m"].is_meta and back["m"].shape == (3, 4) and back["m"].dtype is torch.bfloat16
    assert back["m"].requires_grad and type(back["p"]) is torch.nn.Parameter and back["p"].is_meta


def test_a_meta_or_sparse_size_no_tensor_can_have_is_rejected():
    meta = tc.dumps(torch.empty(2, dtype=torch.float32, device="meta"))
    bad = h.with_manifest(meta, lambda m: m["root"].__setitem__(2, ["size", 2**62, 2]))
    for load in (tc.loads, tc.verify):
        with pytest.raises(FormatError, match="2\\^63"):
            load(bad)
    _rejected(_as_sparse({"indices": torch.tensor([[0, 1]]), "values": torch.ones(2)}, "coo", [2**62, 2**62]),
              "2\\^63")


def test_meta_with_grad_on_an_int_dtype_is_rejected():
    data = tc.dumps(torch.empty(2, dtype=torch.int64, device="meta"))

    def edit(m):
        m["root"][4] = True
    _rejected(h.with_manifest(data, edit), "requires_grad")


# ------------------------------------------------------------------ nested (§6.12.2)


def test_strided_and_jagged_nested_tensors_round_trip():
    parts = [torch.arange(6.0).reshape(2, 3), torch.zeros(4, 3)]
    strided = torch.nested.nested_tensor(parts)
    jagged = torch.nested.nested_tensor(parts, layout=torch.jagged)
    back = round_trip({"s": strided, "j": jagged, "j2": jagged})
    assert back["s"].is_nested and back["j"].layout is torch.jagged and back["j"] is back["j2"]
    for got in (back["s"], back["j"]):
        assert [tuple(x.shape) for x in got.unbind()] == [(2, 3), (4, 3)]
        assert all(torch.equal(a, b) for a, b in zip(got.unbind(), parts, strict=True))


def test_jagged_view_of_part_of_its_values_saves_only_that_part():
    values = torch.arange(12.0).reshape(6, 2)
    full = torch.nested.nested_tensor_from_jagged(values, torch.tensor([0, 2, 6]))
    tail = torch.nested.nested_tensor_from_jagged(values[2:], torch.tensor([0, 1, 4]))
    rebuilt = torch.nested.nested_tensor(list(tail.unbind()), layout=torch.jagged)
    rebuilt._metadata_cache.clear()  # (tail caches no length; nested_tensor caches both)
    assert tc.dumps(tail) == tc.dumps(rebuilt)
    assert tc.dumps(full) != tc.dumps(tail)


def _as_jagged(values, offsets) -> bytes:
    data = tc.dumps(collections.OrderedDict(values=values, offsets=offsets))

    def edit(m):
        m["root"] = ["nested", "jagged", "float32", False, ["tensor", 0], ["tensor", 1]]
    return h.with_manifest(data, edit)


def test_jagged_offsets_that_decrease_or_miss_the_end_are_rejected():
    assert tc.loads(_as_jagged(torch.ones(5, 2), torch.tensor([0, 2, 5]))).layout is torch.jagged
    _rejected(_as_jagged(torch.ones(5, 2), torch.tensor([0, 3, 2, 5])), "decrease")
    _rejected(_as_jagged(torch.ones(5, 2), torch.tensor([0, 2, 4])), "end at")
    _rejected(_as_jagged(torch.ones(5, 2), torch.tensor([1, 2, 5])), "start at 0")
    _rejected(_as_jagged(torch.ones(5, 2), torch.tensor([0, 5], dtype=torch.int32)), "int64")


def test_strided_nested_parts_of_another_dtype_are_rejected():
    data = tc.dumps([torch.ones(2), torch.ones(3, dtype=torch.float64)])

    def edit(m):
        m["root"] = ["nested", "strided", "float32", False, ["tensor", 0], ["tensor", 1]]
    _rejected(h.with_manifest(data, edit), "another dtype")


# ------------------------------------------------------------------ lazy and streamed reading


def test_open_lists_the_parts_and_every_read_path_accepts_the_kinds(tmp_path):
    s = coo()
    s.note = "n"
    value = {"s": s, "m": torch.empty(2, device="meta"),
             "j": torch.nested.nested_tensor([torch.ones(1, 2), torch.ones(3, 2)], layout=torch.jagged)}
    data = tc.dumps(value)
    assert h.check(data) == "ok"  # loads, a stream, mmap, open, verify; re-saving gives the same bytes
    path = tmp_path / "k.safetensors"
    path.write_bytes(data)
    with tc.open(path) as f:
        assert sorted(f.keys()) == sorted(['$["s"]["indices"]', '$["s"]["values"]', '$["j"]["values"]',
                                           '$["j"]["offsets"]'])
        assert torch.equal(f['$["s"]["values"]'], s._values())  # (uncoalesced: as it holds them)
        with pytest.raises(KeyError, match=r"stored as its parts.*tensorcanon.load"):
            f['$["s"]']
    assert_same(value["s"], tc.load(path, mmap=True)["s"])


# ------------------------------------------------------------------ subclasses (§6.12.5)


class Scaled(torch.Tensor):
    """A small wrapper subclass: int8 data and a scale, flattened with a context."""

    @staticmethod
    def __new__(cls, data, scale, tag):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=torch.float32, device=data.device)

    def __init__(self, data, scale, tag):
        self.data_, self.scale, self.tag = data, scale, tag

    def __tensor_flatten__(self):
        return ["data_", "scale"], {"tag": self.tag}

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return Scaled(inner["data_"], inner["scale"], ctx["tag"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(func)


@pytest.fixture
def registered():
    tc.register(Scaled)
    yield
    tc.unregister(Scaled)


def test_a_flatten_subclass_is_refused_until_registered_then_round_trips():
    x = Scaled(torch.tensor([1, -2], dtype=torch.int8), torch.tensor(0.5), "w8")
    with pytest.raises(UnsupportedTypeError, match=r"tensorcanon.register\(Scaled\)") as info:
        tc.dumps({"w": x})
    assert info.value.path == '$["w"]'
    tc.register(Scaled)  # exactly the advice
    try:
        data = tc.dumps({"w": x})
        back = tc.loads(data)
        assert type(back["w"]) is Scaled and back["w"].tag == "w8" and back["w"].shape == (2,)
        assert torch.equal(back["w"].data_, x.data_) and torch.equal(back["w"].scale, x.scale)
        assert tc.dumps(back) == data
    finally:
        tc.unregister(Scaled)
    with pytest.raises(UnsupportedTypeError, match="register"):
        tc.loads(data)  # a reader that did not register it imports nothing


def test_a_flatten_context_the_format_cannot_hold_is_refused_naming_it(registered):
    x = Scaled(torch.ones(1, dtype=torch.int8), torch.tensor(1.0), print)
    with pytest.raises(UnsupportedTypeError) as info:
        tc.dumps({"w": x})
    assert info.value.path == '$["w"]["ctx"]["tag"]'


def test_torchs_own_two_tensor_round_trips_once_registered():
    from torch.testing._internal.two_tensor import TwoTensor

    x = TwoTensor(torch.ones(2), torch.arange(2.0))
    with pytest.raises(UnsupportedTypeError, match=r"register\(TwoTensor\)"):
        tc.dumps(x)
    tc.register(TwoTensor)
    try:
        back = round_trip({"x": x})["x"]
        assert type(back) is TwoTensor and torch.equal(back.a, x.a) and torch.equal(back.b, x.b)
    finally:
        tc.unregister(TwoTensor)


# ------------------------------------------------------------------ every refusal's advice works


class Plain(torch.Tensor):
    pass


def _uninitialized():
    lazy = torch.nn.LazyLinear(2)
    return lazy, {"sd": lazy.state_dict()}


def _quantized(per_channel: bool):
    x = torch.tensor([[0.5, -1.0, 2.0], [0.25, 0.0, -0.75]])
    if per_channel:
        return torch.quantize_per_channel(x, torch.tensor([0.25, 0.05], dtype=torch.float64),
                                          torch.tensor([0, 3]), 0, torch.qint8)
    return torch.quantize_per_tensor(x, 0.25, 3, torch.quint8)


def _requantize(saved, q):
    """What the advice says to save, saved and loaded, and quantized again."""
    back = round_trip(saved)
    if q.qscheme() == torch.per_tensor_affine:
        again = torch.quantize_per_tensor(back["x"], back["scale"], back["zero_point"], back["dtype"])
    else:
        again = torch.quantize_per_channel(back["x"], back["scales"], back["zero_points"], back["axis"],
                                           back["dtype"])
    assert torch.equal(again.int_repr(), q.int_repr()) and again.qscheme() == q.qscheme()


def _same_bytes(t, back):
    same = {1: torch.uint8, 2: torch.int16}[t.dtype.itemsize]
    assert back.dtype == t.dtype and torch.equal(back.view(same), t.view(same))


def _same_elements(nested, back):
    assert [tuple(x.shape) for x in nested.unbind()] == [tuple(x.shape) for x in back]
    assert all(torch.equal(a, b) for a, b in zip(nested.unbind(), back, strict=True))


ADVICE = [
    # (value, words the message holds, how the fix is applied as the message words it)
    ("plain subclass", lambda: torch.arange(3.0).as_subclass(Plain), ["t.as_subclass(torch.Tensor)"],
     lambda t: round_trip(t.as_subclass(torch.Tensor))),
    ("jagged with lengths", lambda: torch.nested.narrow(torch.arange(8.0).reshape(2, 4), 1, torch.tensor([0, 1]),
                                                        torch.tensor([2, 3]), layout=torch.jagged),
     ["torch.nested.nested_tensor(list(t.unbind()), layout=torch.jagged)"],
     lambda t: _same_elements(t, round_trip(torch.nested.nested_tensor(list(t.unbind()), layout=torch.jagged)))),
    ("jagged transposed", lambda: torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(4, 3)],
                                                             layout=torch.jagged).transpose(1, 2),
     ["list(t.unbind())"], lambda t: _same_elements(t, round_trip(list(t.unbind())))),
    ("sparse meta", lambda: torch.empty(2, 3, layout=torch.sparse_coo, device="meta"),
     ["torch.empty(t.shape, dtype=t.dtype, device='meta')"],
     lambda t: round_trip(torch.empty(t.shape, dtype=t.dtype, device="meta"))),
    ("bits8 tensor", lambda: torch.arange(3, dtype=torch.uint8).view(torch.bits8), ["t.view(torch.uint8)"],
     lambda t: _same_bytes(t, round_trip(t.view(torch.uint8)).view(torch.bits8))),
    ("bits16 tensor", lambda: torch.arange(3, dtype=torch.int16).view(torch.bits16), ["t.view(torch.int16)"],
     lambda t: _same_bytes(t, round_trip(t.view(torch.int16)).view(torch.bits16))),
    ("nested parameter", lambda: torch.nn.Parameter(torch.nested.nested_tensor([torch.ones(2)])),
     ["p.detach()"], lambda p: round_trip(p.detach())),
    ("quantized per tensor", lambda: _quantized(False), ["t.dequantize()", "torch.quantize_per_tensor"],
     lambda q: _requantize({"x": q.dequantize(), "scale": q.q_scale(), "zero_point": q.q_zero_point(),
                            "dtype": q.dtype}, q)),
    ("quantized per channel", lambda: _quantized(True), ["t.q_per_channel_axis()", "torch.quantize_per_channel"],
     lambda q: _requantize({"x": q.dequantize(), "scales": q.q_per_channel_scales(),
                            "zero_points": q.q_per_channel_zero_points(), "axis": q.q_per_channel_axis(),
                            "dtype": q.dtype}, q)),
]


@pytest.mark.parametrize("value, words, fix", [row[1:] for row in ADVICE], ids=[row[0] for row in ADVICE])
def test_each_refusal_says_a_fix_that_works(value, words, fix):
    t = value()
    with pytest.raises(UnsupportedTypeError) as info:
        tc.dumps({"t": t})
    assert info.value.path == '$["t"]'
    for w in words:
        assert w in str(info.value), (w, str(info.value))
    fix(t)


def test_a_dtensor_advises_full_tensor_which_works():
    from torch.distributed.device_mesh import init_device_mesh

    from helpers import Shard, distribute_tensor
    from threaded import run_ranks

    def rank(r):
        d = distribute_tensor(torch.arange(4.0), init_device_mesh("cpu", (2,)), [Shard(0)])
        with pytest.raises(UnsupportedTypeError, match=r"t\.full_tensor\(\)") as info:
            tc.dumps({"t": d})
        assert "as_subclass" not in str(info.value)
        return round_trip(d.full_tensor())

    for full in run_ranks(2, rank):
        assert torch.equal(full, torch.arange(4.0))


def test_attributes_on_a_dtensor_are_refused_by_dcp_not_dropped(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh

    import tensorcanon.dcp as tcd

    from helpers import Shard, distribute_tensor
    from threaded import run_ranks

    folder = str(tmp_path / "ckpt")

    def rank(r):
        d = distribute_tensor(torch.arange(4.0), init_device_mesh("cpu", (2,)), [Shard(0)])
        d.foo = 1
        with pytest.raises(UnsupportedTypeError, match="'foo'.*next to it"):
            tcd.save({"w": d}, folder)
        del d.foo  # the advice: save the value next to it
        return tcd.save({"w": d, "foo": 1}, folder)

    run_ranks(2, rank)
    assert tcd.load_unsharded(folder)["foo"] == 1


def test_uninitialized_parameters_advise_a_forward_pass_which_works():
    lazy, sd = _uninitialized()
    with pytest.raises(UnsupportedTypeError, match="forward pass") as info:
        tc.dumps(sd)
    assert "initialize_parameters" in str(info.value) and info.value.path == '$["sd"]["weight"]'
    lazy(torch.ones(1, 3))  # the advice: one forward pass with a sample input
    back = round_trip(lazy.state_dict())
    assert back["weight"].shape == (2, 3)
    other = torch.nn.LazyLinear(2)
    other.initialize_parameters(torch.ones(1, 3))  # the other advice
    assert round_trip(other.state_dict())["weight"].shape == (2, 3)


# ------------------------------------------------------------------ tensorcanon.dcp


def test_dcp_saves_the_kinds_and_load_unsharded_gives_them_back(tmp_path):
    from torch.testing._internal.two_tensor import TwoTensor

    import tensorcanon.dcp as tcd

    t = torch.ones(2)
    t.foo = "bar"
    state = {"s": coo(), "m": torch.empty(3, device="meta"), "t": t,
             "j": torch.nested.nested_tensor([torch.ones(1, 2), torch.ones(2, 2)], layout=torch.jagged)}
    digest = tcd.save(state, tmp_path / "a")
    assert digest == tc.fingerprint(state)  # the logical digest is the unsharded state's
    assert_same(state, tcd.load_unsharded(tmp_path / "a"))
    x = TwoTensor(torch.ones(1), torch.zeros(1))
    with pytest.raises(UnsupportedTypeError, match=r"tensorcanon.register\(TwoTensor\)"):
        tcd.save({"x": x}, tmp_path / "b")
    tc.register(TwoTensor)
    try:
        tcd.save({"x": x}, tmp_path / "c")
        assert type(tcd.load_unsharded(tmp_path / "c")["x"]) is TwoTensor
    finally:
        tc.unregister(TwoTensor)


def test_async_staging_copies_the_kinds_and_keeps_attributes():
    from tensorcanon.dcp.staging import staged_copy

    t = torch.ones(2)
    t.foo = [1]
    s = torch.eye(2).to_sparse()
    j = torch.nested.nested_tensor([torch.ones(1, 2)], layout=torch.jagged)
    j.note = 3
    out = staged_copy({"t": t, "t2": t, "s": s, "j": j, "m": torch.empty(2, device="meta")})
    assert out["t"].foo == [1] and out["t"] is out["t2"] and out["t"] is not t
    assert out["j"] is not j and out["j"].note == 3 and out["m"].is_meta
    s._values().add_(5)  # a change after staging does not reach the staged copy
    assert torch.equal(out["s"].to_dense(), torch.eye(2))


# ------------------------------------------------------------------ mutated trees


_SUBSTITUTES = [0, 1, -1, 2**62, 2**63 - 1, True, False, None, "coo", "csr", "bsc", "jagged", "strided", "tensor",
                "parameter", "float32", "int64", ["size"], ["size", 3, 3], ["tensor", 0], ["tensor", 5], ["dict"],
                ["list"], 0.5, b"x", ["dict", "a", 1], ["meta", "float32", ["size", 2], "tensor", False]]


def _lists(node, out):
    if isinstance(node, list):
        out.append(node)
        for child in node:
            _lists(child, out)
    return out


def test_mutated_trees_of_the_kinds_are_refused_cleanly_or_load_canonically():
    """150 random edits of the tensor_kinds vector's tree (its digest recomputed): every read
    raises tensorcanon's own error, or the file loads and saving what it gave makes the same file."""
    import copy
    import random

    import vectors

    data = tc.dumps(vectors.build("tensor_kinds")[0])
    root = h.manifest_of(data)[0]["root"]
    rng = random.Random(30)
    accepted = 0
    for _ in range(150):
        tree = copy.deepcopy(root)
        lists = _lists(tree, [])
        for _ in range(rng.randint(1, 3)):
            node = rng.choice(lists)
            if len(node) > 1:
                i = rng.randrange(1, len(node))
                if rng.random() < 0.7:
                    node[i] = copy.deepcopy(rng.choice(_SUBSTITUTES))
                else:
                    del node[i]
        mutated = h.with_manifest(data, lambda m, tree=tree: m.__setitem__("root", tree))
        try:
            back = tc.loads(mutated)
        except tc.TensorCanonError:  # (any other exception fails the test)
            continue
        accepted += 1
        assert tc.dumps(back) == mutated
        assert tc.verify(mutated)
    assert accepted  # some edits give valid files (a value swapped for another): the round trip ran


# ------------------------------------------------------------------ diff and inspect


def test_diff_compares_the_kinds_part_by_part_and_attributes_by_name():
    t = torch.ones(2)
    t.foo = 1
    a = {"s": coo(), "m": torch.empty(2, device="meta"), "t": t,
         "j": torch.nested.nested_tensor([torch.ones(1, 2), torch.ones(2, 2)], layout=torch.jagged)}
    assert tc.diff(a, tc.loads(tc.dumps(a))).identical
    u = torch.ones(2)
    u.foo = 2
    b = dict(a, s=coo() * 2, t=u, m=torch.empty(3, device="meta"))
    found = {(d.path, d.kind) for d in tc.diff(a, b)}
    assert found == {('$["s"]["values"]', "values"), ('$["t"]["foo"]', "value"), ('$["m"]', "shape")}
    assert {d.kind for d in tc.diff({"x": coo()}, {"x": coo().to_dense()})} == {"type"}


def test_inspect_lists_the_kinds_and_their_parts(tmp_path, capsys):
    import json

    from tensorcanon.tools import cli

    t = torch.ones(2)
    t.foo = 1
    path = tmp_path / "k.safetensors"
    tc.save({"s": coo(), "m": torch.empty(2, device="meta"), "t": t}, path)
    assert cli.main(["inspect", "--json", str(path)]) == 0
    rows = {r["path"]: r for r in json.loads(capsys.readouterr().out)["entries"]}
    assert rows['$["s"]']["type"] == "sparse_coo tensor (uncoalesced)"
    assert rows['$["s"]["values"]']["dtype"] == "float32"
    assert rows['$["m"]']["value"] == "float32[2], no data" and rows['$["t"]']["type"] == "tensor with attributes"
    assert rows['$["t"]["foo"]']["value"] == "1"


# ------------------------------------------------------------------ verify makes load's value checks


def _torch_accepts(layout, size, parts) -> bool:
    try:
        torch.sparse_compressed_tensor(*parts, size, layout=getattr(torch, f"sparse_{layout}"), check_invariants=True)
        return True
    except (RuntimeError, ValueError, TypeError):
        return False


@pytest.mark.parametrize("layout", ["csr", "csc", "bsr", "bsc"])
def test_the_compressed_index_rule_accepts_exactly_what_torch_accepts(layout):
    """The rule verify runs on the bytes (numpy) against torch's invariant check, which load runs
    after it: on every small index pair whose shapes fit, what the rule accepts torch accepts (a file
    that verifies loads), and what torch accepts the rule accepts too, but for a matrix without
    elements, where torch checks no index at all (it takes crow_indices [0, 1] and col_indices [0]
    for a 1x0 matrix) and the rule still wants indices that could describe it."""
    from tensorcanon.format import tensorkinds

    gen = torch.Generator().manual_seed(29)
    blocked = layout.startswith("b")
    cases = refused_empty = 0
    for _ in range(400):
        batch = int(torch.randint(0, 2, (), generator=gen))
        rows, cols = (int(x) for x in torch.randint(0, 4, (2,), generator=gen))
        block = (1, 2) if blocked else (1, 1)
        size = [*([2] * batch), rows * block[0], cols * block[1]]
        ncomp = (rows if layout in ("csr", "bsr") else cols) + 1
        nnz = int(torch.randint(0, 5, (), generator=gen))
        compressed = torch.randint(-1, 4, (*([2] * batch), ncomp), generator=gen)
        if bool(torch.rand((), generator=gen) < 0.7):  # mostly well formed, to reach the later rules
            compressed = torch.sort(compressed.clamp(0, nnz), dim=-1).values
            compressed[..., 0], compressed[..., -1] = 0, nnz
        plain = torch.randint(-1, 4, (*([2] * batch), nnz), generator=gen)
        if bool(torch.rand((), generator=gen) < 0.5):
            plain = torch.sort(plain.clamp(0), dim=-1).values
        values = torch.ones(*([2] * batch), nnz, *block) if blocked else torch.ones(*([2] * batch), nnz)
        parts = [compressed, plain, values]
        if tensorkinds.sparse_shape_problem(layout, size, [tensorkinds.part_of(p) for p in parts]) is not None:
            continue
        cases += 1
        ours, theirs = tensorkinds.sparse_problem(layout, size, parts) is None, _torch_accepts(layout, size, parts)
        assert ours == theirs or (theirs and 0 in size[-2:]), (layout, size, parts[:2])
        refused_empty += theirs and not ours
    assert cases > 100 and refused_empty  # (the exception is met, and is the only one)


def test_coo_rule_accepts_exactly_what_torch_accepts():
    from tensorcanon.format import tensorkinds

    gen = torch.Generator().manual_seed(29)
    for _ in range(300):
        size = [int(x) for x in torch.randint(0, 4, (2,), generator=gen)]
        indices = torch.randint(-1, 4, (2, int(torch.randint(0, 5, (), generator=gen))), generator=gen)
        values = torch.ones(indices.shape[1])
        ours = tensorkinds.sparse_problem("coo", size, [indices, values]) is None
        try:
            built = torch.sparse_coo_tensor(indices, values, size, check_invariants=True).coalesce()
            theirs = torch.equal(built.indices(), indices)  # in range, and already coalesced
        except RuntimeError:
            theirs = False
        assert ours == theirs, (size, indices)


def _padded_bad_coo() -> bytes:
    """A file with an out-of-range COO index and 20 MB of other tensors: verify hashes a regular
    file of that size on two threads (reader._verify_file) and must keep the index part's bytes."""
    data = tc.dumps([collections.OrderedDict(indices=torch.tensor([[0, 5]]), values=torch.ones(2)),
                     torch.zeros(5 << 20)])  # (the parts' paths, names and table order)

    def edit(m):
        m["root"][1] = ["sparse", "coo", ["size", 2], "tensor", False, ["tensor", 0], ["tensor", 1]]
    return h.with_manifest(data, edit)


def test_verify_checks_index_values_on_every_way_it_reads(tmp_path, monkeypatch):
    from tensorcanon.io import reader

    ways = []

    def spying(way):
        real = getattr(reader.CheckedFile, way)

        def spy(self, *args):
            ways.append(way)
            return real(self, *args)
        return spy
    for way in ("_verify_mapped", "_verify_file", "_verify_stream"):
        monkeypatch.setattr(reader.CheckedFile, way, spying(way))
    data = _padded_bad_coo()
    path = tmp_path / "bad.safetensors"
    path.write_bytes(data)
    with pytest.raises(FormatError, match="out of range") as loaded:
        tc.load(path)
    message = str(loaded.value)
    assert message.endswith("at $[0]")
    for source in (data, path, str(path), _Stream(data)):  # in memory, a regular file (two threads), a pipe
        with pytest.raises(FormatError) as verified:
            tc.verify(source)
        # the same reason, named after the file where there is one (issue 38: every message names its file)
        assert message.startswith(f"{path}: ") and str(verified.value).endswith(message.removeprefix(f"{path}: "))
    assert ways == ["_verify_mapped", "_verify_file", "_verify_file", "_verify_stream"]


def test_a_damaged_index_part_is_named_as_damaged_before_its_values_are_checked():
    data = bytearray(_as_sparse({"indices": torch.tensor([[0, 5]]), "values": torch.ones(2)}, "coo", [2]))
    at = bytes(data).rindex((5).to_bytes(8, "little"))
    data[at] = 1  # [[0, 1]] would be valid: the digest, not the rule, rejects it
    with pytest.raises(tc.IntegrityError, match=r"\$\[\"indices\"\]"):
        tc.verify(bytes(data))


def test_cli_verify_rejects_the_tensor_kind_files_of_the_corpus(capsys):
    from tensorcanon.tools import cli

    corpus = pathlib.Path(__file__).resolve().parent / "conformance" / "invalid"
    names = ["meta_int_requires_grad", "nested_jagged_offsets_decreasing", "sparse_coo_index_out_of_range",
             "sparse_coo_uncoalesced", "sparse_csr_crow_decreasing"]
    code = cli.main(["verify", *(str(corpus / f"{n}.bin") for n in names)])
    out = capsys.readouterr()
    assert code == 2
    lines = (out.out + out.err).splitlines()
    for n in names:
        assert any(f"{n}.bin" in line and "manifest:" in line and "at $" in line for line in lines), (n, lines)
