"""Keys of the kinds added in issue 30 (docs/FORMAT.md §6.3: numpy bool/integer/str_/bytes_ scalars,
torch.dtype, registered Enum members) and numpy strings as values (§6.11)."""

from __future__ import annotations

import enum

import numpy as np
import pytest
import torch

import tensorcanon
from tensorcanon.format.errors import FormatError, UnsupportedTypeError

import hostile_lib as h


class Split(enum.Enum):
    TRAIN = "train"
    TEST = "test"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


@pytest.fixture
def splits():
    tensorcanon.register(Split, name="test.Split")
    tensorcanon.register(Level, name="test.Level")
    yield
    tensorcanon.unregister(Split)
    tensorcanon.unregister(Level)


def _names(data: bytes) -> list:
    header, _ = h.split(data)
    return sorted(k for k in header if k != "__metadata__")


def _root(node) -> bytes:
    data = tensorcanon.dumps({"v": 0})
    return h.with_manifest(data, lambda m: m.__setitem__("root", ["dict", "v", node]))


def test_new_key_kinds_round_trip_in_canonical_order(splits):
    keys = [np.int64(3), np.uint8(200), np.int8(-1), np.True_, np.str_("b"), np.bytes_(b"z"), torch.float32,
            torch.bfloat16, Split.TRAIN, Split.TEST, Level.HIGH, (torch.int8, Split.TEST), frozenset({np.str_("x")}),
            "a", 0.5, None]
    forward = {k: i for i, k in enumerate(keys)}
    backward = {k: i for i, k in reversed(list(enumerate(keys)))}
    data = tensorcanon.dumps(forward)
    assert data == tensorcanon.dumps(backward)  # insertion order does not matter
    back = tensorcanon.loads(data)
    assert back == forward
    for k in keys:  # each key comes back with its type
        found = [b for b in back if type(b) is type(k) and b == k]
        assert len(found) == 1, k
    assert tensorcanon.verify(data)  # a verifying reader, which builds no values, checks the same order
    assert tensorcanon.dumps(back) == data
    order = [type(k) for k in back]
    assert order == [type(None), np.bool_, np.int8, float, np.int64, np.uint8, str, np.str_, np.bytes_,
                     tuple, frozenset, torch.dtype, torch.dtype, Level, Split, Split], order


def test_numpy_bool_keys_are_keys_now():
    """Once refused with "key of type bool has no canonical order; keys must be None, bool, ..."."""
    value = {np.True_: torch.ones(1), np.False_: torch.zeros(1)}
    back = tensorcanon.loads(tensorcanon.dumps(value))
    assert list(back) == [np.False_, np.True_] and all(type(k) is np.bool_ for k in back)
    assert _names(tensorcanon.dumps(value)) == ["False", "True"]


def test_label_maps_from_np_unique_round_trip():
    labels = np.array(["dog", "cat", "dog", "bird"])
    uniques = np.unique(labels)
    label_to_id = {lab: i for i, lab in enumerate(uniques)}  # np.str_ keys
    id_to_label = {np.int64(i): lab for i, lab in enumerate(uniques)}  # numpy int keys, np.str_ values
    value = {"l2i": label_to_id, "i2l": id_to_label, "classes": uniques}
    back = tensorcanon.loads(tensorcanon.dumps(value))
    assert back["l2i"] == label_to_id and all(type(k) is np.str_ for k in back["l2i"])
    assert back["i2l"] == id_to_label and all(type(v) is np.str_ for v in back["i2l"].values())
    assert back["classes"].dtype == uniques.dtype and (back["classes"] == uniques).all()


def test_key_text_of_the_new_kinds_names_tensors(splits):
    value = {torch.float32: torch.ones(1), np.int64(7): torch.ones(1), np.str_("s"): torch.ones(1),
             Split.TEST: torch.ones(1), (np.bytes_(b"k"), torch.int8): torch.ones(1)}
    assert _names(tensorcanon.dumps(value)) == ["(b'k', torch.int8)", "7", "s", "test.Split('test')",
                                                "torch.float32"]


def test_an_enum_key_needs_its_registration_and_the_advice_works():
    with pytest.raises(UnsupportedTypeError, match=r"numpy.float32 has no canonical order"):
        tensorcanon.dumps({np.float32(1): 1})
    with pytest.raises(UnsupportedTypeError, match=r"tensorcanon.register\(Split\)"):
        tensorcanon.dumps({Split.TRAIN: 1})
    tensorcanon.register(Split)  # exactly the advice
    try:
        assert tensorcanon.loads(tensorcanon.dumps({Split.TRAIN: 1})) == {Split.TRAIN: 1}
    finally:
        tensorcanon.unregister(Split)


def test_keys_python_merges_are_rejected(splits):
    tied = _root(["dict", 1, "a", ["np.scalar", "int64", (1).to_bytes(8, "little")], "b"])
    with pytest.raises(FormatError, match="canonical order"):
        tensorcanon.loads(tied)
    merged = _root(["dict", 2, "a", ["obj", "test.Level", 2], "b"])  # Level.HIGH == 2 to Python
    with pytest.raises(FormatError, match="treats as equal"):
        tensorcanon.loads(merged)


def test_a_registered_type_that_is_not_an_enum_is_not_a_key():
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Frozen:
        a: int

    tensorcanon.register(Frozen, name="test.Frozen")
    try:
        with pytest.raises(UnsupportedTypeError, match="no canonical order"):
            tensorcanon.dumps({Frozen(1): 1})
        bad = _root(["dict", ["obj", "test.Frozen", ["dict", "a", 1]], 1])
        with pytest.raises(FormatError, match="is not allowed"):
            tensorcanon.loads(bad)
        with pytest.raises(FormatError, match="is not allowed"):
            tensorcanon.verify(bad)
    finally:
        tensorcanon.unregister(Frozen)


@pytest.mark.parametrize("value", [
    np.str_("héllo"), np.str_(""), np.bytes_(b"a\x00b"), np.bytes_(b""), np.str_("a\x00"), np.bytes_(b"\x00"),
    np.array(["a", "bb", ""]), np.array([[b"x", b"\x00y"]], dtype="S4"), np.array("zero-d"),
    np.array(["big", "endian"], dtype=">U6"), np.zeros((0, 3), dtype="U2"), np.array(["a"])[::-1],
    np.array([["ab", "c"], ["d", "e"]]).T,
])
def test_numpy_strings_round_trip(value):
    data = tensorcanon.dumps({"v": value})
    back = tensorcanon.loads(data)["v"]
    assert type(back) is type(value)
    if isinstance(value, np.ndarray):
        assert back.dtype == value.dtype.newbyteorder("=") and back.shape == value.shape
        assert back.tolist() == value.tolist()
    else:
        assert back == value and back.dtype == value.dtype  # trailing NULs kept: they set the width
    assert tensorcanon.dumps({"v": back}) == data


def test_a_string_array_with_a_lone_surrogate_is_refused():
    with pytest.raises(UnsupportedTypeError, match="lone surrogate"):
        tensorcanon.dumps({"v": np.array(["ok", "\ud800"])})


def test_object_arrays_are_refused_and_both_remedies_work():
    arr = np.array(["cat", "dog"], dtype=object)
    with pytest.raises(UnsupportedTypeError, match=r"arr.tolist\(\).*arr.astype\(str\)"):
        tensorcanon.dumps({"v": arr})
    as_list = tensorcanon.loads(tensorcanon.dumps({"v": arr.tolist()}))["v"]
    assert as_list == ["cat", "dog"]
    as_str = tensorcanon.loads(tensorcanon.dumps({"v": arr.astype(str)}))["v"]
    assert as_str.dtype == np.dtype("<U3") and as_str.tolist() == ["cat", "dog"]


BAD = [
    (["np.str", b"a"], "takes a str"),
    (["np.bytes", "a"], "takes a bin"),
    (["np.strings", "U", 2, 1, 2, "ab"], "holds 1 elements"),
    (["np.strings", "U", 2, 1, 1, "abc"], "at most 2"),
    (["np.strings", "U", 2, 1, 1, "a\x00"], "NUL"),
    (["np.strings", "S", 2, 1, 1, "a"], "bytes"),
    (["np.strings", "O", 2, 0, "a"], "kind"),
    (["np.strings", "U", 0, 0, ""], "width"),
    (["np.strings", "U", 2**29, 0, ""], "width"),
    (["np.strings", "U", 1, 33], "dimensions"),
    (["np.strings", "U", 1, 1, -1], "non-negative"),
    (["np.strings", "U", 1, 2, 0, 2**62], "2\\^63"),
    (["np.strings", "U"], "needs its kind"),
]


@pytest.mark.parametrize("node, match", BAD, ids=[repr(n)[:40] for n, _ in BAD])
def test_reader_rejects_string_nodes_that_break_the_rules(node, match):
    bad = _root(node)
    with pytest.raises(FormatError, match=match):
        tensorcanon.loads(bad)
    with pytest.raises(FormatError, match=match):
        tensorcanon.verify(bad)


HOSTILE = [
    ["np.strings", ["list"], 1, 0], ["np.strings", "U", True, 0], ["np.strings", "U", 1, True],
    ["np.strings", "U", 1, 1, 2**64 - 1], ["np.strings", "S", 2**31, 0], ["np.strings", "U", 1, 1, 1, ["list"]],
    ["np.strings", "U", 1, 32, *([2**62] * 32)], ["np.str", ["list", "a"]], ["np.bytes"], ["np.str", "a", "b"],
    ["defaultdict", ["list"], 1, 2], ["defaultdict", "int", ["list"], 1], ["deque", 2**64 - 1, 1],
    ["counter", ["dict"], 1], ["dict", ["dtype", "nope"], 1], ["dict", ["obj", "x", ["list"]], 1],
    ["set", ["tuple", ["dtype", "float32"], ["np.str", "a"]], ["tuple", ["dtype", "float32"], ["np.str", "a"]]],
]


@pytest.mark.parametrize("node", HOSTILE, ids=[repr(n)[:50] for n in HOSTILE])
def test_malformed_nodes_of_the_new_kinds_are_format_errors_on_every_path(node):
    bad = _root(node)
    for read in (tensorcanon.loads, tensorcanon.verify):
        with pytest.raises((FormatError, UnsupportedTypeError)):
            read(bad)
