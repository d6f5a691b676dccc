"""Concurrent saves and reads of one path (issue 6, part 4).

Processes (forked, so they start at once) save different objects to the same
path at the same time; a reader loops over loads meanwhile. Every read must see
a complete file holding exactly one of the versions, and the end state is one
valid file.
"""

from __future__ import annotations

import multiprocessing
import os

import numpy as np
import pytest

import tensorcanon
from tensorcanon.io import writer

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
N = 2 << 20  # float32 elements: 8 MB per file


def version(k: int) -> dict:
    return {"w": np.full(N, k, dtype=np.float32), "k": k}


def _save_many(path: str, k: int, rounds: int, go) -> None:
    go.wait(30)
    for _ in range(rounds):
        tensorcanon.save(version(k), path)


def test_two_writers_end_with_one_valid_file(tmp_path):
    ctx = multiprocessing.get_context("fork")
    path = str(tmp_path / "same.safetensors")
    digests = {tensorcanon.fingerprint(version(k)): k for k in (1, 2)}
    go = ctx.Event()
    procs = [ctx.Process(target=_save_many, args=(path, k, 10, go)) for k in (1, 2)]
    for p in procs:
        p.start()
    go.set()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    got = tensorcanon.verify(path)
    assert got in digests
    loaded = tensorcanon.load(path)
    assert loaded["k"] == digests[got] and bool((loaded["w"] == loaded["k"]).all())
    assert [n for n in os.listdir(tmp_path) if n.endswith(writer.TEMP_SUFFIX)] == []


def test_reader_sees_old_or_new_never_a_mix(tmp_path):
    ctx = multiprocessing.get_context("fork")
    path = str(tmp_path / "rw.safetensors")
    tensorcanon.save(version(0), path)
    go = ctx.Event()
    writers = [ctx.Process(target=_save_many, args=(path, k, 15, go)) for k in (1, 2)]
    for p in writers:
        p.start()
    go.set()
    reads, kinds = 0, set()
    while any(p.is_alive() for p in writers) or reads < 5:
        value = tensorcanon.load(path)  # verify=True: any mix of two files fails its digests
        k = value["k"]
        assert k in (0, 1, 2)
        w = value["w"]
        assert w.shape == (N,) and bool((w == k).all()), "a read mixed bytes from two saves"
        kinds.add(k)
        reads += 1
    for p in writers:
        p.join(120)
        assert p.exitcode == 0
    assert reads >= 5
    assert tensorcanon.load(path)["k"] in (1, 2)
