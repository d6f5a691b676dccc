"""numpy's global generator set to PCG64: RngState and FORMAT.md §6.7 agree (issue 29).

``numpy.random.set_bit_generator(PCG64(...))`` (numpy >= 1.25) makes numpy's global RandomState
draw from a PCG64. RngState records that generator's state with a nil seed sequence, which the
spec once allowed only for a legacy-seeded MT19937. The rule now (one function,
rng.nil_seed_seq_problem, for the writer and both readers): inside ``rng.state`` the seed sequence
is always nil, whatever the bit generator; elsewhere nil only for MT19937.
"""

from __future__ import annotations

import numpy as np
import pytest

import tensorcanon
from tensorcanon.training import rng

from hostile_lib import with_manifest


def _global_pcg64_state() -> tuple[tensorcanon.RngState, np.ndarray | None]:
    """RngState.capture() with numpy's global generator a PCG64, made the public way when numpy
    has it; numpy 1.24 (the floor) has no set_bit_generator, so the same value is built there."""
    if hasattr(np.random, "set_bit_generator"):
        old = np.random.get_bit_generator()
        np.random.set_bit_generator(np.random.PCG64(1234))
        try:
            np.random.random(3)  # draw, so the state is not just the seeded one
            state = tensorcanon.RngState.capture()
            expected = np.random.random(5)
        finally:
            np.random.set_bit_generator(old)
        return state, expected
    pcg = np.random.PCG64(1234)
    name, fields = rng.bitgen_fields(pcg.state)
    base = tensorcanon.RngState.capture()
    return tensorcanon.RngState(python=base.python, numpy=(name, fields, 0, 0.0), torch_cpu=base.torch_cpu), None


def test_rngstate_with_a_global_pcg64_saves_verifies_loads_and_restores():
    state, expected = _global_pcg64_state()
    assert state.numpy[0] == "PCG64"
    data = tensorcanon.dumps({"rng": state})
    assert tensorcanon.verify(data)
    back = tensorcanon.loads(data)["rng"]
    assert back == state
    if expected is not None:
        old = np.random.get_bit_generator()
        np.random.set_bit_generator(np.random.PCG64(0))
        try:
            back.restore()
            assert np.array_equal(np.random.random(5), expected)
        finally:
            np.random.set_bit_generator(old)


def test_a_seed_sequence_inside_rngstate_is_rejected():
    state, _ = _global_pcg64_state()
    data = tensorcanon.dumps({"rng": state})

    def add_seed_seq(m):
        m["root"][2][2][3][2] = ["tuple", 5, ["tuple"], 4, 0]

    bad = with_manifest(data, add_seed_seq)
    for read in (tensorcanon.loads, tensorcanon.verify):
        with pytest.raises(tensorcanon.FormatError, match="must have a nil seed sequence"):
            read(bad)


def test_outside_rngstate_only_mt19937_may_have_a_nil_seed_sequence():
    assert rng.nil_seed_seq_problem("MT19937", None, global_state=False) is None
    assert "needs a seed sequence" in rng.nil_seed_seq_problem("PCG64", None, global_state=False)
    assert rng.nil_seed_seq_problem("PCG64", None, global_state=True) is None
    data = tensorcanon.dumps({"g": np.random.Generator(np.random.PCG64(3))})

    def drop_seed_seq(m):
        m["root"][2][1][2] = None

    bad = with_manifest(data, drop_seed_seq)
    for read in (tensorcanon.loads, tensorcanon.verify):
        with pytest.raises(tensorcanon.FormatError, match="needs a seed sequence"):
            read(bad)
