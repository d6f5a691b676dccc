"""Saving to file objects that behave like real, imperfect targets."""

from __future__ import annotations

import io

import pytest
import torch

import tensorcanon


class _Trickle(io.RawIOBase):
    """A seekable raw file that takes at most ``step`` bytes per write, as write(2) may."""

    def __init__(self, step: int) -> None:
        self.buf, self.pos, self.step = bytearray(), 0, step

    def writable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self.pos

    def seek(self, pos, whence=io.SEEK_SET):
        self.pos = pos if whence == io.SEEK_SET else len(self.buf) + pos
        return self.pos

    def write(self, b):
        chunk = bytes(memoryview(b).cast("B")[: self.step])
        self.buf[self.pos : self.pos + len(chunk)] = chunk
        self.pos += len(chunk)
        return len(chunk)


class _Stuck(_Trickle):
    def write(self, b):
        return 0


OBJ = {"big": torch.arange(3 << 20, dtype=torch.float32), "small": torch.ones(3), "n": 7}


@pytest.mark.parametrize("step", [1000, 1 << 20])
def test_short_writes_are_completed(step):
    # A 12 MiB tensor is written in 1 MiB pieces; each short write must be completed.
    f = _Trickle(step)
    digest = tensorcanon.save(OBJ, f)
    assert bytes(f.buf) == tensorcanon.dumps(OBJ)
    assert tensorcanon.verify(io.BytesIO(bytes(f.buf))) == digest


def test_a_target_that_accepts_nothing_is_an_error():
    with pytest.raises(tensorcanon.TensorCanonError, match="accepted 0 of the last"):
        tensorcanon.save({"t": torch.ones(4)}, _Stuck(1))


def test_tensor_in_metadata_is_named_by_its_path():
    with pytest.raises(tensorcanon.UnsupportedTypeError, match=r'found one at metadata \$\["a"\]\[0\]'):
        tensorcanon.dumps({}, metadata={"a": [torch.ones(1)]})


@pytest.mark.parametrize("how", ["mode", "flag"])
def test_a_file_opened_for_appending_gets_the_file_after_what_it_holds(tmp_path, how):
    # Every write to such a file lands at its end, so the header cannot be written back over a
    # placeholder: the save must write it first (two passes, as for a pipe).
    import os

    p = tmp_path / "appended.bin"
    p.write_bytes(b"prefix")
    if how == "mode":
        f = open(p, "ab")
    else:  # O_APPEND set below Python: the file object's mode says "wb"
        f = os.fdopen(os.open(p, os.O_WRONLY | os.O_APPEND), "wb")
    with f:
        digest = tensorcanon.save(OBJ, f)
    data = p.read_bytes()
    assert data == b"prefix" + tensorcanon.dumps(OBJ)
    assert tensorcanon.verify(io.BytesIO(data[len(b"prefix"):])) == digest

