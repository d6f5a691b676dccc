"""Nothing changes on the way through (issue 37, item 6; docs/FORMAT.md §6.12): an uncoalesced COO
tensor comes back uncoalesced, its indices and values in its order; a jagged nested tensor keeps
the lengths it caches; a jagged tensor that requires grad saves after ``.values()``; a sparse or
nested node decodes to one object per node *and attributes*.

Every value is saved, loaded (from bytes, a file, a memory map), compared with what torch itself
says about it, and saved again to the same bytes. Hostile files are crafted from valid ones with
their manifest digest recomputed, so that only the rule under test is broken.
"""

from __future__ import annotations

import collections
import inspect
import io
import warnings

import pytest
import torch

import tensorcanon as tc
from tensorcanon import FormatError
from tensorcanon.format import tensorkinds

import hostile_lib as h

warnings.filterwarnings("ignore", message=".*(Sparse|sparse|nested|prototype).*")


def _coo(indices, values, size, **kw):
    return torch.sparse_coo_tensor(torch.tensor(indices, dtype=torch.int64), values, size, is_coalesced=False, **kw)


def _every_load(value, tmp_path):
    """``value`` saved, then loaded from bytes, from a file and from a memory map of it: each load
    gives a value that saves to the same bytes."""
    data = tc.dumps(value)
    path = tmp_path / "v.safetensors"
    path.write_bytes(data)
    loaded = [tc.loads(data), tc.load(path), tc.load(path, mmap=True), tc.load(io.BytesIO(data))]
    for back in loaded:
        assert tc.dumps(back) == data, "saving what was loaded gives other bytes"
    assert tc.verify(data) == tc.fingerprint(value) == tc.verify(path)
    return loaded


def _node(value):
    """The tree node ``value`` is written as (the root's)."""
    return h.manifest_of(tc.dumps(value))[0]["root"]


# ------------------------------------------------------------------ uncoalesced COO tensors


UNCOALESCED = {
    "repeated": lambda: _coo([[1, 0, 1], [0, 2, 0]], torch.tensor([1.0, 2.0, 3.0]), (2, 3)),
    "sorted_never_coalesced": lambda: _coo([[0, 2]], torch.tensor([1, 2], dtype=torch.int16), (4,)),
    "descending": lambda: _coo([[3, 2, 1, 0]], torch.arange(4.0), (4,)),
    "empty": lambda: _coo([[], []], torch.zeros(0), (2, 2)),
    "one": lambda: _coo([[1]], torch.tensor([5.0]), (3,)),
    "hybrid_grad": lambda: _coo([[3, 0, 3]], torch.arange(6.0).reshape(3, 2), (4, 2)).requires_grad_(),
    "parameter": lambda: torch.nn.Parameter(_coo([[2, 2]], torch.tensor([1.0, 1.0]), (3,)), requires_grad=False),
    "no_sparse_dim": lambda: torch.sparse_coo_tensor(torch.zeros(0, 2, dtype=torch.int64), torch.tensor([1.0, 2.0]),
                                                      ()),
}


@pytest.mark.parametrize("name", sorted(UNCOALESCED))
def test_an_uncoalesced_coo_tensor_comes_back_as_it_was(name, tmp_path):
    s = UNCOALESCED[name]()
    assert not s.is_coalesced()
    for back in _every_load({"s": s, "again": s}, tmp_path):
        b = back["s"]
        assert back["again"] is b and type(b) is type(s) and b.layout is torch.sparse_coo
        assert not b.is_coalesced(), "an uncoalesced tensor came back coalesced"
        assert torch.equal(b._indices(), s._indices()) and torch.equal(b._values().detach(), s._values().detach())
        assert b.shape == s.shape and b.requires_grad == s.requires_grad and b.dtype == s.dtype


def test_a_coalesced_coo_tensor_is_written_as_before_and_an_uncoalesced_one_apart():
    s = UNCOALESCED["sorted_never_coalesced"]()
    c = torch.sparse_coo_tensor(s._indices(), s._values(), s.shape, is_coalesced=True)
    node = ["sparse", "coo", ["size", 4], "tensor", False, ["tensor", 0], ["tensor", 1]]
    assert _node(c) == node  # (the node of every file written before issue 37)
    assert _node(s) == [*node, False]
    back = tc.loads(tc.dumps(c))
    assert back.is_coalesced() and torch.equal(back._indices(), c._indices())
    assert tc.fingerprint(s) != tc.fingerprint(c)


def _as_coo_node(indices, flag) -> bytes:
    """A file whose root is a COO node over ``indices`` (one sparse dimension of size 3), ending in ``flag``."""
    data = tc.dumps(collections.OrderedDict(indices=torch.tensor([indices]), values=torch.ones(len(indices))))

    def edit(m):
        m["root"] = ["sparse", "coo", ["size", 3], "tensor", False, ["tensor", 0], ["tensor", 1], flag]
    return h.with_manifest(data, edit)


def _refused(data: bytes, match: str) -> None:
    """load and verify (bytes, a stream) both reject ``data`` with one message naming the path."""
    with pytest.raises(FormatError, match=match) as info:
        tc.loads(data)
    assert "at $" in str(info.value)
    for source in (data, h.Stream(data, step=97)):
        with pytest.raises(FormatError) as verified:
            tc.verify(source)
        assert str(verified.value) == str(info.value)


def test_an_uncoalesced_node_holds_any_order_and_nothing_else():
    back = tc.loads(_as_coo_node([2, 0, 2], False))
    assert not back.is_coalesced() and back._indices().tolist() == [[2, 0, 2]]
    _refused(_as_coo_node([0, 1], True), "must be false")     # a coalesced node has no flag
    _refused(_as_coo_node([0, 1], 0), "must be false")
    _refused(_as_coo_node([0, 1], None), "must be false")
    _refused(_as_coo_node([2, 3], False), "out of range")     # the range rule holds for both
    _refused(_as_coo_node([-1, 0], False), "out of range")


# ------------------------------------------------------------------ jagged nested tensors


def _seqlens(t):
    cache = t._metadata_cache
    return tuple(None if cache.get(k) is None else getattr(t, f"_{k}") for k in ("min_seqlen", "max_seqlen"))


HINTS = {"min_seqlen", "max_seqlen"} <= set(inspect.signature(torch.nested.nested_tensor_from_jagged).parameters)
needs_hints = pytest.mark.skipif(not HINTS, reason=(
    "this torch's nested_tensor_from_jagged takes no min/max_seqlen (so no jagged tensor caches given lengths): "
    "not tested on the floors"))


def _jagged(**hints):
    return torch.nested.nested_tensor_from_jagged(torch.arange(10.0).reshape(5, 2), torch.tensor([0, 2, 5]), **hints)


JAGGED = {
    "from_list": lambda: torch.nested.nested_tensor([torch.ones(1, 2), torch.arange(6.0).reshape(3, 2)],
                                                    layout=torch.jagged),
    "max_hint": lambda: _jagged(max_seqlen=8),
    "min_hint": lambda: _jagged(min_seqlen=0),
    "both_hints": lambda: _jagged(min_seqlen=1, max_seqlen=1000),
    "computed": lambda: (lambda t: (t._max_seqlen, t)[1])(_jagged()),  # reading _max_seqlen caches it
}


@pytest.mark.parametrize("name", [n if n in ("from_list", "computed") else pytest.param(n, marks=needs_hints)
                                  for n in sorted(JAGGED)])
def test_a_jagged_tensor_keeps_the_lengths_it_caches(name, tmp_path):
    j = JAGGED[name]()
    held = _seqlens(j)
    assert held != (None, None)
    for back in _every_load({"j": j}, tmp_path):
        b = back["j"]
        assert _seqlens(b) == held, "the cached lengths changed on the way through"
        assert set(b._metadata_cache) == set(j._metadata_cache)
        assert torch.equal(b.values(), j.values()) and torch.equal(b.offsets(), j.offsets())


@needs_hints
def test_a_jagged_tensor_that_caches_nothing_is_written_as_before():
    j = _jagged()
    assert j._metadata_cache == {}
    assert _node(j) == ["nested", "jagged", "float32", False, ["tensor", 0], ["tensor", 1]]
    back = tc.loads(tc.dumps(j))
    assert back._metadata_cache == {}  # (none gained either)
    assert _node(_jagged(max_seqlen=3))[6:] == [None, 3]


def _as_jagged_node(*seqlens) -> bytes:
    data = tc.dumps(collections.OrderedDict(values=torch.ones(5, 2), offsets=torch.tensor([0, 2, 5])))

    def edit(m):
        m["root"] = ["nested", "jagged", "float32", False, ["tensor", 0], ["tensor", 1], *seqlens]
    return h.with_manifest(data, edit)


def test_cached_lengths_in_a_file_are_checked():
    assert _seqlens(tc.loads(_as_jagged_node(2, 3))) == (2, 3)
    assert _seqlens(tc.loads(_as_jagged_node(None, 7))) == (None, 7)
    _refused(_as_jagged_node(None, None), "both nil")
    _refused(_as_jagged_node(-1, 3), "min_seqlen must be nil or an int")
    _refused(_as_jagged_node(1, True), "max_seqlen must be nil or an int")
    _refused(_as_jagged_node(1, 2.0), "max_seqlen must be nil or an int")
    _refused(_as_jagged_node(1, 2**63), "max_seqlen must be nil or an int")
    _refused(_as_jagged_node(1), "takes 5 values")


def test_a_jagged_tensor_with_grad_saves_after_values_was_called(tmp_path):
    j = torch.nested.nested_tensor([torch.ones(1, 2), torch.ones(3, 2)], layout=torch.jagged, requires_grad=True)
    j.values()  # torch caches the sizes in PyCapsules in its __dict__ (_sym_sizes_capsule, ...)
    j.note = "mine"  # (an attribute the program set is still saved)
    for back in _every_load({"j": j}, tmp_path):
        b = back["j"]
        assert b.requires_grad and b.note == "mine" and _seqlens(b) == _seqlens(j)
        assert set(tensorkinds.attributes(b)) == set(tensorkinds.attributes(j)) == {"note"}


# ------------------------------------------------------------------ one object per node and attributes


def test_a_sparse_tensor_with_attributes_and_one_of_the_same_parts_without_stay_two_objects(tmp_path):
    noted = torch.eye(3).to_sparse()
    noted.note = "kept"
    plain = torch.sparse_coo_tensor(noted._indices(), noted._values(), (3, 3), is_coalesced=True)  # its parts
    value = [plain, noted, noted, plain]
    root = _node(value)
    assert root[1] == root[4] and root[2] == root[3] and root[2][1] == root[1]  # equal nodes but the attributes
    for back in _every_load(value, tmp_path):
        assert back[0] is back[3] and back[1] is back[2] and back[0] is not back[1]
        assert back[1].note == "kept" and not back[0].__dict__


@needs_hints
def test_a_jagged_tensor_with_attributes_used_twice_is_one_object_with_them(tmp_path):
    j = _jagged(max_seqlen=4)
    j.role = "batch"
    other = torch.nested.nested_tensor_from_jagged(j.values(), j.offsets(), max_seqlen=4)  # the same node
    for back in _every_load([j, other, j], tmp_path):
        assert back[0] is back[2] and back[1] is not back[0]
        assert back[0].role == "batch" and "role" not in back[1].__dict__
