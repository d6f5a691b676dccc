"""The values docs/LIMITS.md lists as refused (beyond the tensor kinds and containers of
tests/test_errors.py): each is an UnsupportedTypeError naming its path, raised before anything is
written, with the type in the message."""

from __future__ import annotations

import collections
import decimal

import numpy as np
import pytest
import torch

import tensorcanon as tc

REFUSED = [
    ("storage", torch.ones(2).untyped_storage(), "UntypedStorage"),
    ("np_structured", np.zeros(2, dtype=[("a", "i4")]), "dtype"),
    ("np_datetime", np.array(["2020-01-01"], dtype="datetime64[D]"), "datetime64"),
    ("defaultdict_lambda", collections.defaultdict(lambda: 0), "defaultdict"),
    ("range", range(3), "range"),
    ("slice", slice(1, 2), "slice"),
    ("bytearray", bytearray(b"x"), "bytearray"),
    ("decimal", decimal.Decimal(1), "Decimal"),
    ("layout", torch.strided, "torch.layout"),
]
if np.dtype(np.longdouble).itemsize > 8:  # x86-64 Linux; where it is float64 it is saved as float64
    REFUSED.append(("np_longdouble", np.array([1.0], dtype=np.longdouble), "dtype"))


@pytest.mark.parametrize("key, value, word", REFUSED, ids=[r[0] for r in REFUSED])
def test_refused_with_its_path_and_type(key, value, word, tmp_path):
    target = tmp_path / "x.safetensors"
    with pytest.raises(tc.UnsupportedTypeError, match=word) as info:
        tc.save({"model": {key: value}}, target)
    assert f'$["model"]["{key}"]' in str(info.value)
    assert not target.exists() and list(tmp_path.iterdir()) == []
