"""Crash safety of save(path): SIGKILL at random points (issue 6, part 3).

A forked child saves ~64 MB objects to one path in a loop and is killed with
SIGKILL after a random delay. After every kill the file at the path must be a
complete, valid file holding one of the versions saved (never a partial one),
and the temp files the dead child left behind are removed by the next save.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time

import numpy as np
import pytest

import tensorcanon
from tensorcanon.io import writer

N = 16 << 20  # float32 elements: 64 MB
TRIALS = int(os.environ.get("TENSORCANON_CRASH_TRIALS", "20"))


def version(k: int) -> dict:
    return {"w": np.full(N, k, dtype=np.float32), "k": k}


def _saver(path: str, ready) -> None:
    k = 1
    while True:
        tensorcanon.save(version(k), path)
        ready.set()
        k = 3 - k  # alternate between versions 1 and 2


def _temps(folder) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.endswith(writer.TEMP_SUFFIX))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_sigkill_during_save_never_leaves_a_partial_file(tmp_path):
    ctx = multiprocessing.get_context("fork")
    path = str(tmp_path / "ckpt.safetensors")
    digests = {k: tensorcanon.fingerprint(version(k)) for k in (0, 1, 2)}
    tensorcanon.save(version(0), path)
    rng = random.Random(3)
    seen = set()
    left_temps = 0
    for trial in range(TRIALS):
        ready = ctx.Event()
        child = ctx.Process(target=_saver, args=(path, ready))
        child.start()
        if trial % 2:
            ready.wait(30)  # half the trials: kill after at least one save completed
        time.sleep(rng.uniform(0.0, 0.4))
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        assert child.exitcode == -signal.SIGKILL
        got = tensorcanon.verify(path)
        assert got in digests.values(), f"trial {trial}: the file at the path is not a saved version"
        loaded = tensorcanon.load(path)
        assert got == digests[loaded["k"]]
        seen.add(loaded["k"])
        left_temps += len(_temps(tmp_path))
    assert len(seen) >= 2, "the kills never landed between saves; the test did not exercise much"
    assert left_temps > 0, "no kill landed inside a save; the test did not exercise much"
    print(f"versions seen {sorted(seen)}, kills inside a save {left_temps}/{TRIALS}")
    # the next save removes every temp file whose process is dead
    tensorcanon.save(version(0), path)
    assert _temps(tmp_path) == []
    assert tensorcanon.verify(path) == digests[0]


def test_stale_temp_of_a_dead_process_is_removed_but_live_ones_kept(tmp_path):
    path = tmp_path / "m.safetensors"
    ctx = multiprocessing.get_context("fork")
    dead = ctx.Process(target=os._exit, args=(0,))
    dead.start()
    dead.join()
    stale = tmp_path / f".m.safetensors.{dead.pid}.abcd1234{writer.TEMP_SUFFIX}"
    live = tmp_path / f".m.safetensors.{os.getpid()}.abcd1234{writer.TEMP_SUFFIX}"
    other = tmp_path / f".m.safetensors.x.{dead.pid}.abcd1234{writer.TEMP_SUFFIX}"  # another path's temp
    unrelated = tmp_path / f".n.safetensors.{dead.pid}.abcd1234{writer.TEMP_SUFFIX}"
    for p in (stale, live, other, unrelated):
        p.write_bytes(b"partial")
    tensorcanon.save({"a": 1}, path)
    assert not stale.exists()
    assert live.exists() and other.exists() and unrelated.exists()
    assert tensorcanon.load(path) == {"a": 1}


def test_temp_name_embeds_the_pid(tmp_path, monkeypatch):
    seen = []
    real = writer.write

    def spy(p, f):
        seen.append(os.path.basename(f.name if isinstance(f.name, str) else ""))
        seen.extend(_temps(tmp_path))
        return real(p, f)

    monkeypatch.setattr(writer, "write", spy)
    tensorcanon.save({"a": 1}, tmp_path / "x.safetensors")
    temps = [n for n in seen if n.endswith(writer.TEMP_SUFFIX)]
    assert temps and all(n.startswith(f".x.safetensors.{os.getpid()}.") for n in temps)
    assert _temps(tmp_path) == []
