"""Packed lists, format version 3 (docs/FORMAT.md §6.13): which lists the writer packs, how, and
every rule a reader checks. The bytes are locked by the golden vector ``packed_lists``."""

from __future__ import annotations

import collections
import dataclasses
import enum

import msgpack
import pytest
import torch

import tensorcanon
from tensorcanon import FormatError, LimitError

import hostile_lib as h


def _root_node(data: bytes):
    """The node of ``v`` in a file of ``{"v": ...}``."""
    return h.manifest_of(data)[0]["root"][2]


def _edited(value, edit, version=None) -> bytes:
    """The file of ``{"v": value}`` whose node of ``v`` is ``edit(node)``, digests re-sealed."""
    def change(m):
        m["root"][2] = edit(m["root"][2])
        if version is not None:
            m["version"] = version
    return h.with_manifest(tensorcanon.dumps({"v": value}), change)


# ------------------------------------------------------------------ the writer's choice


@pytest.mark.parametrize(("items", "kind"), [
    ([0, 255] + [1] * 14, "uint8"),
    ([-128, 127] + [1] * 14, "int8"),
    ([0, 256] + [1] * 14, "uint16"),
    ([-1, 128] + [1] * 14, "int16"),
    ([0, 65536] + [1] * 14, "uint32"),
    ([-1, 32768] + [1] * 14, "int32"),
    ([0, 2**32] + [1] * 14, "uint64"),
    ([-1, 2**31] + [1] * 14, "int64"),
    ([-(2**63), 2**63 - 1] + [1] * 14, "int64"),
    ([0, 2**64 - 1] + [1] * 14, "uint64"),
])
def test_ints_take_the_first_type_that_holds_every_item(items, kind):
    data = tensorcanon.dumps({"v": items})
    node = _root_node(data)
    size = int(kind.lstrip("uint")) // 8
    assert list(node) == ["ints", kind, b"".join(i.to_bytes(size, "little", signed=kind[0] == "i") for i in items)]
    back = tensorcanon.loads(data)["v"]
    assert back == items and all(type(x) is int for x in back)


class Color(enum.IntEnum):
    RED = 1


@pytest.mark.parametrize("items", [
    list(range(15)),                      # fewer than 16
    [True] * 16,                          # bools are not ints here
    [True] + list(range(15)),
    [2**64] + list(range(15)),            # a big int
    [-1, 2**63] + list(range(14)),        # no element type holds both
    [0.0] + list(range(15)),
    [Color.RED] * 16,                     # an int subclass is not an int (it is refused unregistered)
], ids=["fifteen", "bools", "bool_first", "big", "no_type", "float", "int_enum"])
def test_lists_that_stay_lists(items):
    try:
        data = tensorcanon.dumps({"v": items})
    except tensorcanon.UnsupportedTypeError:
        assert type(items[0]) is Color
        return
    assert _root_node(data)[0] == "list"
    back = tensorcanon.loads(data)["v"]
    assert back == items and [type(x) for x in back] == [type(x) for x in items]


def test_only_lists_pack():
    data = tensorcanon.dumps({"t": tuple(range(20)), "d": collections.deque(range(20)),
                              "r": ({"a": 1}, {"a": 2})})
    root = h.manifest_of(data)[0]["root"]
    assert [root[2][0], root[4][0], root[6][0]] == ["deque", "tuple", "tuple"]


def test_records_share_key_lists_in_order_of_first_use():
    log = [{"loss": 2.5, "step": 10}, {"step": 20, "loss": 2.25}, {"eval_loss": 2.0, "step": 20},
           {"loss": 2.0, "step": 30}]
    data = tensorcanon.dumps({"v": log})
    node = _root_node(data)
    assert node[0] == "records" and [list(k) for k in node[1]] == [["loss", "step"], ["eval_loss", "step"]]
    assert [list(r) for r in node[2:]] == [[0, 2.5, 10], [0, 2.25, 20], [1, 2.0, 20], [0, 2.0, 30]]
    back = tensorcanon.loads(data)["v"]
    assert back == log and [list(d) for d in back] == [sorted(d) for d in log]  # canonical key order


@pytest.mark.parametrize("items", [
    [{"a": 1}],                            # one dict
    [{"a": 1}, {1: 2}],                   # a non-str key
    [{"a": [1]}, {"a": 2}],               # a nested value
    [{"a": 2**64}, {"a": 1}],             # a big int
    [{"a": 1}, collections.OrderedDict(a=2)],
    [{"a": torch.ones(1)}, {"a": torch.zeros(1)}],
    [{"a": 1}, 2],
], ids=["one", "int_key", "nested", "big", "odict", "tensor", "not_dict"])
def test_lists_of_dicts_that_stay_lists(items):
    data = tensorcanon.dumps({"v": items})
    assert _root_node(data)[0] == "list"
    back = tensorcanon.loads(data)["v"]
    assert len(back) == len(items) and [type(x) for x in back] == [type(x) for x in items]


def test_packing_applies_in_metadata_and_registered_states():
    @dataclasses.dataclass
    class Run:
        ids: list
        log: list

    tensorcanon.register(Run, name="test_packed.Run")
    try:
        value = Run(ids=list(range(20)), log=[{"a": 1}, {"a": 2}])
        data = tensorcanon.dumps({"v": value}, metadata={"ids": list(range(30))})
        m = h.manifest_of(data)[0]
        state = m["root"][2][2]
        assert [state[2][0], state[4][0]] == ["ints", "records"]
        assert m["meta"][2][0] == "ints"
        assert tensorcanon.loads(data)["v"] == value
        assert tensorcanon.read_metadata(data) == {"ids": list(range(30))}
    finally:
        tensorcanon.unregister(Run)


def test_records_at_the_depth_limit_are_refused_as_the_list_of_dicts_is():
    limits = tensorcanon.Limits(max_depth=3)
    # {"v": [ {..}, {..} ]}: the root dict is at depth 0, the list at 1, each record at 2
    assert tensorcanon.loads(tensorcanon.dumps({"v": [{"a": 1}, {"a": 2}]}, limits=limits), limits=limits)
    deeper = {"w": {"v": [{"a": 1}, {"a": 2}]}}
    with pytest.raises(LimitError, match="max_depth=3"):
        tensorcanon.dumps(deeper, limits=limits)
    data = tensorcanon.dumps(deeper)
    with pytest.raises(LimitError, match="max_depth=3"):
        tensorcanon.loads(data, limits=limits)


# ------------------------------------------------------------------ what a reader rejects


def _ints(kind, data):
    return lambda node: ["ints", kind, data]


@pytest.mark.parametrize(("value", "edit", "match"), [
    (list(range(16)), _ints("uint16", b"".join(i.to_bytes(2, "little") for i in range(16))), "comes before uint16"),
    (list(range(16)), _ints("int8", bytes(range(16))), "comes before int8"),
    (list(range(16)), _ints("uint8", bytes(range(15))), "fewer than 16"),
    (list(range(16)), _ints("uint8", b""), "fewer than 16"),
    (list(range(300, 316)), _ints("uint16", bytes(33)), "multiple of 2"),
    (list(range(16)), _ints("int7", bytes(16)), "element type 'int7'"),
    (list(range(16)), _ints("uint8", "x" * 16), "must be a bin"),
    (list(range(16)), lambda node: ["ints", "uint8"], "takes 2 values"),
    ([{"a": 1, "b": 2}, {"a": 3, "b": 4}], lambda n: ["records", [["b", "a"]], [0, 2, 1], [0, 4, 3]],
     "strictly increasing"),
    ([{"a": 1}, {"a": 2}], lambda n: ["records", [["a", "a"]], [0, 1, 1], [0, 2, 2]], "strictly increasing"),
    ([{"a": 1}, {"a": 2}], lambda n: ["records", [["a"], ["a"]], [0, 1], [1, 2]], "repeats"),
    ([{"a": 1}, {"a": 2}], lambda n: ["records", [["a"], ["b"]], [1, 2], [0, 1]], "order of first use"),
    ([{"a": 1}, {"a": 2}], lambda n: ["records", [["a"], ["b"]], [0, 1], [0, 2]], "its rows use 1"),
    ([{"a": 1}, {"a": 2}], lambda n: ["records", [["a"]], [0, 1], [-1, 2]], "names key list -1"),
    ([{"a": 1}, {"a": 2}], lambda n: ["records", [["a"]], [0, 1], [True, 2]], "names key list True"),
    ([{"a": 1}, {"a": 2}], lambda n: ["records", [["a"]], [0, 1], [0]], "holds 0 values for 1 keys"),
    ([{"a": 1}, {"a": 2}], lambda n: ["records", [["a"]], [0, 1], [0, 2, 3]], "holds 2 values for 1 keys"),
    ([{"a": 1}, {"a": 2}], lambda n: ["records", [["a"]], [0, ["list", 1]], [0, 2]], "not a leaf"),
    ([{"a": 1}, {"a": 2}], lambda n: ["records", [["a"]], [0, msgpack.ExtType(1, b"\x01" + bytes(8))], [0, 2]],
     "not a leaf"),
    ([{"a": 1}, {"a": 2}], lambda n: ["records", [["a"]], [0, 1]], "at least 2 rows"),
    ([{"a": 1}, {"a": 2}], lambda n: ["records", [], [0, 1], [0, 2]], "non-empty array"),
    ([{"a": 1}, {"a": 2}], lambda n: ["records", [[1]], [0, 1], [0, 2]], "array of str"),
    ([{"a": 1}, {"a": 2}], lambda n: ["records", [["a"]], 5, [0, 2]], "row 0 must be an array"),
])
def test_a_reader_rejects_each_broken_rule(value, edit, match):
    bad = _edited(value, edit)
    with pytest.raises(FormatError, match=match):
        tensorcanon.loads(bad)
    with pytest.raises(FormatError, match=match):
        tensorcanon.verify(bad)


def _as_list(node):
    from tensorcanon.format import packed

    return [list(x) if type(x) is tuple else x for x in packed.expand(node)]


@pytest.mark.parametrize(("value", "tag"), [(list(range(16)), "ints"), ([{"a": 1}, {}], "records")])
def test_a_version_3_reader_rejects_a_list_the_writer_packs(value, tag):
    bad = _edited(value, _as_list)
    for read in (tensorcanon.loads, tensorcanon.verify):
        with pytest.raises(FormatError, match=f"is written as a '{tag}' node from format version 3"):
            read(bad)
    # the same tree in a version-2 file is what version 2 writes: accepted
    assert tensorcanon.loads(_edited(value, _as_list, version=2))["v"] == value


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize(("value", "tag"), [(list(range(16)), "ints"), ([{"a": 1}, {}], "records")])
def test_packed_nodes_are_not_in_older_versions(version, value, tag):
    bad = _edited(value, lambda node: node, version=version)
    for read in (tensorcanon.loads, tensorcanon.verify):
        with pytest.raises(FormatError, match=f"the tag '{tag}' is not in format version {version}"):
            read(bad)


def test_the_rules_apply_in_metadata_too():
    data = tensorcanon.dumps({}, metadata={"ids": list(range(16))})
    bad = h.with_manifest(data, lambda m: m["meta"].__setitem__(2, _as_list(m["meta"][2])))
    with pytest.raises(FormatError, match="is written as a 'ints' node"):
        tensorcanon.loads(bad)
