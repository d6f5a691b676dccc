"""Store.save_async: the tag it writes is the one save writes, of the object as it was when the call
returned, whatever the object becomes after; failures reach the future and the next save; the
object's other methods wait for it (docs/STORE.md, "In the background"). Across processes (SIGKILL
during a background save, exit with one under way): tests/store/test_store_processes.py."""

import os
import shutil
import signal
import time
from concurrent.futures import wait

import pytest
import torch

import tensorcanon as tc
from tensorcanon.format.errors import TensorCanonError


def _state(seed, n=6):
    g = torch.Generator().manual_seed(seed)
    return {"base": torch.randn(128, 128, generator=torch.Generator().manual_seed(0)),
            "w": [torch.randn(64, 96, generator=g) for _ in range(n)],
            "m": {"b": torch.randn(40_000, generator=g).to(torch.bfloat16), "i": torch.arange(9)},
            "step": seed, "name": "run"}


def _clone(obj):
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    return obj


def _mutate(obj):
    """Every tensor of ``obj`` changed in place (its version counter moves on)."""
    if isinstance(obj, torch.Tensor):
        obj.add_(1) if obj.is_floating_point() else obj.add_(3)
    elif isinstance(obj, dict):
        for v in obj.values():
            _mutate(v)
    elif isinstance(obj, list):
        for v in obj:
            _mutate(v)


def test_a_background_save_writes_the_tag_save_writes(tmp_path):
    sync, bg = tc.Store(tmp_path / "sync"), tc.Store(tmp_path / "bg")
    state = _state(1)
    for k in range(4):  # (later saves: deltas against the last, the digest cache, a frozen base)
        for w in state["w"]:
            w.mul_(0.999).add_(0.001)
        state["step"] = k
        digest = sync.save(f"t{k}", state)
        pending = bg.save_async(f"t{k}", state)
        assert pending.result() == digest == tc.fingerprint(state)
    for k in range(4):
        sync.export(f"t{k}", tmp_path / "a.safetensors")
        bg.export(f"t{k}", tmp_path / "b.safetensors")
        assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    assert sync.stats()["stored_bytes"] == bg.stats()["stored_bytes"]  # (the same codecs, the same bases)
    assert set(bg.verify()) == {f"t{k}" for k in range(4)}


def test_the_object_may_change_as_soon_as_the_call_returns(tmp_path):
    store = tc.Store(tmp_path / "s")
    state = _state(2)
    store.save("first", state)  # (the base and "i" cached: unchanged since hashed, held by the store)
    for w in state["w"]:
        w.add_(0.5)
    before = _clone(state)
    pending = store.save_async("second", state)
    _mutate(state)  # at once, every tensor: the new ones, and those the store holds
    assert pending.result() == tc.fingerprint(before)
    assert tc.fingerprint(store.load("second")) == tc.fingerprint(before)
    assert tc.fingerprint(tc.Store(tmp_path / "s").load("second")) == tc.fingerprint(before)


def test_a_tensor_the_store_lost_since_it_was_hashed_is_copied_too(tmp_path):
    store = tc.Store(tmp_path / "s")
    state = {"w": torch.randn(300, 200)}
    store.save("a", state)
    store.delete("a")
    store.gc()  # (the blob is gone; this object's cache still knows the tensor's digest)
    before = _clone(state)
    pending = store.save_async("b", state)
    state["w"].add_(1)
    assert pending.result() == tc.fingerprint(before)
    assert tc.fingerprint(tc.Store(tmp_path / "s").load("b")) == tc.fingerprint(before)


def test_the_other_methods_wait_for_it(tmp_path):
    store = tc.Store(tmp_path / "s")
    state = _state(3, n=30)
    store.save_async("a", state)
    assert store.tags() == ["a"]
    store.save_async("b", {**state, "step": 4})
    assert tc.fingerprint(store.load("b")) == tc.fingerprint({**state, "step": 4})
    store.save_async("c", {**state, "step": 5})
    store.delete("a")
    store.gc()
    assert store.tags() == ["b", "c"]
    assert set(store.verify()) == {"b", "c"}


def test_a_failure_reaches_the_future_and_the_next_save_once(tmp_path):
    root = tmp_path / "s"
    store = tc.Store(root)
    store.save("a", _state(4))
    shutil.rmtree(root / "tags")
    (root / "tags").write_text("not a folder")  # (the record cannot be renamed into it)
    pending = store.save_async("b", _state(5))
    with pytest.raises(TensorCanonError) as e:
        pending.result()
    assert "background save of tag 'b'" in str(e.value)
    # asked for: the next save does not raise it again
    (root / "tags").unlink()
    (root / "tags").mkdir()
    assert store.save("c", _state(6)) == tc.fingerprint(_state(6))
    # not asked for: the next save raises it, once
    shutil.rmtree(root / "tags")
    (root / "tags").write_text("not a folder")
    wait([store.save_async("d", _state(7))])  # (finished, its outcome not asked for)
    (root / "tags").unlink()
    with pytest.raises(TensorCanonError, match="background save of tag 'd'"):
        store.save("e", _state(8))
    (root / "tags").mkdir()
    assert store.save_async("e", _state(8)).result() == tc.fingerprint(_state(8))
    assert store.tags() == ["e"]


def test_an_object_it_cannot_save_raises_before_it_returns(tmp_path):
    store = tc.Store(tmp_path / "s")
    with pytest.raises(tc.UsageError):
        store.save_async("bad/../tag", {"w": torch.ones(3)})
    with pytest.raises(TensorCanonError):
        store.save_async("a", {"f": object()})
    assert not (tmp_path / "s" / "tags").exists() or store.tags() == []


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork")
def test_a_forked_child_does_not_wait_for_its_parents_background_save(tmp_path):
    store = tc.Store(tmp_path / "s")
    store.save_async("a", _state(9)).result()
    store._pending = (store._pending[0], store._pending[1].__class__("never"))  # (never finished, here)
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        try:
            code = 0 if store.tags() == ["a"] else 3
        except BaseException:  # noqa: BLE001 (the child reports anything as its exit code)
            code = 4
        os._exit(code)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.WEXITSTATUS(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError("the child waited for its parent's background save")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_are_copied_to_the_host_before_it_returns(tmp_path):
    store = tc.Store(tmp_path / "s")
    state = {"w": torch.randn(512, 256, device="cuda"), "cpu": torch.randn(100)}
    before = _clone(state)
    pending = store.save_async("a", state)
    _mutate(state)
    assert pending.result() == tc.fingerprint(before)
    assert tc.fingerprint(store.load("a", map_location="cpu")) == tc.fingerprint(
        {k: v.cpu() for k, v in before.items()})


def test_what_runs_under_the_objects_lock_does_not_wait_for_a_background_save(tmp_path):
    """A background save waits for the object's lock: a path that holds it (a save looking for its
    delta bases in a tag's record, gc) must not wait for a background save in turn. Here a save is
    queued behind a blocked background thread while a record is looked up under the lock."""
    import threading

    from tensorcanon.store import background

    store = tc.Store(tmp_path / "s")
    store.save("a", _state(10))
    gate = threading.Event()
    background.pool().submit(gate.wait, 60)  # (the background thread is busy until set)
    pending = store.save_async("b", _state(11))
    outcome = []

    def look_up():
        with store._lock:
            try:
                store._record("missing")
            except tc.MissingFileError as e:
                outcome.append(str(e))

    t = threading.Thread(target=look_up)
    t.start()
    t.join(20)
    alive = t.is_alive()
    gate.set()
    t.join(60)
    assert not alive, "a record lookup under the lock waited for the background save"
    assert "no tag 'missing'" in outcome[0] and "'a'" in outcome[0]
    assert pending.result() == tc.fingerprint(_state(11))


def test_a_blob_a_collection_deleted_after_the_call_returned_is_read_again_or_refused(tmp_path):
    """docs/STORE.md: a tensor not copied (the store held its blob) is read again if a collection
    deleted that (dead) blob before the background part ran; changed since, the save fails."""
    import threading

    from tensorcanon.store import background

    root = tmp_path / "s"
    store = tc.Store(root)
    kept, changed = torch.randn(200, 100), torch.randn(200, 100)
    outcomes = []
    for name in ("kept", "changed"):
        store.save("a", {"w": locals()[name]})
        store.delete("a")  # (its blob dead, still there)
        gate = threading.Event()
        background.pool().submit(gate.wait, 60)
        before = _clone({"w": locals()[name]})
        pending = store.save_async(f"b-{name}", {"w": locals()[name]})
        if name == "changed":
            changed.add_(1)  # (after the call returned: the tag must hold the old bytes, or nothing)
        tc.Store(root).gc()  # another object: deletes the dead blob the pending save counted on
        gate.set()
        try:
            outcomes.append(pending.result() == tc.fingerprint(before))
        except tc.IntegrityError as e:
            outcomes.append(str(e))
    assert outcomes[0] is True
    assert "background save of tag 'b-changed'" in outcomes[1] and "$" in outcomes[1]
    assert store.tags() == ["b-kept"]


def test_a_save_the_background_thread_refuses_leaves_nothing_to_wait_for(tmp_path, monkeypatch):
    """The thread pool refusing the work (the interpreter exiting between the call's check and its
    hand-over): the call raises, and the object's next calls do not wait for a save never started."""
    from concurrent.futures import ThreadPoolExecutor

    from tensorcanon.store import background

    closed = ThreadPoolExecutor(1)
    closed.shutdown()
    monkeypatch.setattr(background, "pool", lambda: closed)
    store = tc.Store(tmp_path / "s")
    with pytest.raises(RuntimeError):
        store.save_async("a", _state(12))
    monkeypatch.undo()
    assert store.tags() == []
    assert store.save("b", _state(13)) == tc.fingerprint(_state(13))
