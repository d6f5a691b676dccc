"""The committed corpus of hostile files (tests/attacks/) and memory bounds (issue 6).

Each attack must raise the recorded exception class with the recorded message
fragment, from bytes, from a path and from a non-seekable stream; and a file
claiming a terabyte must fail without allocating it, which is checked in a
subprocess whose address space is capped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import tensorcanon
from tensorcanon.format import errors

HERE = os.path.dirname(os.path.abspath(__file__))
ATTACKS = os.path.join(HERE, "attacks")

import hostile_lib as h

EXPECTED = json.load(open(os.path.join(ATTACKS, "expected.json")))


def test_corpus_is_not_empty():
    assert len(EXPECTED) >= 30
    for name in EXPECTED:
        assert os.path.exists(os.path.join(ATTACKS, f"{name}.bin")), name


@pytest.mark.parametrize("name", sorted(EXPECTED))
@pytest.mark.parametrize("how", ["bytes", "path", "stream", "mmap", "lazy"])
def test_attack_raises_what_it_should(name, how):
    """Every way to read a file refuses it alike: load (from bytes, a path, a stream,
    memory-mapped) and tensorcanon.open (lookups by name first, then every path)."""
    want = EXPECTED[name]
    path = os.path.join(ATTACKS, f"{name}.bin")
    data = open(path, "rb").read()
    src = {"bytes": data, "path": path, "stream": h.Stream(data)}.get(how)
    if how == "stream" and name == "trailing_bytes":
        # a stream is read up to the end of the file and stops there: what follows is the
        # caller's (see test_trailing_bytes_on_a_stream_are_left_unread)
        assert h.same(tensorcanon.load(src), tensorcanon.load(data[:-1]))
        return
    with h.deadline():
        with pytest.raises(errors.TensorCanonError) as info:
            if how == "mmap":
                tensorcanon.load(path, mmap=True)
            elif how == "lazy":
                h.lazy_read_all(path, h.header_names(data))
            else:
                tensorcanon.load(src)
    if how == "stream" and name.startswith(("truncated", "tensor_1tb")):
        # a stream has no size to check up front: it fails where the bytes run out
        assert type(info.value) is errors.FormatError, str(info.value)
        assert "file ends inside" in str(info.value) or "declares shape" in str(info.value)
        return
    if how == "lazy":
        want = LAZY_ORDER.get(name, want)
    assert type(info.value).__name__ == want["raises"], str(info.value)
    assert want["message"] in str(info.value)


# tensorcanon.open walks the object tree (it needs the paths) before it reads tensor data,
# where load reads the data first and decodes the tree last: a file wrong in both ways is
# refused by the check each makes first.
# It also never builds objects (it returns tensors), so a registered type's name in the tree is
# never looked up: the tree's own defects are what it refuses.
LAZY_ORDER = {
    "manifest_deep_tree_damaged_data": {"raises": "LimitError", "message": "nested deeper than max_depth"},
    "manifest_obj_os_system": {"raises": "FormatError", "message": "never used in the object"},
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_attack_through_every_read_path(name):
    data = open(os.path.join(ATTACKS, f"{name}.bin"), "rb").read()
    assert h.check(data) != "ok"


def test_trailing_bytes_on_a_stream_are_left_unread():
    name = "trailing_bytes"
    data = open(os.path.join(ATTACKS, f"{name}.bin"), "rb").read()
    s = h.Stream(data)
    tensorcanon.load(s)
    assert s._pos == len(data) - 1


def test_lying_stream_header_allocates_by_bytes_received():
    """A non-seekable stream claiming a 1 TB tensor but sending 40 MB fails cleanly.

    The reader cannot check the claim against a file size, so it must not
    allocate the declared size before the bytes arrive.
    """
    TB = 1 << 40
    header = {"big": {"dtype": "U8", "shape": [TB], "data_offsets": [0, TB]}}
    data = h.with_header(header, b"\1" * (40 << 20))
    with pytest.raises(errors.FormatError, match="file ends inside the data of tensor 'big'"):
        tensorcanon.load(h.Stream(data))


def test_lying_stream_header_with_manifest():
    """The same lie inside a tensorcanon file whose manifest and digest agree with it."""
    import msgpack

    t = torch.zeros(4, dtype=torch.uint8)
    valid = tensorcanon.dumps({"t": t})
    m, header, body = h.manifest_of(valid)
    m["tensors"][0]["shape"] = [1 << 40]
    raw = msgpack.packb(m, use_bin_type=True)
    header["t"]["shape"] = [1 << 40]
    header["t"]["data_offsets"] = [0, 1 << 40]
    data = h.rebuild(valid, raw, header, b"\0" * (20 << 20))
    with pytest.raises(errors.FormatError, match="file ends inside the data"):
        tensorcanon.load(h.Stream(data))
    with pytest.raises(errors.FormatError, match="file ends inside the data"):
        tensorcanon.verify(h.Stream(data))


_MEMORY_CHILD = textwrap.dedent(
    """
    import resource, sys, os
    sys.path.insert(0, {fuzz!r})
    import torch, tensorcanon, hostile_lib as h
    from tensorcanon.format import errors
    TB = 1 << 40
    header = {{"big": {{"dtype": "U8", "shape": [TB], "data_offsets": [0, TB]}}}}
    files = {{
        "bytes": h.with_header(header, b"\\1" * 64),
        "stream": h.with_header(header, b"\\1" * (48 << 20)),
        "huge_header_len": (2**63).to_bytes(8, "little") + b"{{}}",
    }}
    # cap the address space at what is mapped now + 512 MB: a 1 TB allocation fails
    with open("/proc/self/status") as f:
        vm = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + (512 << 20), resource.RLIM_INFINITY))
    for name, data in files.items():
        for src in (data, h.Stream(data)):
            try:
                tensorcanon.load(src)
            except errors.TensorCanonError as e:
                print(name, type(e).__name__)
            except MemoryError:
                print(name, "MemoryError")
            try:
                tensorcanon.verify(src if isinstance(src, bytes) else h.Stream(data))
            except errors.TensorCanonError as e:
                print(name, "verify", type(e).__name__)
            except MemoryError:
                print(name, "verify", "MemoryError")
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs RLIMIT_AS and /proc")
def test_claimed_terabyte_never_allocates():
    code = _MEMORY_CHILD.format(fuzz=os.path.join(HERE, "fuzz"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.split("\n")
    assert "MemoryError" not in out.stdout, out.stdout
    assert len([line for line in lines if line.strip()]) == 12, out.stdout
    assert all(line.split()[-1] in ("FormatError", "LimitError") for line in lines if line.strip()), out.stdout
