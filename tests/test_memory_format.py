"""Memory formats (docs/FORMAT.md §5.6): channels-last layouts survive a round trip.

A memory format is layout, not content: a channels_last tensor and its
contiguous copy have the same bytes and digests; the layout is recorded in the
header (``tensorcanon.memory_formats``), outside the digest, as devices are, and
the loader restores it.
"""

from __future__ import annotations

import io
import itertools
import json
import pathlib

import numpy as np
import pytest
import torch

import tensorcanon
from tensorcanon.format import container, manifest
from tensorcanon.io import reader, writer

GOLDEN = pathlib.Path(__file__).parent / "golden"
CL = {"channels_last": torch.channels_last, "channels_last_3d": torch.channels_last_3d}


def spec_is_channels_last(shape, strides, name) -> bool:
    """§5.6 from the text: ignoring dimensions of size 1, the strides of the dense layout with
    the channel dimension fastest, then W, H (and D), then N."""
    order = [1, 3, 2, 0] if name == "channels_last" else [1, 4, 3, 2, 0]
    expected = 1
    for d in order:
        if shape[d] != 1:
            if strides[d] != expected:
                return False
            expected *= shape[d]
    return True


def spec_is_contiguous(shape, strides) -> bool:
    expected = 1
    for d in reversed(range(len(shape))):
        if shape[d] != 1:
            if strides[d] != expected:
                return False
            expected *= shape[d]
    return True


def spec_recorded(shape, strides):
    name = {4: "channels_last", 5: "channels_last_3d"}.get(len(shape))
    if name is None or 0 in shape or spec_is_contiguous(shape, strides):
        return None
    return name if spec_is_channels_last(shape, strides, name) else None


def _strided_cases():
    rng = np.random.default_rng(5)
    for ndim in (3, 4, 5):
        for shape in itertools.product(*[(1, 2, 3)] * ndim):
            base = torch.arange(int(np.prod(shape)), dtype=torch.float32).reshape(shape)
            yield base
            if ndim in CL:
                yield base.contiguous(memory_format=CL[{4: "channels_last", 5: "channels_last_3d"}[ndim]])
            yield base.permute(*rng.permutation(ndim).tolist())
    yield torch.zeros(0, 3, 2, 2).contiguous(memory_format=torch.channels_last)
    yield torch.arange(64.0).reshape(2, 4, 2, 4)[:, ::2]  # strided but neither


def test_the_writer_records_exactly_the_specs_rule():
    seen = set()
    for t in _strided_cases():
        p = writer.plan(t)
        want = spec_recorded(tuple(t.shape), t.stride())
        assert p.tensors[0].memory_format == want, (tuple(t.shape), t.stride())
        seen.add(want)
    assert seen == {None, "channels_last", "channels_last_3d"}


def test_which_shapes_can_be_recorded():
    """The reader's shape rule equals torch's: the format differs from contiguous exactly when
    there are elements, more than one channel and more than one spatial position."""
    for name, ndim in manifest.MEMORY_FORMAT_NDIM.items():
        for shape in itertools.product(*[(0, 1, 2, 3)] * ndim):
            differs = not torch.empty(shape, memory_format=CL[name]).is_contiguous()
            assert manifest.channels_last_differs(name, shape) == differs, shape


def _obj():
    x = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).reshape(2, 3, 4, 5)
    return x, {"x": x.contiguous(memory_format=torch.channels_last)}


def test_same_digest_as_the_contiguous_copy_and_the_layout_comes_back():
    x, obj = _obj()
    data = tensorcanon.dumps(obj)
    assert tensorcanon.fingerprint(obj) == tensorcanon.fingerprint({"x": x}) == tensorcanon.verify(data)
    plain = tensorcanon.dumps({"x": x})
    assert data != plain and len(data) >= len(plain)  # only the header's record differs
    back = tensorcanon.loads(data)["x"]
    assert back.is_contiguous(memory_format=torch.channels_last) and not back.is_contiguous()
    assert torch.equal(back, x)
    assert tensorcanon.loads(plain)["x"].is_contiguous()
    with tensorcanon.open(data) as f:
        assert f['$["x"]'].is_contiguous(memory_format=torch.channels_last)
    assert tensorcanon.loads(data, map_location="cpu")["x"].is_contiguous(memory_format=torch.channels_last)
    stream = io.BytesIO(data)
    assert tensorcanon.load(stream)["x"].is_contiguous(memory_format=torch.channels_last)


def test_the_golden_vector_restores_each_layout():
    data = (GOLDEN / "memory_formats.safetensors").read_bytes()
    back = tensorcanon.loads(data)
    assert back["nhwc"].is_contiguous(memory_format=torch.channels_last) and not back["nhwc"].is_contiguous()
    assert back["ndhwc"].is_contiguous(memory_format=torch.channels_last_3d) and not back["ndhwc"].is_contiguous()
    assert back["nchw"].is_contiguous() and back["one_channel"].is_contiguous()
    assert type(back["weight"]) is torch.nn.Parameter
    assert back["weight"].is_contiguous(memory_format=torch.channels_last)
    with reader.open_file(data) as cf:
        assert cf.header.metadata[manifest.KEY_MEMORY_FORMATS] == "1:channels_last_3d,2:channels_last,4:channels_last"
    record = json.loads((GOLDEN / "digests.json").read_text())["digests"]["memory_formats"]
    contiguous = {k: (v.contiguous() if k != "weight" else torch.nn.Parameter(v.detach().contiguous()))
                  for k, v in back.items()}
    assert tensorcanon.fingerprint(contiguous) == record  # the layout is outside the digest


def _with_formats(text: str | None, obj=None, version: int | None = None) -> bytes:
    obj = obj if obj is not None else {"a": torch.zeros(2, 3, 2, 2), "b": torch.zeros(1, 2, 2, 2, 2),
                                       "n": np.zeros((2, 3, 2, 2))}
    p = writer.plan(obj)
    buf = io.BytesIO()
    writer.write(p, buf)
    old, raw = p.header()
    if version is not None:  # the same file claiming another version (manifest and digest redone)
        raw = raw[:-1] + bytes([version])
    meta = manifest.header_metadata(raw, ["cpu"] * len(p.tensors), p.algorithm)
    if text is not None:
        meta[manifest.KEY_MEMORY_FORMATS] = text
    return container.build(p.layout, meta) + buf.getvalue()[len(old):]


def test_a_canonical_record_is_applied():
    back = tensorcanon.loads(_with_formats("0:channels_last,1:channels_last_3d"))
    assert back["a"].is_contiguous(memory_format=torch.channels_last)
    assert back["b"].is_contiguous(memory_format=torch.channels_last_3d)


@pytest.mark.parametrize("text, match", [
    ("", "is empty"),
    ("0:channels_first", "malformed entry"),
    ("0:channels_last_3d", "cannot be channels_last_3d"),
    ("1:channels_last", "cannot be channels_last"),
    ("2:channels_last", "numpy array"),
    ("3:channels_last", "malformed entry"),
    ("00:channels_last", "not in canonical form"),
    ("1:channels_last_3d,0:channels_last", "not in canonical form"),
    ("0:channels_last,0:channels_last", "not in canonical form"),
    ("0:channels_last,", "malformed entry"),
])
def test_malformed_records_are_rejected(text, match):
    with pytest.raises(tensorcanon.FormatError, match=match):
        tensorcanon.loads(_with_formats(text))


def test_a_shape_whose_layout_is_also_contiguous_is_rejected():
    data = _with_formats("0:channels_last", obj={"a": torch.zeros(2, 1, 3, 3)})
    with pytest.raises(tensorcanon.FormatError, match="cannot be channels_last without also being contiguous"):
        tensorcanon.loads(data)


def test_a_version_1_file_cannot_carry_the_record():
    with pytest.raises(tensorcanon.FormatError, match="format-2 key, in a version-1 file"):
        tensorcanon.loads(_with_formats("0:channels_last", version=1))
