"""A blob the store holds twice (two processes saved the same new tensor at once, each into its own
pack; a pack and a loose copy): a load, a tag's verify and an export read a copy that checks when the
one they read first does not (docs/STORE.md, "Copies"); the whole store's verify still reports the
damaged copy. The only copy damaged: refused, as before."""

import json
import shutil

import pytest
import torch
import xxhash
from test_packs import packs, read_pack

import tensorcanon as tc
from tensorcanon.format.errors import FormatError, IntegrityError
from tensorcanon.tools import cli


def _hold_twice(tmp_path, state, other):
    """A store whose tag "a" (``state``) has every blob in two packs: its own, and one saved by
    another store (``state`` and ``other`` together) whose pack file was copied in."""
    root, twin = tmp_path / "s", tmp_path / "twin"
    tc.Store(root).save("a", state)
    tc.Store(twin).save("b", {**state, **other})
    (theirs,) = packs(twin)
    shutil.copy(theirs, root / "packs" / theirs.name)
    assert len(packs(root)) == 2
    return root


def _first_copy(root, raw):
    """The pack a fresh Store reads blob ``raw`` from (the first, by name, of those holding it), and
    where the blob is in it."""
    for p in packs(root):
        for d, offset, length in read_pack(p)[2]:
            if d == raw:
                return p, offset, length
    raise AssertionError("not held")


def _damage(path, at):
    data = bytearray(path.read_bytes())
    data[at] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("steps, dtype", [(1, "float32"), (3, "float32"), (1, "uint8")],
                         ids=["compressed", "delta chain", "raw"])
def test_a_damaged_first_copy_is_passed_over_for_a_sound_one(tmp_path, capsys, steps, dtype):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 40, generator=g) if dtype == "float32" else \
        torch.randint(0, 256, (300, 40), generator=g, dtype=torch.uint8)
    state = {"w": w, "b": torch.zeros(7)}
    root = _hold_twice(tmp_path, state, {"extra": torch.ones(5)})
    if steps > 1:  # (a chain: later tags are deltas against "a"'s blob, which is held twice)
        store = tc.Store(root)
        for k in range(1, steps):
            w = w + 1e-4 * torch.randn(300, 40, generator=g)
            store.save(f"a{k}", {"w": w, "b": torch.zeros(7)})

    raw = xxhash.xxh3_128(f"{dtype}[300,40]".encode() + state["w"].numpy().tobytes()).digest()
    pack, offset, length = _first_copy(root, raw)
    _damage(pack, offset + length - 3)  # (in the blob's payload: its header still parses)
    last = f"a{steps - 1}" if steps > 1 else "a"
    expect = {"w": w, "b": torch.zeros(7)}
    fresh = tc.Store(root)
    got = fresh.load(last)
    assert torch.equal(got["w"], expect["w"]) and tc.fingerprint(got) == tc.fingerprint(expect)
    assert tc.Store(root).verify(last) == tc.fingerprint(expect)
    assert tc.Store(root).export(last, tmp_path / "o.safetensors") == tc.fingerprint(expect)
    assert (tmp_path / "o.safetensors").read_bytes() == tc.dumps(expect)
    assert torch.equal(tc.Store(root).load(last, mmap=True)["w"], expect["w"])
    # the whole store's check still names the damaged copy (its pack), and exits 1
    assert cli.main(["store", "verify", str(root), "--json"]) == 1

    report = json.loads(capsys.readouterr().out)["results"]
    bad = [r for r in report if r["status"] == "damaged"]
    assert [r.get("pack") for r in bad] == [str(pack)], bad
    assert all(r["status"] == "ok" for r in report if "tag" in r)
    assert cli.main(["store", "verify", str(root), last]) == 0


def test_the_only_copy_damaged_is_still_refused(tmp_path):
    root = tmp_path / "s"
    w = torch.randn(300, 40)
    tc.Store(root).save("a", {"w": w})
    (pack,) = packs(root)
    _, offset, length = read_pack(pack)[2][0]
    _damage(pack, offset + length - 3)
    for call in (tc.Store(root).load, tc.Store(root).verify):
        with pytest.raises((FormatError, IntegrityError), match="tag 'a'"):
            call("a")


def test_a_chain_held_twice_whose_base_copy_read_first_is_damaged(tmp_path):
    """Both links of a chain (a base and a delta against it) held in two packs; the base's copy
    read first is damaged: the delta's copies only check once the base's sound copy is chosen,
    which is done first (bases before their users), and the tag loads."""
    g = torch.Generator().manual_seed(1)
    w0 = torch.randn(300, 40, generator=g)
    w1 = w0 + 1e-4 * torch.randn(300, 40, generator=g)
    root, twin = tmp_path / "s", tmp_path / "twin"
    for r, twin_too in ((root, False), (twin, True)):  # (the twin's packs: other bytes, other names)
        s = tc.Store(r)
        s.save("a", {"w": w0, **({"x": torch.ones(5)} if twin_too else {})})
        s.save("b", {"w": w1, **({"x": torch.full((5,), 2.0)} if twin_too else {})})
    for p in packs(twin):
        shutil.copy(p, root / "packs" / p.name)
    d0 = xxhash.xxh3_128(b"float32[300,40]" + w0.numpy().tobytes()).digest()
    d1 = xxhash.xxh3_128(b"float32[300,40]" + w1.numpy().tobytes()).digest()
    for d in (d0, d1):
        assert sum(e[0] == d for p in packs(root) for e in read_pack(p)[2]) == 2  # (each link held twice)
    assert tc.Store(root).stats()["codecs"].keys() & {"delta-sub", "delta-twos"}  # (b's w: a delta)
    pack, offset, length = _first_copy(root, d0)
    _damage(pack, offset + length - 3)
    assert tc.fingerprint(tc.Store(root).load("b")) == tc.fingerprint({"w": w1})
    assert tc.Store(root).verify("b") == tc.fingerprint({"w": w1})
