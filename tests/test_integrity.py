"""Every single-bit flip is detected (issue 6, part 2).

Exhaustively for a tiny file (every bit of it, header and padding included,
since the header must be canonical), and at random positions in the tensor data
and the manifest of a larger one. Both ``load(verify=True)`` and ``verify``
must raise a tensorcanon error; nothing may load a value that differs.
"""

from __future__ import annotations

import base64
import random
import struct

import pytest
import torch

import tensorcanon
from tensorcanon.format import errors


def _flip(data: bytes, bit: int) -> bytes:
    b = bytearray(data)
    b[bit // 8] ^= 1 << (bit % 8)
    return bytes(b)


def _detected(data: bytes) -> None:
    # damage is malformed bytes (FormatError, LimitError) or bytes that do not hash to their
    # digest (IntegrityError): nothing else
    with pytest.raises((errors.FormatError, errors.IntegrityError)):
        tensorcanon.loads(data, verify=True)
    with pytest.raises((errors.FormatError, errors.IntegrityError)):
        tensorcanon.verify(data)


def test_every_bit_of_a_tiny_file():
    data = tensorcanon.dumps({"a": torch.tensor([1.0, -2.0]), "n": 3})
    assert len(data) < 600
    for bit in range(len(data) * 8):
        _detected(_flip(data, bit))


def test_padding_flips_are_rejected():
    data = tensorcanon.dumps({"a": torch.tensor([1.0])})
    (n,) = struct.unpack("<Q", data[:8])
    text = data[8 : 8 + n]
    pad = len(text) - len(text.rstrip(b" "))
    if pad == 0:  # make sure there is padding to attack
        data = tensorcanon.dumps({"ab": torch.tensor([1.0])})
        (n,) = struct.unpack("<Q", data[:8])
        pad = n - len(data[8 : 8 + n].rstrip(b" "))
    assert pad > 0
    for pos in range(8 + n - pad, 8 + n):
        for bit in range(8):
            _detected(_flip(data, pos * 8 + bit))
        # and the other whitespace JSON allows
        for ws in b"\t\n\r":
            b = bytearray(data)
            b[pos] = ws
            _detected(bytes(b))


def _regions(data: bytes):
    """(start, end) of the data section and of the manifest's base64 text."""
    (n,) = struct.unpack("<Q", data[:8])
    start = data.index(b'"tensorcanon.manifest":"') + len(b'"tensorcanon.manifest":"')
    end = data.index(b'"', start)
    return (8 + n, len(data)), (start, end)


def _big():
    g = torch.Generator().manual_seed(1)
    return {
        "model": {f"layer{i}.weight": torch.randn(16, 16, generator=g) for i in range(4)},
        "emb": torch.randint(0, 100, (64,), generator=g),
        "mask": torch.rand(50, generator=g) > 0.5,
        "half": torch.randn(33, generator=g).half(),
        "step": 100, "cfg": {"lr": 1e-3, "name": "x"},
    }


def test_random_flips_in_tensor_data_and_manifest():
    data = tensorcanon.dumps(_big())
    (d0, d1), (m0, m1) = _regions(data)
    rng = random.Random(6)
    for _ in range(400):
        _detected(_flip(data, rng.randrange(d0 * 8, d1 * 8)))
    raw = base64.b64decode(data[m0:m1])
    for _ in range(300):
        bit = rng.randrange(len(raw) * 8)
        bad = bytearray(raw)
        bad[bit // 8] ^= 1 << (bit % 8)
        text = base64.b64encode(bytes(bad))
        _detected(data[:m0] + text + data[m1:])


def test_flip_names_the_damaged_tensor():
    data = tensorcanon.dumps(_big())
    (d0, d1), _ = _regions(data)
    with pytest.raises(errors.IntegrityError) as info:
        tensorcanon.verify(_flip(data, (d1 - 1) * 8))
    assert info.value.path == '$["mask"]'  # the 1-byte bool tensor is stored last
    assert "does not match its digest" in str(info.value)


def test_unverified_load_still_checks_the_manifest(tmp_path):
    """verify=False skips tensor hashing only: the manifest and header are still checked."""
    data = tensorcanon.dumps(_big())
    _, (m0, m1) = _regions(data)
    raw = bytearray(base64.b64decode(data[m0:m1]))
    raw[len(raw) // 2] ^= 1
    bad = data[:m0] + base64.b64encode(bytes(raw)) + data[m1:]
    with pytest.raises((errors.FormatError, errors.IntegrityError)):
        tensorcanon.loads(bad, verify=False)
