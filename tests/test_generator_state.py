"""The torch generator state layout of docs/FORMAT.md §6.7.1, field by field.

States come from real torch generators; the broken ones are real states with one
field changed. torch's own set_state accepts some of them (it checks only the
ranges of ``left`` and ``next``), so the writer must refuse them and the reader
reject them.
"""

from __future__ import annotations

import struct

import pytest
import torch

import tensorcanon
from tensorcanon.training import rng

import hostile_lib as h


def _state(draws: int = 0, normal: bool = False, seed: int = 7) -> bytes:
    g = torch.Generator().manual_seed(seed)
    if draws:
        torch.randint(0, 10, (draws,), generator=g)
    if normal:
        torch.randn(1, generator=g, dtype=torch.float64)
    return bytes(g.get_state().numpy())


def _edit(state: bytes, fmt: str, offset: int, *values) -> bytes:
    out = bytearray(state)
    struct.pack_into(fmt, out, offset, *values)
    return bytes(out)


def test_the_layout_of_real_states():
    fresh = _state()
    seed, left, seeded, nxt = struct.unpack_from("<QiiQ", fresh, 0)
    assert (seed, left, seeded, nxt) == (7, 1, 1, 0)
    assert struct.unpack_from("<I", fresh, 24)[0] == 7  # MT word 0 is the seed's low 32 bits
    used = _state(draws=700)
    left, nxt = struct.unpack_from("<iQ", used, 8)[0], struct.unpack_from("<Q", used, 16)[0]
    assert 1 <= nxt <= 624 and left + nxt == 625
    cached = _state(normal=True)
    assert struct.unpack_from("<i", cached, 5040)[0] == 1 and struct.unpack_from("<d", cached, 5024)[0] != 0
    for s in (fresh, used, cached):
        assert rng.check_cpu_state(s) is None


BROKEN = {
    "seeded 0": lambda s: _edit(s, "<i", 12, 0),
    "left + next != 625": lambda s: _edit(s, "<iiQ", 8, 2, 1, 624),
    "left 0": lambda s: _edit(s, "<iiQ", 8, 0, 1, 0),
    "next past the words": lambda s: _edit(s, "<iiQ", 8, 1, 1, 625),
    "a 33-bit word": lambda s: _edit(s, "<Q", 24 + 8 * 5, 2**32),
    "normal_x set": lambda s: _edit(s, "<d", 5016, 1.0),
    "normal_rho set": lambda s: _edit(s, "<d", 5032, 1.0),
    "normal flag 2": lambda s: _edit(s, "<i", 5040, 2),
    "cached normal without flag": lambda s: _edit(s, "<d", 5024, 0.5),
    "padding after the normal flag": lambda s: _edit(s, "<B", 5045, 1),
    "float flag 2": lambda s: _edit(s, "<B", 5052, 2),
    "cached float without flag": lambda s: _edit(s, "<f", 5048, 0.5),
    "trailing padding": lambda s: _edit(s, "<B", 5055, 1),
    "short": lambda s: s[:-1],
}


@pytest.mark.parametrize("name", list(BROKEN))
def test_broken_cpu_states_are_refused_by_the_writer_and_the_reader(name):
    good = _state(draws=30)
    bad = BROKEN[name](good)
    assert rng.check_cpu_state(bad) is not None
    # the writer: a generator torch let us load with this state, if it does
    g = torch.Generator()
    try:
        g.set_state(torch.frombuffer(bytearray(bad), dtype=torch.uint8))
    except RuntimeError:
        pass  # torch refuses it too
    else:
        if bytes(g.get_state().numpy()) == bad:
            with pytest.raises(tensorcanon.UnsupportedTypeError, match="cpu generator state"):
                tensorcanon.dumps({"g": g})
    # the reader: a file whose rng.torch node and whose rng.state hold it
    data = tensorcanon.dumps({"g": torch.Generator().manual_seed(3), "s": tensorcanon.RngState.capture()})
    m, header, body = h.manifest_of(data)
    root = m["root"]
    assert root[1] == "g" and root[2][0] == "rng.torch" and root[4][0] == "rng.state"
    for edit in ("torch", "state"):
        m2 = h.manifest_of(data)[0]
        if edit == "torch":
            m2["root"][2][2] = bad
        else:
            m2["root"][4][3] = bad
        with pytest.raises(tensorcanon.FormatError, match="cpu generator state"):
            tensorcanon.loads(h.rebuild(data, h.repack(m2), header, body))


def test_the_left_next_invariant_keeps_torch_inside_its_word_array():
    """torch accepts left=2, next=624 and then reads word 624 of 624: such a state never
    reaches a file, and a file holding one is rejected before torch sees it."""
    bad = _edit(_state(draws=30), "<iiQ", 8, 2, 1, 624)
    g = torch.Generator()
    g.set_state(torch.frombuffer(bytearray(bad), dtype=torch.uint8))  # torch does not object
    with pytest.raises(tensorcanon.UnsupportedTypeError, match="left=2, next=624"):
        tensorcanon.dumps(g)


@pytest.mark.parametrize("offset, ok", [(0, True), (8, True), (2, False), (-4, True)])
def test_cuda_states_need_an_offset_that_is_a_multiple_of_4(offset, ok):
    state = struct.pack("<Qq", 1234, offset)
    assert (rng.check_torch_state("cuda", state) is None) == ok
    data = tensorcanon.dumps({"s": tensorcanon.RngState.capture()})
    m, header, body = h.manifest_of(data)
    m["root"][2][4] = ["list", state]  # the cuda part of rng.state
    rebuilt = h.rebuild(data, h.repack(m), header, body)
    if ok:
        assert tensorcanon.loads(rebuilt)["s"].cuda == (state,)
    else:
        with pytest.raises(tensorcanon.FormatError, match="multiple of 4"):
            tensorcanon.loads(rebuilt)
