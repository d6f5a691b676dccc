"""Many writers, a collector running beside them, and SIGKILL at any point (docs/STORE.md,
"Many writers, crashes, gc"). The process tests are slow (tests/conftest.py: their names); the
threaded ones check the collection protocol's two orders deterministically, in one process."""

import os
import subprocess
import sys
import threading
import time

import torch

import tensorcanon as tc
from tensorcanon.store import compress, layout

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = os.path.join(HERE, "store_child.py")
sys.path.insert(0, HERE)
import store_child


def env():
    return dict(os.environ)


def spawn(*args):
    return subprocess.Popen([sys.executable, CHILD, *map(str, args)], env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_two_writers_and_a_collector_lose_nothing_across_processes(tmp_path):
    root, stop = tmp_path / "s", tmp_path / "stop"
    n = 5
    writers = [spawn("writer", root, name, n) for name in ("a", "b")]
    gc = spawn("collector", root, stop)
    try:
        for w in writers:
            _, err = w.communicate(timeout=240)
            assert w.returncode == 0, err
    finally:
        stop.write_text("")
        _, err = gc.communicate(timeout=120)
    assert gc.returncode == 0, err
    store = tc.Store(root)
    expected = {f"{name}-{i:02d}": name for name in ("a", "b") for i in range(n)}
    assert store.tags() == sorted(expected)
    for tag, name in expected.items():
        assert store.verify(tag) == tc.fingerprint(store_child.state(name, int(tag.rsplit("-", 1)[1])))
    assert set(store.verify()) == set(expected)
    store.gc()
    assert set(store.verify()) == set(expected)


def test_sigkill_at_any_point_leaves_earlier_tags_whole_in_fresh_processes(tmp_path):
    root = tmp_path / "s"
    trials = 20
    proc = subprocess.run([sys.executable, CHILD, "killer", str(root), str(trials)], env=env(), capture_output=True,
                          text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr
    store = tc.Store(root)
    tags = store.tags()
    assert "baseline" in tags and "at-exit" in tags
    assert set(tags) <= {"baseline", "at-exit"} | {f"k{t:02d}" for t in range(trials)}
    for tag in tags:  # every listed tag is whole: loads, and is exactly what was saved
        trial = {"baseline": -1, "at-exit": trials}.get(tag) or int(tag[1:])
        assert tc.fingerprint(store.load(tag)) == tc.fingerprint(store_child.big(trial))
    assert set(store.verify()) == set(tags)
    leftovers = list((root / "tmp").iterdir()) + list((root / "pending").iterdir())
    found = store.gc()  # what the killed savers left: temp files and markers of dead processes
    assert not list((root / "tmp").iterdir()) and not list((root / "pending").iterdir())
    assert set(store.verify()) == set(tags)
    assert leftovers or found["deleted_blobs"] >= 0


# ------------------------------------------------------------------ the protocol, step by step (threads)

def _paused(monkeypatch, module, name):
    """Make ``module.name`` wait, the first time it is called, until the returned event is set."""
    entered, go = threading.Event(), threading.Event()
    real = getattr(module, name)
    first = [True]

    def wrapper(*a, **k):
        if first[0]:
            first[0] = False
            entered.set()
            assert go.wait(30)
        return real(*a, **k)

    monkeypatch.setattr(module, name, wrapper)
    return entered, go


def test_gc_waits_for_a_save_under_way(tmp_path, monkeypatch):
    root = tmp_path / "s"
    garbage = {"w": torch.randn(4096)}
    tc.Store(root).save("old", garbage)
    tc.Store(root).delete("old")  # its blob is garbage: the next save will reuse it
    entered, go = _paused(monkeypatch, compress, "encode")
    saved = {}
    saver = threading.Thread(target=lambda: saved.setdefault("d", tc.Store(root).save(
        "new", {"w": garbage["w"], "x": torch.randn(4096)})))
    saver.start()
    assert entered.wait(30)  # the save found the garbage blob present, and is writing its new tensor
    collector = threading.Thread(target=lambda: tc.Store(root).gc())
    collector.start()
    time.sleep(0.5)
    assert collector.is_alive()  # waiting for the save's pending marker
    go.set()
    saver.join(30)
    collector.join(30)
    assert not collector.is_alive() and not saver.is_alive()
    assert tc.Store(root).verify() == {"new": saved["d"]}  # the reused blob was kept


def test_a_save_waits_for_a_running_gc(tmp_path, monkeypatch):
    root = tmp_path / "s"
    garbage = {"w": torch.randn(4096)}
    tc.Store(root).save("old", garbage)
    tc.Store(root).delete("old")
    from tensorcanon.store import store as store_module

    entered, go = _paused(monkeypatch, store_module.Store, "_tags")  # gc: its marker is written, it lists tags
    collector = threading.Thread(target=lambda: tc.Store(root).gc())
    collector.start()
    assert entered.wait(30)
    saved = {}
    saver = threading.Thread(target=lambda: saved.setdefault("d", tc.Store(root).save("new", garbage)))
    saver.start()
    time.sleep(0.5)
    assert saver.is_alive() and not list((root / "pending").iterdir())  # stepped back, waiting
    go.set()
    collector.join(30)
    saver.join(30)
    assert not saver.is_alive()
    assert tc.Store(root).verify() == {"new": saved["d"]}  # written after the collection: whole


def test_markers_of_dead_processes_do_not_block(tmp_path):
    root = tmp_path / "s"
    store = tc.Store(root)
    store.save("a", {"x": torch.ones(3)})
    from tensorcanon.store import backend

    dead = 2**22 + 12345  # (beyond pid_max: no such process)
    (root / layout.GC / f"{backend.host()}.{dead}.0123456789abcdef").write_bytes(b"")
    (root / layout.PENDING / f"{backend.host()}.{dead}.0123456789abcdef").write_bytes(b"")
    store.save("b", {"x": torch.zeros(3)})  # a dead collection's marker: not waited for
    store.gc()  # a dead save's marker: not waited for, and removed
    assert not list((root / layout.PENDING).iterdir()) and not list((root / layout.GC).iterdir())
    assert set(store.verify()) == {"a", "b"}


def test_a_store_in_a_memory_url():
    url = "memory://tc-store-test/run1"
    store = tc.Store(url)
    states = [{"w": torch.randn(300, 300) + i, "i": i} for i in range(3)]
    for i, s in enumerate(states):
        assert store.save(f"t{i}", s) == tc.fingerprint(s)
    assert store.tags() == ["t0", "t1", "t2"]
    assert tc.fingerprint(store.load("t1")) == tc.fingerprint(states[1])
    assert set(store.verify()) == {"t0", "t1", "t2"}
    store.export("t2", "memory://tc-store-test/out.safetensors")
    assert tc.load("memory://tc-store-test/out.safetensors")["i"] == 2
    assert tc.verify("memory://tc-store-test/out.safetensors") == tc.fingerprint(states[2])
    assert tc.fingerprint(store.load("t1", mmap=True)) == tc.fingerprint(states[1])  # (decoded: nothing to map)
    store.delete("t0")
    store.gc()
    assert store.stats()["tags"] == 2
