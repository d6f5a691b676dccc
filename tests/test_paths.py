"""One path per value, everywhere: errors from load, verify and open, open's keys and diff agree.

The encoder, the decoder and diff walk values in one canonical order
(tensorcanon.format.walk, tensorcanon.format.tree.Decoder), and every path is rendered from
decoded keys by tensorcanon.format.paths, so a tensor under an unusual key is named the
same way by every reader.
"""

import collections

import pytest
import torch

import tensorcanon
from tensorcanon.format import paths
from tensorcanon.io import reader

BIG = 2**70
HUGE = -(10**5000)  # more digits than Python's int-to-str limit allows

# (the object's key path to the tensor, the expected rendered path)
CASES = [
    (("a", ("t", 1)), '$["a"][(\'t\', 1)]'),
    (("a", frozenset({2, 1})), '$["a"][frozenset({1, 2})]'),
    (("a", BIG), '$["a"][0x400000000000000000]'),
    (("a", HUGE), f'$["a"][-0x{-HUGE:x}]'),
    (("a", (1.5, float("-inf"), None)), '$["a"][(1.5, -inf, None)]'),
    (("a", b"\x00k"), '$["a"][b\'\\x00k\']'),
    (("a", -3, "x", 0), '$["a"][-3]["x"][0]'),
    (("od", "_metadata", "v"), '$["od"]["_metadata"]["v"]'),
]


def _nest(trail, leaf):
    """An object holding ``leaf`` at ``trail`` (lists for int components after a str key)."""
    if not trail:
        return leaf
    head, rest = trail[0], trail[1:]
    if head == "od":
        od = collections.OrderedDict(x=1)
        od._metadata = _nest(rest[1:], leaf)  # the _metadata slot
        return {"od": od}
    if rest and type(rest[0]) is int and rest[0] == 0 and len(rest) == 1:
        return {head: [leaf]}
    return {head: _nest(rest, leaf)}


def _damage(data: bytes, name: str) -> bytes:
    with reader.open_file(data) as cf:
        row = next(r for r in cf.rows if r.name == name)
        at = cf.data_start + row.begin
    out = bytearray(data)
    out[at] ^= 0xFF
    return bytes(out)


@pytest.mark.parametrize("trail, want", CASES, ids=[c[1] for c in CASES])
def test_a_damaged_tensor_has_the_same_path_in_every_reader(tmp_path, trail, want):
    t = torch.arange(4.0)
    obj = _nest(trail, t)
    if trail[0] != "od":
        obj = {"pad": torch.zeros(2), **obj}
    data = tensorcanon.dumps(obj)
    with reader.open_file(data) as cf:
        name = next(cf.rows[i].name for tr, i in cf.uses() if paths.join(tr) == want)
    bad = _damage(data, name)
    path = tmp_path / "bad.safetensors"
    path.write_bytes(bad)

    seen = {}
    with pytest.raises(tensorcanon.IntegrityError) as info:
        tensorcanon.load(path)
    seen["load"] = info.value.path
    with pytest.raises(tensorcanon.IntegrityError) as info:
        tensorcanon.loads(bad)
    seen["loads"] = info.value.path
    with pytest.raises(tensorcanon.IntegrityError) as info:
        tensorcanon.verify(path)
    seen["verify"] = info.value.path
    with tensorcanon.open(path) as f:
        assert want in f.keys()
        with pytest.raises(tensorcanon.IntegrityError) as info:
            f[want]
        seen["open"] = info.value.path
    changed = tensorcanon.loads(data)
    target = changed
    for k in trail[:-1]:
        target = target._metadata if k == "_metadata" else target[k]
    target[trail[-1]] = t + 1
    differences = tensorcanon.diff(tensorcanon.loads(data), changed).differences
    seen["diff"] = differences[0].path if differences else None
    assert seen == dict.fromkeys(seen, want)
    assert str(want) in str(info.value)
