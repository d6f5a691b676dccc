"""Saving and loading leave Python's garbage collector alone (issue 12).

The collector's state is process-wide: a library that switched it off during
a save would switch it off for every other thread too. tensorcanon instead
keeps the objects it allocates per tensor few (tables packed to bytes, rows
sharing shape tuples, small tensors read and written in runs), and
benchmarks/RESULTS.md reports what the collector costs.
"""

from __future__ import annotations

import dataclasses
import gc
import threading

import pytest
import torch

import tensorcanon


@dataclasses.dataclass
class _Probe:
    """Records whether the collector was enabled while it was being encoded or decoded."""

    seen: list


@pytest.fixture
def probe():
    seen: list = []

    def encode(p):
        seen.append(gc.isenabled())
        return {}

    def decode(state):
        seen.append(gc.isenabled())
        return _Probe(seen)

    tensorcanon.register(_Probe, encode=encode, decode=decode, name="tests.GcProbe")
    yield _Probe(seen)
    tensorcanon.unregister(_Probe)


def test_collector_stays_enabled_during_save_and_load(probe, tmp_path):
    assert gc.isenabled()
    obj = {"p": probe, "t": torch.ones(2)}
    tensorcanon.save(obj, tmp_path / "x.st")
    tensorcanon.load(tmp_path / "x.st")
    tensorcanon.load(tmp_path / "x.st", mmap=True)
    tensorcanon.loads(tensorcanon.dumps(obj))
    assert probe.seen == [True] * 5  # save, load, load(mmap=True), dumps, loads
    assert gc.isenabled()


def test_a_collector_the_program_disabled_stays_disabled(probe):
    gc.disable()
    try:
        tensorcanon.loads(tensorcanon.dumps({"p": probe}))
        assert not gc.isenabled()
        assert probe.seen == [False, False]
    finally:
        gc.enable()


def test_another_thread_never_sees_the_collector_switched_off(tmp_path):
    obj = {f"t{i:04d}": torch.full((16,), float(i)) for i in range(3000)}
    watching, stop = threading.Event(), threading.Event()
    seen: list[bool] = []

    def watch():
        seen.append(gc.isenabled())
        watching.set()
        while not stop.is_set():
            seen.append(gc.isenabled())

    t = threading.Thread(target=watch)
    t.start()
    watching.wait()  # the watcher has looked at least once before the first save (how often after is up to timing)
    try:
        for _ in range(3):
            tensorcanon.save(obj, tmp_path / "x.st")
            tensorcanon.load(tmp_path / "x.st")
    finally:
        stop.set()
        t.join(10)
    assert seen and all(seen)
