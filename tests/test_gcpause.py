"""Saving and loading pause the cyclic garbage collector, and always restore it."""

from __future__ import annotations

import dataclasses
import gc
import threading

import pytest
import torch

import tensorcanon
from tensorcanon import gcpause


@dataclasses.dataclass
class _Probe:
    """Records whether the collector was enabled while it was being encoded."""

    seen: list


def _encode(p: _Probe):
    p.seen.append(gc.isenabled())
    return {}


@pytest.fixture
def probe():
    tensorcanon.register(_Probe, encode=_encode, decode=lambda s: s, name="tests.Probe")
    yield _Probe([])
    tensorcanon.unregister(_Probe)


def test_collector_is_paused_during_a_save_and_enabled_after(probe):
    assert gc.isenabled()
    tensorcanon.dumps({"p": probe, "t": torch.ones(2)})
    assert probe.seen == [False]
    assert gc.isenabled()


def test_collector_is_restored_after_an_error():
    with pytest.raises(tensorcanon.UnsupportedTypeError):
        tensorcanon.dumps({"x": object()})
    assert gc.isenabled()
    with pytest.raises(tensorcanon.FormatError):
        tensorcanon.loads(b"not a file at all")
    assert gc.isenabled()


def test_a_collector_the_program_disabled_stays_disabled(probe):
    gc.disable()
    try:
        tensorcanon.loads(tensorcanon.dumps({"p": probe}))
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_concurrent_saves_reenable_only_when_the_last_one_returns():
    inside, release = threading.Event(), threading.Event()

    @gcpause.paused
    def slow():
        inside.set()
        release.wait(10)

    t = threading.Thread(target=slow)
    t.start()
    assert inside.wait(10)
    tensorcanon.dumps({"t": torch.ones(3)})  # starts and ends while slow() is still paused
    assert not gc.isenabled()
    release.set()
    t.join(10)
    assert gc.isenabled()
