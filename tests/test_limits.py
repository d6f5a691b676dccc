"""Safety limits users can raise (issue 6, part 6).

Each limit, when hit, raises LimitError naming the limit and how to raise it;
raising it as the message says makes the same file load.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tensorcanon
from tensorcanon import Limits
from tensorcanon.format import errors


def _nested(depth: int):
    v = 0
    for _ in range(depth):
        v = [v]
    return v


def _assert_says_how(e: errors.LimitError, limit: str) -> None:
    assert e.limit == limit
    msg = str(e)
    assert f"{limit}=" in msg, msg
    assert f"tensorcanon.Limits({limit}=...)" in msg, msg
    assert isinstance(e, errors.FormatError)


CASES = {
    "max_header_bytes": (lambda: {"t": torch.ones(3)}, lambda n: Limits(max_header_bytes=n // 2), "max_header_bytes"),
    "max_depth": (lambda: {"deep": _nested(40)}, lambda n: Limits(max_depth=20), "max_depth"),
    "max_tensors": (lambda: {f"t{i}": torch.ones(1) for i in range(10)}, lambda n: Limits(max_tensors=9),
                    "max_tensors"),
    "max_ndim": (lambda: {"t": torch.ones([1] * 9)}, lambda n: Limits(max_ndim=8), "max_ndim"),
    "max_string_array_bytes": (lambda: {"labels": np.array(["cat", "dog"]), "more": np.array([b"x"] * 8, dtype="S100")},
                               lambda n: Limits(max_string_array_bytes=800), "max_string_array_bytes"),
}


@pytest.mark.parametrize("limit", sorted(CASES))
def test_each_limit_names_itself_and_can_be_raised(limit):
    make, low, name = CASES[limit]
    obj = make()
    data = tensorcanon.dumps(obj)
    header_len = int.from_bytes(data[:8], "little")
    tight = low(header_len)
    for fn in (tensorcanon.loads, tensorcanon.verify, tensorcanon.read_metadata):
        if fn is tensorcanon.read_metadata and limit in ("max_depth", "max_string_array_bytes"):
            continue  # the deep value (the arrays) is in the object, not the metadata
        with pytest.raises(errors.LimitError) as info:
            fn(data, limits=tight)
        _assert_says_how(info.value, name)
    # raised as the message says, the file loads
    import dataclasses
    raised = dataclasses.replace(tight, **{name: getattr(Limits(), name)})
    again = tensorcanon.loads(data, limits=raised)
    assert tensorcanon.dumps(again) == data


def test_max_depth_of_metadata_is_enforced_when_reading_it():
    data = tensorcanon.dumps({"a": 1}, metadata={"deep": _nested(30)})
    with pytest.raises(errors.LimitError) as info:
        tensorcanon.read_metadata(data, limits=Limits(max_depth=10))
    _assert_says_how(info.value, "max_depth")
    assert tensorcanon.read_metadata(data) == {"deep": _nested(30)}


def test_saving_beyond_max_depth_says_how_to_raise_it():
    with pytest.raises(errors.LimitError, match=r"Limits\(max_depth=\.\.\.\)"):
        tensorcanon.dumps(_nested(30), limits=Limits(max_depth=10))
    assert tensorcanon.loads(tensorcanon.dumps(_nested(30), limits=Limits(max_depth=40)),
                             limits=Limits(max_depth=40)) == _nested(30)


def test_defaults_are_documented_values():
    d = Limits()
    assert (d.max_header_bytes, d.max_depth, d.max_tensors, d.max_ndim) == (100_000_000, 256, 1_000_000, 64)


def test_limits_apply_to_plain_safetensors_files_too():
    import safetensors.torch

    data = safetensors.torch.save({f"t{i}": torch.ones(2) for i in range(5)})
    with pytest.raises(errors.LimitError) as info:
        tensorcanon.loads(data, limits=Limits(max_tensors=4))
    _assert_says_how(info.value, "max_tensors")
    assert len(tensorcanon.loads(data)) == 5


def test_depth_beyond_python_recursion_is_a_clear_error_both_ways():
    # Raising max_depth cannot raise Python's recursion limit: both sides say so, never
    # letting a bare RecursionError escape.
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "fuzz"))
    import hostile_lib as h

    deep_limits = tensorcanon.Limits(max_depth=5000)
    x = 0
    for _ in range(2000):
        x = [x]
    with pytest.raises(tensorcanon.LimitError, match="recursion limit"):
        tensorcanon.dumps(x, limits=deep_limits)

    data = tensorcanon.dumps({"x": 0})
    m, _, _ = h.manifest_of(data)
    node = 0
    for _ in range(500):  # within msgpack's own nesting limit (512), beyond Python's stack here
        node = ["list", node]
    m["root"] = ["dict", "x", node]
    crafted = h.rebuild(data, h.repack(m))
    for read in (lambda: tensorcanon.loads(crafted, limits=deep_limits),
                 lambda: tensorcanon.verify(crafted, limits=deep_limits)):
        with pytest.raises(tensorcanon.FormatError, match="recursion limit"):
            read()


def test_the_writer_refuses_a_header_readers_refuse():
    """A value whose manifest outgrows max_header_bytes is refused when saved, not after: the writer
    never writes a file its reader rejects."""
    limits = tensorcanon.Limits(max_header_bytes=4096)
    with pytest.raises(tensorcanon.LimitError, match="max_header_bytes=4096") as info:
        tensorcanon.dumps({"blob": b"x" * 8192}, limits=limits)
    assert info.value.limit == "max_header_bytes"
    data = tensorcanon.dumps({"blob": b"x" * 1024}, limits=limits)
    assert tensorcanon.loads(data, limits=limits) == {"blob": b"x" * 1024}


def test_the_writer_applies_the_string_array_budget_naming_the_array():
    """numpy string arrays of one file take at most max_string_array_bytes together (FORMAT.md §9.4),
    counted as width x elements: the writer refuses what readers would refuse, naming the array."""
    value = {"a": np.array(["x"] * 10, dtype="U10"), "b": np.array(["y"] * 10, dtype="U10")}  # 400 bytes each
    with pytest.raises(errors.LimitError, match=r'up to the one at \$\["b"\] take 800 bytes') as info:
        tensorcanon.dumps(value, limits=Limits(max_string_array_bytes=799))
    assert info.value.limit == "max_string_array_bytes" and info.value.path == '$["b"]'
    data = tensorcanon.dumps(value, limits=Limits(max_string_array_bytes=800))
    assert tensorcanon.loads(data, limits=Limits(max_string_array_bytes=800))["b"].dtype == np.dtype("U10")
