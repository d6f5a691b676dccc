"""Crash safety of save(path): SIGKILL during a save (issue 6, part 3).

Two kinds of test. The deterministic one stops a forked child's save at a known
point (part way through writing the temp file; with the temp file complete and
fsynced, just before the rename), has the child say so through a pipe, and kills
it there: the path still holds what it held before (or nothing), the temp file the
dead child left holds what was written so far, and the next save removes it.

The random one kills a child that saves in a loop after a random delay. Where the
kill lands is up to the machine's timing, so it asserts only what holds wherever
it lands: the file at the path is absent (no save completed yet) or a complete,
verifying file of one of the saved versions; nothing else appears beside it but
the dead children's temp files, at most one each; the next save removes them.
"""

from __future__ import annotations

import collections
import multiprocessing
import os
import random
import signal
import threading
import time

import numpy as np
import pytest

import tensorcanon
from tensorcanon.io import writer

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")

N = 16 << 20  # float32 elements: 64 MB
TRIALS = int(os.environ.get("TENSORCANON_CRASH_TRIALS", "20"))
HANG_S = 120  # only a child that never reaches its stop point (a hang) waits this long


def version(k: int) -> dict:
    return {"w": np.full(N, k, dtype=np.float32), "k": k}


def _temps(folder) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.endswith(writer.TEMP_SUFFIX))


def _temp_pid(name: str, base: str) -> int:
    """The pid in a temp file name ``.<base>.<pid>.<random>.tensorcanon-tmp`` (writer.replace_atomically)."""
    prefix = f".{base}."
    assert name.startswith(prefix) and name.endswith(writer.TEMP_SUFFIX), name
    return int(name[len(prefix):].split(".", 1)[0])


# --- deterministic: a kill at a known point inside a save ---------------------------------------


def small(k: int) -> dict:
    """8 MB in two tensors: written a MiB at a time, so a save stopped after its first piece of
    data has written only part of the file."""
    return {"a": np.full(1 << 20, k, dtype=np.float32), "b": np.full(1 << 20, k, dtype=np.float32), "k": k}


def _save_stopping_at(point: str, path: str, k: int, conn) -> None:
    """In the child: save ``small(k)`` to ``path``, stopping at ``point``, where it tells the
    parent through ``conn`` and then waits to be killed (patches made here are the child's only).

    "writing": after the second write to the temp file (the header's placeholder, then the first
    piece of data), flushed so that those bytes are in the file. "renaming": at the rename of the
    complete, fsynced temp file over ``path``.
    """

    def stop() -> None:
        conn.send("stopped")
        threading.Event().wait()  # until SIGKILL

    if point == "writing":
        real_write_all, calls = writer._write_all, [0]

        def write_all(f, data):
            real_write_all(f, data)
            calls[0] += 1
            if calls[0] == 2:
                f.flush()
                stop()

        writer._write_all = write_all
    else:
        real_replace = os.replace

        def replace(src, dst, *args, **kwargs):
            if os.path.abspath(dst) == os.path.abspath(path):
                stop()
            return real_replace(src, dst, *args, **kwargs)

        writer.os.replace = replace  # writer calls os.replace: the rename
    tensorcanon.save(small(k), path)


@pytest.mark.parametrize("before", [None, 1], ids=["new-path", "over-a-file"])
@pytest.mark.parametrize("point", ["writing", "renaming"])
def test_sigkill_inside_a_save_leaves_the_previous_file_intact(tmp_path, point, before):
    ctx = multiprocessing.get_context("fork")
    path = str(tmp_path / "ckpt.safetensors")
    if before is not None:
        tensorcanon.save(small(before), path)
    old = (tmp_path / "ckpt.safetensors").read_bytes() if before is not None else None
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_save_stopping_at, args=(point, path, 2, send))
    child.start()
    send.close()  # the child holds the only sending end: if it exits without a word, recv() raises EOFError
    try:
        if not receive.poll(HANG_S):
            pytest.fail(f"the child's save did not reach {point!r} within {HANG_S} s")
        try:
            receive.recv()
        except EOFError:
            child.join(HANG_S)
            pytest.fail(f"the child's save ended without reaching {point!r} (exit code {child.exitcode}): "
                        "the writer no longer calls what the child patched to stop it there")
    finally:
        child.kill()  # SIGKILL, where it stopped (or nothing, if it has ended)
        child.join()
    assert child.exitcode == -signal.SIGKILL
    # the path holds exactly what it held before the save began
    if before is None:
        assert not os.path.exists(path)
    else:
        assert (tmp_path / "ckpt.safetensors").read_bytes() == old
        assert tensorcanon.verify(path) == tensorcanon.fingerprint(small(before))
    # beside it: the dead child's one temp file, holding what the save had written
    temps = _temps(tmp_path)
    assert len(temps) == 1 and _temp_pid(temps[0], "ckpt.safetensors") == child.pid, temps
    assert sorted(os.listdir(tmp_path)) == sorted(temps + ([] if before is None else ["ckpt.safetensors"]))
    temp = tmp_path / temps[0]
    full = tensorcanon.dumps(small(2))
    if point == "writing":
        assert 0 < temp.stat().st_size < len(full)
        with pytest.raises(tensorcanon.TensorCanonError):
            tensorcanon.verify(temp)  # incomplete: not a file
    else:
        assert temp.read_bytes() == full  # complete, only never renamed
    # the next save removes the dead process's temp file
    tensorcanon.save(small(3), path)
    assert _temps(tmp_path) == [] and os.listdir(tmp_path) == ["ckpt.safetensors"]
    assert tensorcanon.verify(path) == tensorcanon.fingerprint(small(3))


# --- random: kills wherever they land --------------------------------------------------------------


def _saver(path: str, ready) -> None:
    k = 1
    while True:
        tensorcanon.save(version(k), path)
        ready.set()
        k = 3 - k  # alternate between versions 1 and 2


def test_sigkill_during_save_never_leaves_a_partial_file(tmp_path):
    ctx = multiprocessing.get_context("fork")
    base = "ckpt.safetensors"
    path = str(tmp_path / base)
    digests = {k: tensorcanon.fingerprint(version(k)) for k in (0, 1, 2)}
    rng = random.Random(3)
    killed: set[int] = set()
    existed = False
    inside = 0  # kills that landed inside a save (reported, not asserted: that is up to timing)
    for trial in range(TRIALS):  # no file at the path before the first trial: "absent" is a state too
        ready = ctx.Event()
        child = ctx.Process(target=_saver, args=(path, ready))
        child.start()
        if trial % 2:
            ready.wait(30)  # half the trials: most often after a save completed (any moment is fine)
        time.sleep(rng.uniform(0.0, 0.4))  # when to kill; no outcome below depends on it
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        assert child.exitcode == -signal.SIGKILL
        killed.add(child.pid)
        # the path: absent only while no save has ever completed; otherwise a complete saved version
        if os.path.exists(path):
            got = tensorcanon.verify(path)
            assert got in (digests[1], digests[2]), f"trial {trial}: the file at the path is not a saved version"
            loaded = tensorcanon.load(path)
            assert got == digests[loaded["k"]]
            existed = True
        else:
            assert not existed, f"trial {trial}: the file at the path disappeared"
        # beside it: only temp files of killed children, at most one each (a save that ran to its
        # end renamed its temp file; one that failed would have removed it)
        others = [n for n in os.listdir(tmp_path) if n != base]
        pids = collections.Counter(_temp_pid(n, base) for n in others)
        assert set(pids) <= killed and all(c == 1 for c in pids.values()), others
        inside += child.pid in pids
    print(f"kills inside a save (left a temp file) {inside}/{TRIALS}; a file at the path after them: {existed}")
    # the next save removes every temp file whose process is dead
    tensorcanon.save(version(0), path)
    assert _temps(tmp_path) == [] and os.listdir(tmp_path) == [base]
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
