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


def test_a_large_save_reserves_exactly_the_bytes_it_then_writes(tmp_path, monkeypatch):
    # The blocks asked for (preallocate.py) are those the file then holds, from where the file
    # object stood; the bytes are those of dumps().
    from tensorcanon.io import preallocate

    asked = []
    real = preallocate.reserve
    monkeypatch.setattr(preallocate, "reserve",
                        lambda f, offset, n: asked.append((offset, n)) or real(f, offset, n))
    p = tmp_path / "x.bin"
    with open(p, "wb") as f:
        f.write(b"abc")
        tensorcanon.save(OBJ, f)
    data = p.read_bytes()
    assert asked == [(3, len(data) - 3)]
    assert data[3:] == tensorcanon.dumps(OBJ)


def test_reserving_blocks_keeps_the_file_size_and_declines_what_it_cannot_reserve(tmp_path):
    import os
    import sys

    from tensorcanon.io import preallocate

    p = tmp_path / "r.bin"
    with open(p, "wb") as f:
        f.write(b"12345")
        f.flush()
        done = preallocate.reserve(f, 5, 8 << 20)
        assert os.fstat(f.fileno()).st_size == 5
        if done:  # the file system reserved them: they are counted against the file
            assert os.fstat(f.fileno()).st_blocks * 512 >= 8 << 20
        assert not preallocate.reserve(f, 5, preallocate.MIN_BYTES - 1)  # too small to pay
    assert p.read_bytes() == b"12345"
    assert not preallocate.reserve(io.BytesIO(), 0, 8 << 20)  # no file descriptor
    if sys.platform.startswith("linux") and _fs_type(tmp_path) in ("ext4", "xfs", "btrfs"):
        assert done, f"{_fs_type(tmp_path)} reserves blocks, but the call did not"


def test_memory_backed_files_are_not_reserved(tmp_path):
    # On tmpfs the reservation only moves page allocation ahead of the writes (slower, measured).
    import os

    from tensorcanon.io import preallocate

    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        assert preallocate.memory_backed(fd) == (_fs_type(tmp_path) in ("tmpfs", "ramfs"))
    finally:
        os.close(fd)
    if _fs_type("/dev/shm") != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm")
    with open(f"/dev/shm/tensorcanon-test-{os.getpid()}", "wb") as f:
        try:
            assert preallocate.memory_backed(f.fileno())
            assert not preallocate.reserve(f, 0, 8 << 20)
        finally:
            os.unlink(f.name)


def _fs_type(path) -> str:
    try:
        with open("/proc/mounts") as fh:
            mounts = [line.split() for line in fh]
    except OSError:
        return ""
    path = str(path).rstrip("/") + "/"
    best = max((m for m in mounts if path.startswith(m[1].rstrip("/") + "/")), key=lambda m: len(m[1]),
               default=None)
    return best[2] if best else ""
