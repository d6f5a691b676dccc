"""Red team: a store blob held more than once (docs/STORE.md "Copies" and "Packs"; SECURITY.md
"A blob held twice"). Every copy damaged, a lying copy first or last, a copy whose header loops,
a base whose copies are all bad, loose copies that are a FIFO, a link or a folder, many blobs
held twice, mmap / meta / export / CLI / threads, and a save and gc after a fallback."""

import os
import shutil
import sys
import threading
from pathlib import Path

import pytest
import torch
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "store"))
from test_packs import packs, read_pack

import tensorcanon as tc
from tensorcanon.format.errors import FormatError, IntegrityError, TensorCanonError
from tensorcanon.tools import cli

REFUSED = (FormatError, IntegrityError)


def _digest(t):
    dt = str(t.dtype).removeprefix("torch.")
    return xxhash.xxh3_128(f"{dt}[{','.join(map(str, t.shape))}]".encode() + t.numpy().tobytes()).digest()


def _hold(tmp_path, state, copies=2, tag="a"):
    """A store whose tag holds every blob in ``copies`` packs (its own and twins' packs, each twin
    saving one extra tensor so its pack has other bytes and another name)."""
    root = tmp_path / "s"
    tc.Store(root).save(tag, state)
    for i in range(copies - 1):
        twin = tmp_path / f"twin{i}"
        tc.Store(twin).save("b", {**state, f"extra{i}": torch.full((5,), float(i))})
        for p in packs(twin):
            shutil.copy(p, root / "packs" / p.name)
    return root


def _copies(root, raw):
    return [(p, o, n) for p in packs(root) for d, o, n in read_pack(p)[2] if d == raw]


def _damage(path, at):
    data = bytearray(path.read_bytes())
    data[at] ^= 0x40
    path.write_bytes(bytes(data))


def _rename(path, first):
    """Renames a pack so that it sorts first (or last) among the packs."""
    new = path.with_name(("0" if first else "f") * (len(path.stem)) + ".pack")
    path.rename(new)
    return new


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(300, 40, generator=g), "b": torch.zeros(7)}


def _loads(root, tag, expect):
    assert tc.fingerprint(tc.Store(root).load(tag)) == tc.fingerprint(expect)
    assert tc.Store(root).verify(tag) == tc.fingerprint(expect)


def _refused(root, tag):
    for call in (tc.Store(root).load, tc.Store(root).verify):
        with pytest.raises(REFUSED, match=f"tag '{tag}'"):
            call(tag)
    with pytest.raises(REFUSED, match=f"tag '{tag}'"):
        tc.Store(root).export(tag, root.parent / "out.safetensors")
    assert cli.main(["store", "verify", str(root), tag]) == 1
    assert cli.main(["store", "verify", str(root)]) == 1


@pytest.mark.parametrize("copies", [2, 3])
def test_every_copy_damaged_is_refused(tmp_path, copies):
    state = _state()
    root = _hold(tmp_path, state, copies)
    held = _copies(root, _digest(state["w"]))
    assert len(held) == copies
    for p, o, n in held:
        _damage(p, o + n - 3)
    _refused(root, "a")


def _lying_pack(tmp_path, first):
    """Tag "a" holds w honestly; a twin pack holding w and v (same dtype, shape, codec, length)
    has their bytes swapped: each entry names the other's valid blob. Renamed to sort first/last."""
    g = torch.Generator().manual_seed(3)
    w = torch.randint(0, 256, (300, 40), generator=g, dtype=torch.uint8)
    v = torch.randint(0, 256, (300, 40), generator=g, dtype=torch.uint8)
    root = tmp_path / "s"
    tc.Store(root).save("a", {"w": w})
    twin = tmp_path / "twin"
    tc.Store(twin).save("b", {"w": w, "v": v})
    (tp,) = packs(twin)
    data, _, entries = read_pack(tp)
    ew = next(e for e in entries if e[0] == _digest(w))
    ev = next(e for e in entries if e[0] == _digest(v))
    assert ew[2] == ev[2]  # (raw blobs of the same size)
    data = bytearray(data)
    bw, bv = bytes(data[ew[1]:ew[1] + ew[2]]), bytes(data[ev[1]:ev[1] + ev[2]])
    data[ew[1]:ew[1] + ew[2]], data[ev[1]:ev[1] + ev[2]] = bv, bw
    lying = root / "packs" / tp.name
    lying.write_bytes(bytes(data))
    lying = _rename(lying, first)
    return root, {"w": w}, lying


@pytest.mark.parametrize("first", [True, False], ids=["lying-first", "lying-last"])
def test_a_lying_copy_is_passed_over(tmp_path, capsys, first):
    root, expect, lying = _lying_pack(tmp_path, first)
    assert packs(root)[0 if first else -1] == lying
    _loads(root, "a", expect)
    assert cli.main(["store", "verify", str(root)]) == 1
    assert str(lying) in capsys.readouterr().out


@pytest.mark.parametrize("honest_damaged", [True])
def test_a_lying_copy_with_the_honest_one_damaged_is_refused(tmp_path, honest_damaged):
    root, expect, lying = _lying_pack(tmp_path, True)
    (p, o, n), = [c for c in _copies(root, _digest(expect["w"])) if c[0] != lying]
    _damage(p, o + n - 3)
    _refused(root, "a")


def _rewrite_header(path, offset, codec, depth, base):
    """Makes the blob at ``offset`` claim ``codec``, ``depth`` and ``base`` (in its padding)."""
    data = bytearray(path.read_bytes())
    L = int.from_bytes(data[offset + 10:offset + 12], "little")
    assert 20 + L + 16 <= 64
    data[offset + 8] = codec
    data[offset + 9] = depth
    data[offset + 20 + L:offset + 36 + L] = base
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("codec", [3, 4, 5])
@pytest.mark.parametrize("loop", ["self", "mutual", "deep-self"])
def test_a_copy_whose_header_loops_is_passed_over(tmp_path, codec, loop):
    g = torch.Generator().manual_seed(5)
    w = torch.randint(0, 256, (30, 40), generator=g, dtype=torch.uint8)
    v = torch.randint(0, 256, (30, 40), generator=g, dtype=torch.uint8)
    state = {"w": w, "v": v}
    root = _hold(tmp_path, state, 2)
    dw, dv = _digest(w), _digest(v)
    twin_pack = next(p for p in packs(root) if len(read_pack(p)[2]) == 3)
    ow = next(e for e in read_pack(twin_pack)[2] if e[0] == dw)
    ov = next(e for e in read_pack(twin_pack)[2] if e[0] == dv)
    if loop == "self":
        _rewrite_header(twin_pack, ow[1], codec, 1, dw)
    elif loop == "deep-self":
        _rewrite_header(twin_pack, ow[1], codec, 64, dw)
    else:
        _rewrite_header(twin_pack, ow[1], codec, 2, dv)
        _rewrite_header(twin_pack, ov[1], codec, 1, dw)
    for first in (True, False):
        twin_pack = _rename(twin_pack, first)
        _loads(root, "a", state)
        assert cli.main(["store", "verify", str(root)]) == 1
    # the honest copies damaged too: refused, no loop
    own = next(p for p in packs(root) if p != twin_pack)
    for e in read_pack(own)[2]:
        _damage(own, e[1] + e[2] - 3)
    _refused(root, "a")


def _chain(tmp_path, copies=2):
    g = torch.Generator().manual_seed(1)
    w0 = torch.randn(300, 40, generator=g)
    w1 = w0 + 1e-4 * torch.randn(300, 40, generator=g)
    root = tmp_path / "s"
    s = tc.Store(root)
    s.save("a", {"w": w0})
    s.save("b", {"w": w1})
    for i in range(copies - 1):
        tw = tc.Store(tmp_path / f"twin{i}")
        tw.save("a", {"w": w0, "x": torch.full((5,), float(i))})
        tw.save("b", {"w": w1, "x": torch.full((5,), float(i) + 10)})
        for p in packs(tmp_path / f"twin{i}"):
            shutil.copy(p, root / "packs" / p.name)
    assert tc.Store(root).stats()["codecs"].keys() & {"delta", "delta-sub", "delta-twos"}
    return root, w0, w1


def test_a_base_whose_copies_are_all_bad_refuses_its_users(tmp_path):
    root, w0, w1 = _chain(tmp_path)
    held = _copies(root, _digest(w0))
    assert len(held) == 2 and len(_copies(root, _digest(w1))) == 2
    for p, o, n in held:
        _damage(p, o + n - 3)
    _refused(root, "b")
    _refused(root, "a")


def test_a_chain_every_link_with_one_bad_copy_loads(tmp_path):
    root, w0, w1 = _chain(tmp_path, 3)
    for d, which in ((_digest(w0), 0), (_digest(w1), -1)):
        p, o, n = _copies(root, d)[which]
        _damage(p, o + n - 3)
    _loads(root, "b", {"w": w1})
    _loads(root, "a", {"w": w0})


def _loose_path(root, raw):
    h = raw.hex()
    return root / "blobs" / "xxh3-128" / h[:2] / h


def _run_bounded(fn, unblock, seconds=20):
    out = {}

    def go():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 (handed to the test thread)
            out["error"] = e

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        unblock()
        t.join(5)
        pytest.fail("hung on a loose copy that is not a file")
    if "error" in out:
        raise out["error"]
    return out["value"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs")
@pytest.mark.parametrize("kind", ["fifo", "symlink", "folder", "lying-loose"])
@pytest.mark.parametrize("pack_copy", ["sound", "damaged"])
def test_a_loose_copy_that_is_not_a_blob(tmp_path, kind, pack_copy):
    state = _state()
    root = tmp_path / "s"
    tc.Store(root).save("a", state)
    dw = _digest(state["w"])
    loose = _loose_path(root, dw)
    loose.parent.mkdir(parents=True, exist_ok=True)
    other = tmp_path / "other"
    tc.Store(other).save("o", {"w": torch.ones(300, 40)})
    (op,) = packs(other)
    (_, oo, on), = [e for e in read_pack(op)[2] if e[0] == _digest(torch.ones(300, 40))]
    other_blob = read_pack(op)[0][oo:oo + on]  # (another tensor's valid blob)
    if kind == "fifo":
        os.mkfifo(loose)
    elif kind == "symlink":
        target = tmp_path / "outside.blob"
        target.write_bytes(other_blob)
        loose.symlink_to(target)
    elif kind == "folder":
        loose.mkdir()
    else:
        loose.write_bytes(other_blob)
    if pack_copy == "damaged":
        (p, o, n), = _copies(root, dw)
        _damage(p, o + n - 3)

    def unblock():
        fd = os.open(loose, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)

    if pack_copy == "sound":
        got = _run_bounded(lambda: tc.Store(root).load("a"), unblock)
        assert tc.fingerprint(got) == tc.fingerprint(state)
        assert _run_bounded(lambda: tc.Store(root).verify("a"), unblock) == tc.fingerprint(state)
    else:
        for call in (tc.Store(root).load, tc.Store(root).verify):
            with pytest.raises(REFUSED, match="tag 'a'"):
                _run_bounded(lambda c=call: c("a"), unblock)
    rc = _run_bounded(lambda: cli.main(["store", "verify", str(root)]), unblock)
    # a damaged pack copy or a lying loose file: reported (1); a path that is not a regular file
    # is not a blob (refused unopened: ignored, or reported), never an error of the run (2)
    assert rc == 1 if kind == "lying-loose" or pack_copy == "damaged" else rc in (0, 1)


def _many(tmp_path, n):
    g = torch.Generator().manual_seed(n)
    state = {f"t{i:03d}": torch.randn(40, generator=g) for i in range(n)}
    root = _hold(tmp_path, state, 2)
    p, o, n_ = _copies(root, _digest(state["t000"]))[0]
    _damage(p, o + n_ - 3)
    return root, state


@pytest.mark.parametrize("n", [50, 200])
def test_many_blobs_held_twice_one_bad_copy(tmp_path, n):
    root, state = _many(tmp_path, n)
    _loads(root, "a", state)


def test_every_reader_after_a_fallback(tmp_path, capsys):
    state = _state()
    root = _hold(tmp_path, state, 2)
    dw = _digest(state["w"])
    p, o, n = _copies(root, dw)[0]
    _damage(p, o + n - 3)
    fp = tc.fingerprint(state)
    assert torch.equal(tc.Store(root).load("a", mmap=True)["w"], state["w"])
    meta = tc.Store(root).load("a", map_location="meta")
    assert meta["w"].device.type == "meta" and meta["w"].shape == state["w"].shape
    assert tc.Store(root).export("a", tmp_path / "o.safetensors") == fp
    assert (tmp_path / "o.safetensors").read_bytes() == tc.dumps(state)
    url = "memory://redcopies/o.safetensors"
    assert tc.Store(root).export("a", url) == fp
    assert cli.main(["store", "export", str(root), "a", str(tmp_path / "c.safetensors")]) == 0
    assert (tmp_path / "c.safetensors").read_bytes() == tc.dumps(state)
    assert cli.main(["store", "verify", str(root), "a"]) == 0
    assert cli.main(["store", "verify", str(root)]) == 1
    capsys.readouterr()


def test_two_threads_load_one_store_during_the_fallback(tmp_path):
    root, state = _many(tmp_path, 60)
    store = tc.Store(root)
    fp = tc.fingerprint(state)
    results = []

    def go():
        try:
            for _ in range(3):
                results.append(tc.fingerprint(store.load("a")))
        except TensorCanonError as e:  # pragma: no cover (reported below)
            results.append(e)

    ts = [threading.Thread(target=go) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert results == [fp] * 6


def test_a_save_and_gc_after_a_fallback_keep_every_tag(tmp_path):
    root, w0, w1 = _chain(tmp_path, 2)
    p, o, n = _copies(root, _digest(w0))[0]
    _damage(p, o + n - 3)
    store = tc.Store(root)
    assert tc.fingerprint(store.load("b")) == tc.fingerprint({"w": w1})
    w2 = w1 + 1e-4 * torch.ones(300, 40)
    store.save("c", {"w": w2})
    store.gc()
    expect = {"a": {"w": w0}, "b": {"w": w1}, "c": {"w": w2}}
    for s in (store, tc.Store(root)):
        for tag, obj in expect.items():
            got = s.load(tag)
            assert torch.equal(got["w"], obj["w"]) and tc.fingerprint(got) == tc.fingerprint(obj)
            assert s.verify(tag) == tc.fingerprint(obj)
    with pytest.raises(IntegrityError, match="pack"):  # (the damaged copy's pack: kept, reported)
        tc.Store(root).verify()
