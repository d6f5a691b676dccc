"""fastparse against the full parse (issue 20): the one-pass check of a canonical header is a private
fast path of the reader, so wherever it gives a verdict it must be the full parse's.

For every golden file, every file of the attack and conformance corpora and headers mutated at
random: when fastparse accepts, the full parse (container.parse_raw, then manifest.parse) accepts
with the same header and manifest; when fastparse raises, the full parse raises the same class;
when it declines (None), the full parse decides, which is how the reader uses it.
"""

from __future__ import annotations

import pathlib
import struct

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from tensorcanon.format import container, fastparse, manifest
from tensorcanon.format.errors import TensorCanonError
from tensorcanon.format.limits import DEFAULT

ROOT = pathlib.Path(__file__).parent
FILES = sorted([*ROOT.glob("golden/*.safetensors"), *ROOT.glob("golden/v1/*.safetensors"),
                *ROOT.glob("attacks/*.bin"), *ROOT.glob("conformance/*/*.safetensors"),
                *ROOT.glob("conformance/*/*.bin")])
GOLDEN = [p.read_bytes() for p in sorted(ROOT.glob("golden/*.safetensors"))]


def _outcome(call):
    try:
        return call()
    except TensorCanonError as e:
        return e


def _rows(m: manifest.Manifest) -> list:
    return [(r.index, r.name, r.dtype.name, r.shape, r.kind, r.requires_grad, r.digest, r.device, r.begin, r.end,
             r.memory_format) for r in m.tensors]


def _agree(data: bytes) -> str:
    """Compare the two parses of ``data``; return what fastparse did."""
    pos = 0

    def read(n: int, what: str) -> bytes:
        nonlocal pos
        out = data[pos:pos + n]
        if len(out) < n:
            raise container.FormatError(f"truncated {what}")
        pos += n
        return out

    raw = _outcome(lambda: container.read_raw(read, len(data), DEFAULT))
    if isinstance(raw, TensorCanonError):
        return "no header"  # both paths start from read_raw: nothing to compare
    prefix, header_bytes = raw
    fast = _outcome(lambda: fastparse.parse(prefix, header_bytes, len(data), DEFAULT))

    def full():
        header = container.parse_raw(prefix, header_bytes, len(data), DEFAULT)
        return header, (manifest.parse(header, DEFAULT) if manifest.is_tensorcanon(header) else None)

    if fast is None:
        return "declined"
    slow = _outcome(full)
    if isinstance(fast, TensorCanonError):
        assert isinstance(slow, TensorCanonError), f"fastparse raised {fast!r}, the full parse accepted"
        assert type(slow) is type(fast), (fast, slow)
        return "raised"
    assert not isinstance(slow, TensorCanonError), f"fastparse accepted, the full parse raised {slow!r}"
    (fh, fm), (sh, sm) = fast, slow
    assert sm is not None
    assert (fh.length, fh.data_size, fh.metadata, fh.raw) == (sh.length, sh.data_size, sh.metadata, sh.raw)
    assert fh.entries == sh.entries
    # (the trees are decoded from these same manifest bytes; NaN keys and deep trees make == useless on them)
    assert (fm.raw, fm.digest, fm.algorithm, fm.version) == (sm.raw, sm.digest, sm.algorithm, sm.version)
    assert _rows(fm) == _rows(sm)
    return "accepted"


def test_the_corpora_exist():
    assert len(FILES) > 100


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_fastparse_agrees_with_the_full_parse_on_every_committed_file(path):
    outcome = _agree(path.read_bytes())
    if path.parent.name == "golden" or path.parent.name == "valid":
        assert outcome == "accepted", outcome  # the fast path is taken for every canonical file


@settings(max_examples=300, derandomize=True, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(st.integers(0, len(GOLDEN) - 1), st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)),
                                                 min_size=1, max_size=3))
def test_fastparse_agrees_with_the_full_parse_on_mutated_headers(i, edits):
    data = bytearray(GOLDEN[i])
    (n,) = struct.unpack("<Q", data[:8])
    for pos, value in edits:
        data[8 + pos % n] = value  # inside the header only: the data section is not parsed here
    _agree(bytes(data))
