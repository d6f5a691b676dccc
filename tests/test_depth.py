"""The depth rule (docs/FORMAT.md §9.4) for every node kind, writer and reader, at the boundary.

A tagged array may sit at depth 0 .. max_depth-1 (the root is at 0). Each case
below is a value whose own node is at level 1 and whose deepest tagged array is
at level ``height`` (from the layouts in FORMAT.md §6). Wrapped in ``n`` lists,
its deepest node sits at depth ``n + height - 1``: with ``n = M - height`` it is
the deepest allowed under ``max_depth=M``, and one more list is one too many, for
the writer and for the reader (a file written with a raised limit).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import random

import numpy as np
import pytest
import torch

import tensorcanon
from tensorcanon import LimitError, Limits

M = 10


@dataclasses.dataclass
class _Cfg:
    lr: float
    steps: int


class _Mode(enum.Enum):
    A = 1


tensorcanon.register(_Cfg, name="test_depth.Cfg")
tensorcanon.register(_Mode, name="test_depth.Mode")


def _odict_with_metadata():
    od = collections.OrderedDict(w=1)
    od._metadata = {"": {"version": 1}}
    return od


# name -> (builder, height)
CASES = {
    "leaf int": (lambda: 3, 0),
    "list": (lambda: [1, 2], 1),
    "tuple": (lambda: (1, 2), 1),
    "dict": (lambda: {"a": 1}, 1),
    "dict with a tuple key": (lambda: {(1, 2): 1}, 2),
    "odict": (lambda: collections.OrderedDict(a=1), 1),
    "odict with _metadata": (_odict_with_metadata, 3),
    "set": (lambda: {1, 2}, 1),
    "set of frozensets": (lambda: {frozenset({1})}, 2),
    "frozenset": (lambda: frozenset({1}), 1),
    "complex": (lambda: 1 + 2j, 1),
    "size": (lambda: torch.Size([2, 3]), 1),
    "dtype": (lambda: torch.float32, 1),
    "device": (lambda: torch.device("cpu"), 1),
    "np.scalar": (lambda: np.float32(1.5), 1),
    "tensor": (lambda: torch.arange(3.0), 1),
    "ndarray": (lambda: np.arange(3), 1),
    "obj (dataclass: obj, dict)": (lambda: _Cfg(0.5, 3), 2),
    "obj (enum: obj)": (lambda: _Mode.A, 1),
    "rng.torch": (lambda: torch.Generator().manual_seed(1), 1),
    "rng.random": (lambda: random.Random(1), 1),
    "rng.numpy (rng.numpy, rng.bitgen, seed tuple, spawn_key tuple)": (lambda: np.random.default_rng(1), 4),
    "rng.legacy, seeded the legacy way (rng.legacy, rng.bitgen)": (lambda: np.random.RandomState(1), 2),
    "rng.legacy over a PCG64 (rng.legacy, rng.bitgen, seed tuple, spawn_key tuple)":
        (lambda: np.random.RandomState(np.random.PCG64(1)), 4),
    "rng.state (rng.state, rng.legacy, rng.bitgen)": (tensorcanon.RngState.capture, 3),
    "DeterminismSettings (obj, dict, gpu tuples)": (tensorcanon.DeterminismSettings.capture, 3),
}


def _wrap(value, n: int):
    for _ in range(n):
        value = [value]
    return value


@pytest.mark.parametrize("name", list(CASES))
def test_deepest_allowed_saves_and_loads(name):
    build, height = CASES[name]
    n = M - height
    obj = _wrap(build(), n)
    data = tensorcanon.dumps(obj, limits=Limits(max_depth=M))
    tensorcanon.loads(data, limits=Limits(max_depth=M))
    tensorcanon.verify(data, limits=Limits(max_depth=M))


@pytest.mark.parametrize("name", list(CASES))
def test_one_level_deeper_is_refused_by_the_writer_and_the_reader(name):
    build, height = CASES[name]
    n = M - height + 1
    obj = _wrap(build(), n)
    with pytest.raises(LimitError, match="max_depth=10") as info:
        tensorcanon.dumps(obj, limits=Limits(max_depth=M))
    assert info.value.limit == "max_depth"
    data = tensorcanon.dumps(obj, limits=Limits(max_depth=M + 1))
    with pytest.raises(LimitError, match="max_depth=10"):
        tensorcanon.loads(data, limits=Limits(max_depth=M))
    with pytest.raises(LimitError, match="max_depth=10"):
        tensorcanon.verify(data, limits=Limits(max_depth=M))
    tensorcanon.loads(data, limits=Limits(max_depth=M + 1))


def test_user_metadata_follows_the_same_rule():
    meta = {"a": _wrap(1, M - 1)}  # the metadata dict at 0, the deepest list at M-1
    data = tensorcanon.dumps({}, metadata=meta, limits=Limits(max_depth=M))
    assert tensorcanon.read_metadata(data, limits=Limits(max_depth=M)) == meta
    deeper = {"a": _wrap(1, M)}
    with pytest.raises(LimitError):
        tensorcanon.dumps({}, metadata=deeper, limits=Limits(max_depth=M))
    data = tensorcanon.dumps({}, metadata=deeper, limits=Limits(max_depth=M + 1))
    with pytest.raises(LimitError):
        tensorcanon.read_metadata(data, limits=Limits(max_depth=M))
