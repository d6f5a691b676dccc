"""Blobs of the integer delta codecs (docs/STORE.md, "Blobs": delta-sub, delta-twos) that break
their rules are refused before anything is decoded: an element size they do not take, a depth of
0, a missing base digest."""

import pytest

import tensorcanon as tc
from tensorcanon.store import layout


@pytest.mark.parametrize("codec", [layout.DELTA_SUB, layout.DELTA_TWOS])
def test_an_integer_delta_of_16_byte_elements_is_refused(codec):
    head = layout.header_bytes(codec, 1, b"complex128[4]", 64, b"\0" * 16, [(layout.STORED, 4)] * 16)
    blob = head + bytes(64)
    with pytest.raises(tc.FormatError, match=f"{layout.CODECS[codec]} blob of complex128"):
        layout.parse_header(blob[: layout.HEAD], len(blob), "t")


@pytest.mark.parametrize("codec", [layout.DELTA_SUB, layout.DELTA_TWOS])
def test_an_integer_delta_of_depth_0_or_without_a_base_is_refused(codec):
    planes = [(layout.STORED, 4)] * 4
    blob = layout.header_bytes(codec, 0, b"float32[4]", 16, None, planes) + bytes(16)
    with pytest.raises(tc.FormatError, match="depth 0"):
        layout.parse_header(blob[: layout.HEAD], len(blob), "t")
    ok = layout.header_bytes(codec, 1, b"float32[4]", 16, b"\1" * 16, planes) + bytes(16)
    h = layout.parse_header(ok[: layout.HEAD], len(ok), "t")
    assert h.base == b"\1" * 16 and h.depth == 1 and h.codec == codec
