"""The loader accepts only canonical files, and the writer never confuses two tensors.

Each test builds a file that a conforming writer could not produce (the manifest
is rewritten and its digest recomputed, so the integrity checks pass and the
structural checks are what must catch it) and checks the error says what is wrong.
"""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch

import tensorcanon
from tensorcanon import FormatError

import hostile_lib as h


def _all_read_paths(data: bytes, match: str) -> None:
    with pytest.raises(FormatError, match=match):
        tensorcanon.loads(data)
    with pytest.raises(FormatError, match=match):
        tensorcanon.verify(io.BytesIO(data))


# ------------------------------------------------------------- keys Python merges

@pytest.mark.parametrize("tag, nodes", [
    ("dict", [True, "a", 1, "b"]),
    ("set", [True, 1]),
    ("frozenset", [True, 1]),
    ("dict", [["tuple", True], "a", ["tuple", 1], "b"]),
])
def test_keys_that_python_merges_are_refused(tag, nodes):
    data = tensorcanon.dumps({"x": 0})

    def edit(m):
        m["root"] = ["dict", "x", [tag, *nodes]]

    bad = h.with_manifest(data, edit)
    with pytest.raises(FormatError, match="keys that Python treats as equal"):
        tensorcanon.loads(bad)


def test_ordered_dict_with_merged_keys_is_refused():
    data = tensorcanon.dumps({"x": 0})

    def edit(m):
        m["root"] = ["odict", None, 1, "a", True, "b"]

    with pytest.raises(FormatError, match="keys that Python treats as equal"):
        tensorcanon.loads(h.with_manifest(data, edit))


def test_oversized_torch_size_is_a_format_error():
    data = tensorcanon.dumps({"x": 0})

    def edit(m):
        m["root"] = ["size", 2**64 - 1]

    with pytest.raises(FormatError, match="'size' takes ints that fit in 64 bits"):
        tensorcanon.loads(h.with_manifest(data, edit))


# ------------------------------------------------------------- the tensor table

def _two_tensors() -> bytes:
    return tensorcanon.dumps({"a": torch.ones(2), "b": torch.zeros(3)})


def test_swapped_tensor_uses_are_refused():
    # The tree uses tensor 1 before tensor 0: a writer numbers tensors in first-use order.
    def edit(m):
        m["root"] = ["dict", "a", ["tensor", 1], "b", ["tensor", 0]]

    bad = h.with_manifest(_two_tensors(), edit)
    _all_read_paths(bad, "tensor 1 is used before tensor 0")


def test_non_canonical_tensor_names_are_refused():
    # Rename tensor "a" to "z" everywhere (header, table, data order stays valid): the file is
    # self-consistent safetensors, but "z" is not the name the path ["a"] gives.
    bad = h.renamed(tensorcanon.dumps({"a": torch.ones(2)}), "a", "z")
    with pytest.raises(FormatError, match=r"named 'z', but its canonical name is 'a'"):
        tensorcanon.loads(bad)
    with pytest.raises(FormatError, match="canonical name"):
        tensorcanon.verify(io.BytesIO(bad))


def test_verify_refuses_tensors_the_tree_never_uses():
    def edit(m):
        m["root"] = ["dict", "a", ["tensor", 0]]

    bad = h.with_manifest(_two_tensors(), edit)
    _all_read_paths(bad, r"listed but never used")


def test_metadata_must_be_a_dict_with_str_keys():
    data = tensorcanon.dumps({"x": 0}, metadata={"epoch": 1})

    def edit(m):
        m["meta"] = ["list", 1, 2]

    bad = h.with_manifest(data, edit)
    with pytest.raises(FormatError, match="user metadata must be a dict with str keys"):
        tensorcanon.read_metadata(io.BytesIO(bad))
    with pytest.raises(FormatError, match="user metadata must be a dict with str keys"):
        tensorcanon.verify(io.BytesIO(bad))


# ------------------------------------------------------------- encoder identity

@dataclasses.dataclass
class _Views:
    """Its registered encoding returns fresh view objects on every call."""

    base: torch.Tensor
    own: torch.Tensor


def test_temporary_views_from_registered_encoders_are_never_confused():
    # Each object's state holds a fresh view equal to an earlier one (deduplicated, then freed
    # once the object is encoded) and a fresh tensor of its own. If the encoder forgot the freed
    # view, a later fresh tensor could reuse its id() and be written as the tied one. ("own" is
    # created first, so it is the object most likely to take the slot the last view freed.)
    tensorcanon.register(_Views, encode=lambda v: {"own": v.own.clone(), "tied": v.base[:2]},
                         decode=lambda s: s, name="tests.Views")
    try:
        base = torch.arange(4.0)
        objs = [_Views(base, torch.full((2,), float(i))) for i in range(200)]
        back = tensorcanon.loads(tensorcanon.dumps({"base": base[:2], "objs": objs}))
        for i, state in enumerate(back["objs"]):
            assert torch.equal(state["tied"], base[:2])
            assert torch.equal(state["own"], torch.full((2,), float(i))), f"object {i} got another tensor"
    finally:
        tensorcanon.unregister(_Views)


# ------------------------------------------------------------- writer limits

def test_writer_refuses_what_the_default_reader_would_refuse():
    # complex128 is stored as bytes with one extra header dimension: 64 dims become 65.
    t = torch.zeros([1] * 64, dtype=torch.complex128)
    with pytest.raises(tensorcanon.LimitError, match=r'\$\["w"\] has 65 header dimensions.*max_ndim=64'):
        tensorcanon.dumps({"w": t})
    raised = tensorcanon.Limits(max_ndim=65)
    assert torch.equal(tensorcanon.loads(tensorcanon.dumps({"w": t}, limits=raised), limits=raised)["w"], t)


def test_writer_applies_max_tensors():
    small = tensorcanon.Limits(max_tensors=3)
    with pytest.raises(tensorcanon.LimitError, match="4 tensors, more than max_tensors=3"):
        tensorcanon.dumps([torch.zeros(1) for _ in range(4)], limits=small)
    assert len(tensorcanon.loads(tensorcanon.dumps([torch.zeros(1)] * 4, limits=small), limits=small)) == 4


# ------------------------------------------------------------- many dimensions

def test_tensors_with_more_dimensions_than_numpy_1_allows_round_trip(tmp_path):
    # numpy < 2 holds at most 32 dimensions; the format allows 64 (max_ndim). Native dtypes take
    # the no-copy numpy path on save and load, so both sides must work around numpy's limit.
    for dtype in (torch.float32, torch.int64, torch.bool):
        t = (torch.arange(2 * 3 * 2) % 2).to(dtype).reshape([1] * 30 + [2, 3, 1, 2] + [1] * 6)
        assert t.dim() == 40
        data = tensorcanon.dumps({"w": t, "nc": t.transpose(30, 33)})
        back = tensorcanon.loads(data)
        assert torch.equal(back["w"], t) and back["w"].shape == t.shape
        assert torch.equal(back["nc"], t.transpose(30, 33))
        (tmp_path / "f.safetensors").write_bytes(data)
        with tensorcanon.open(tmp_path / "f.safetensors") as f:
            assert torch.equal(f['$["w"]'], t)


def test_numpy_array_of_more_dimensions_than_numpy_allows():
    # A file written with numpy >= 2 may hold a 40-dimensional array (built here by marking a
    # torch tensor's table row as an ndarray, digest fixed). numpy 2 loads it; numpy 1 cannot
    # hold it and must say so rather than raise numpy's own ValueError.
    import numpy as np

    data = tensorcanon.dumps({"a": torch.arange(6, dtype=torch.int32).reshape([1] * 37 + [2, 3, 1])})
    data = h.with_manifest(data, lambda m: m["tensors"][0].update(kind="ndarray"))
    if int(np.__version__.split(".")[0]) >= 2:
        a = tensorcanon.loads(data)["a"]
        assert type(a) is np.ndarray and a.shape == (1,) * 37 + (2, 3, 1)
        assert a.reshape(-1).tolist() == list(range(6))
    else:
        with pytest.raises(tensorcanon.UnsupportedTypeError, match=r"numpy array of 40 dimensions.*numpy >= 2"):
            tensorcanon.loads(data)
