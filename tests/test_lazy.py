"""tensorcanon.open: validated up front, per-tensor reads touch and verify only that tensor."""

import numpy as np
import pytest
import torch

import tensorcanon

from support import count_hashed_bytes


def _thousand():
    return {"layers": {f"l{i:04d}": torch.full((64,), float(i)) for i in range(1000)}, "step": 7}


def test_keys_and_values_match_load(tmp_path):
    obj = {"model": {"w": torch.arange(6.0).reshape(2, 3), "p": torch.nn.Parameter(torch.ones(2))},
           "arr": np.arange(4, dtype=np.int16), "items": [torch.tensor([1, 2])]}
    p = tmp_path / "c.st"
    d = tensorcanon.save(obj, p)
    with tensorcanon.open(p) as f:
        assert f.digest == d
        assert sorted(f.keys()) == sorted(['$["arr"]', '$["items"][0]', '$["model"]["p"]', '$["model"]["w"]'])
        assert torch.equal(f['$["model"]["w"]'], obj["model"]["w"])
        assert type(f['$["model"]["p"]']) is torch.nn.Parameter
        assert np.array_equal(f['$["arr"]'], obj["arr"])
        assert torch.equal(f['$["items"][0]'], obj["items"][0])
        for name in f.names:  # stored names work too
            assert name in f
        with pytest.raises(KeyError):
            f['$["nope"]']


def test_reading_one_of_1000_hashes_only_its_bytes(tmp_path, monkeypatch):
    p = tmp_path / "big.st"
    tensorcanon.save(_thousand(), p)
    hashed = count_hashed_bytes(monkeypatch)
    with tensorcanon.open(p) as f:
        assert len(f) == 1000
        t = f['$["layers"]["l0500"]']
        assert sum(hashed) == 64 * 4  # that tensor's bytes, nothing else
        f['$["layers"]["l0500"]']
        assert sum(hashed) == 64 * 4  # verified once only
    assert torch.equal(t, torch.full((64,), 500.0))


def test_damage_elsewhere_does_not_block_a_good_tensor(tmp_path):
    p = tmp_path / "c.st"
    obj = {"a": torch.zeros(1000), "b": torch.ones(1000)}
    tensorcanon.save(obj, p)
    raw = bytearray(p.read_bytes())
    raw[-10] ^= 0xFF  # inside the last tensor's data ("b" sorts after "a")
    p.write_bytes(bytes(raw))
    with tensorcanon.open(p) as f:
        assert torch.equal(f['$["a"]'], obj["a"])
        with pytest.raises(tensorcanon.IntegrityError, match=r'\$\["b"\]'):
            f['$["b"]']
    with tensorcanon.open(p, verify=False) as f:
        assert not torch.equal(f['$["b"]'], obj["b"])


def test_header_is_validated_before_anything_is_exposed(tmp_path):
    p = tmp_path / "c.st"
    tensorcanon.save({"a": torch.zeros(4)}, p)
    raw = bytearray(p.read_bytes())
    i = raw.index(b'"tensorcanon.digest":"xxh3-128:') + 31
    raw[i] = ord("0") if raw[i] != ord("0") else ord("1")
    p.write_bytes(bytes(raw))
    with pytest.raises(tensorcanon.IntegrityError, match="does not match the file digest"):
        tensorcanon.open(p)
    p.write_bytes(b"\x00" * 3)
    with pytest.raises(tensorcanon.FormatError):
        tensorcanon.open(p)


def test_plain_safetensors_and_closed(tmp_path):
    from safetensors.torch import save_file

    p = tmp_path / "plain.st"
    save_file({"x": torch.arange(3)}, str(p))
    f = tensorcanon.open(p)
    assert f.keys() == ['$["x"]'] and f.digest is None
    assert torch.equal(f["x"], torch.arange(3))
    f.close()
    with pytest.raises(tensorcanon.TensorCanonError, match="closed"):
        f["x"]


def test_empty_object_and_map_location(tmp_path):
    p = tmp_path / "e.st"
    tensorcanon.save({"n": 1}, p)
    with tensorcanon.open(p) as f:
        assert f.keys() == []
    tensorcanon.save({"t": torch.ones(2)}, p)
    with tensorcanon.open(p, map_location="cpu") as f:
        assert f['$["t"]'].device.type == "cpu"


def test_keys_render_every_key_type_as_error_paths_do(tmp_path):
    # Paths are built from decoded keys, exactly as tensorcanon's errors name them.
    from tensorcanon.format import paths

    p = tmp_path / "k.safetensors"
    t = torch.ones(2)
    tensorcanon.save({(1, "a"): torch.zeros(1), 3: {"w": t}, b"k": [t]}, p)
    with tensorcanon.open(p) as f:
        assert set(f.keys()) == {paths.join(((1, "a"),)), paths.join((3, "w")), paths.join((b"k", 0))}
        assert torch.equal(f[paths.join(((1, "a"),))], torch.zeros(1))
        assert torch.equal(f[paths.join((b"k", 0))], t)
        with pytest.raises(KeyError):  # no path writes an int of 5,000 digits (beyond 64 bits: hex)
            f[f"$[{'3' * 5000}][\"w\"]"]
        assert torch.equal(f[paths.join((3, "w"))], t) and paths.join((2**70,)) == "$[0x400000000000000000]"


# ----------------------------------------------------------------- what open proves, and when

def _nested():
    import collections

    t = torch.arange(6.0)
    od = collections.OrderedDict([("z", torch.ones(2)), ("a", torch.zeros(3))])
    return {"model": {"enc": {"w": torch.randn(3, 3), "b": torch.zeros(3)}, "tied": t},
            "list": [t, (torch.ones(1), {"deep": torch.full((2,), 7.0)})], 5: torch.tensor(1.5),
            "od": od, "arr": np.arange(3), (1, "k"): torch.ones(4), "flag": torch.tensor([True])}


def test_every_key_reads_as_the_whole_file_path_reads_it(tmp_path):
    p = tmp_path / "n.safetensors"
    tensorcanon.save(_nested(), p)
    with tensorcanon.open(p) as full:
        full.check()
        expected = {k: full[k] for k in full.keys()}
        names = {n: full[n] for n in full.names}
    for key, value in [*expected.items(), *names.items()]:
        with tensorcanon.open(p) as f:  # a fresh file: the first read is the quick one
            got = f[key]
            assert type(got) is type(value)
            if isinstance(value, np.ndarray):
                assert np.array_equal(got, value)
            else:
                assert torch.equal(got, value) and got.dtype == value.dtype
            assert key in f


def test_one_read_does_not_check_the_whole_file(tmp_path, monkeypatch):
    from tensorcanon.io import reader

    p = tmp_path / "big.st"
    tensorcanon.save(_thousand(), p)
    walks = []
    real = reader.CheckedFile.uses
    monkeypatch.setattr(reader.CheckedFile, "uses", lambda self: walks.append(1) or real(self))
    with tensorcanon.open(p) as f:
        assert torch.equal(f['$["layers"]["l0500"]'], torch.full((64,), 500.0))
        assert torch.equal(f["layers.l0007"], torch.full((64,), 7.0))
        assert f.digest == tensorcanon.verify(p) and f.algorithm == "xxh3-128"
        assert walks == []
        assert len(f) == 1000  # needs the whole file
        assert walks == [1]
        assert torch.equal(f['$["layers"]["l0999"]'], torch.full((64,), 999.0))


def _authentic_but_not_canonical(tmp_path):
    """A file whose manifest matches its digest but whose tree lists dict keys out of order."""
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent / "fuzz"))
    import msgpack

    import hostile_lib as h

    valid = tensorcanon.dumps({"a": torch.zeros(2), "b": torch.ones(2)})
    m, header, body = h.manifest_of(valid)
    root = m["root"]  # ["dict", "a", ["tensor", 0], "b", ["tensor", 1]]
    m["root"] = [root[0], root[3], root[4], root[1], root[2]]
    p = tmp_path / "odd.safetensors"
    p.write_bytes(h.rebuild(valid, msgpack.packb(m, use_bin_type=True), header, body))
    return p


def test_a_tensor_is_proven_alone_and_the_file_refused_as_a_whole(tmp_path):
    p = _authentic_but_not_canonical(tmp_path)
    with pytest.raises(tensorcanon.FormatError, match="used before"):
        tensorcanon.load(p)
    with tensorcanon.open(p) as f:
        assert torch.equal(f['$["b"]'], torch.ones(2))  # its row, entry and bytes are proven
        with pytest.raises(tensorcanon.FormatError, match="used before"):
            f.check()
        with pytest.raises(tensorcanon.FormatError):
            f.keys()


def test_verify_false_checks_the_whole_file_at_open(tmp_path):
    p = _authentic_but_not_canonical(tmp_path)
    with pytest.raises(tensorcanon.FormatError, match="used before"):
        tensorcanon.open(p, verify=False)


def test_a_damaged_tensor_is_named_and_never_returned(tmp_path):
    p = tmp_path / "big.st"
    tensorcanon.save(_thousand(), p)
    raw = bytearray(p.read_bytes())
    raw[-3] ^= 1  # the last tensor in the file
    p.write_bytes(bytes(raw))
    with tensorcanon.open(p) as f:
        assert torch.equal(f['$["layers"]["l0000"]'], torch.zeros(64))
        with pytest.raises(tensorcanon.IntegrityError, match=r'\$\["layers"\]\["l0999"\]'):
            f['$["layers"]["l0999"]']
        with pytest.raises(tensorcanon.IntegrityError):
            f["layers.l0999"]


def test_mapping_protocol(tmp_path):
    from collections.abc import Mapping

    p = tmp_path / "m.st"
    obj = {"a": torch.zeros(2), "b": [torch.ones(3)]}
    tensorcanon.save(obj, p)
    with tensorcanon.open(p) as f:
        assert isinstance(f, Mapping)
        assert f.keys() == ['$["a"]', '$["b"][0]'] and list(f) == f.keys() and len(f) == 2
        assert [k for k, _ in f.items()] == f.keys()
        assert all(torch.equal(v, w) for v, w in zip(f.values(), [obj["a"], obj["b"][0]], strict=True))
        assert f.get('$["nope"]') is None and f.get('$["nope"]', 3) == 3
        assert torch.equal(f.get('$["a"]'), obj["a"])
        assert '$["a"]' in f and "a" in f and '$["nope"]' not in f and 3 not in f
        assert f == f and f != tensorcanon.open(p)


def test_lifetime_descriptors_and_maps(tmp_path):
    import gc
    import os
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc/self")
    p = tmp_path / "l.st"
    tensorcanon.save({"a": torch.arange(1000.0)}, p)
    real = os.path.realpath(p)

    def mapped():
        with open("/proc/self/maps") as fh:
            return sum(1 for line in fh if line.rstrip().endswith(real))

    gc.collect()
    fds = len(os.listdir("/proc/self/fd"))
    f = tensorcanon.open(p)
    assert len(os.listdir("/proc/self/fd")) == fds  # mapped, no descriptor kept
    assert mapped() == 1
    a = f['$["a"]']
    f.close()
    gc.collect()
    assert mapped() == 0
    assert torch.equal(a, torch.arange(1000.0))  # a copy: valid after close
    with pytest.raises(tensorcanon.TensorCanonError, match="closed"):
        f['$["a"]']
    for bad in (b"", b"\x00" * 7, b"\x08" + bytes(7) + b"[]      "):
        p.write_bytes(bad)
        with pytest.raises(tensorcanon.FormatError):
            tensorcanon.open(p)
    gc.collect()
    assert mapped() == 0 and len(os.listdir("/proc/self/fd")) == fds


def test_check_builds_no_path_text(tmp_path, monkeypatch):
    """check() proves the tree without rendering a path per tensor use (a deep tree's paths cost
    far more memory than its bytes); keys() builds them when asked."""
    from tensorcanon.io import reader

    path = tmp_path / "deep.safetensors"
    obj = inner = {}
    for _ in range(50):
        inner["k"] = {}
        inner = inner["k"]
    inner["t"] = torch.zeros(2)
    tensorcanon.save(obj, path)
    real = reader.CheckedFile.uses
    calls = []
    monkeypatch.setattr(reader.CheckedFile, "uses", lambda self: calls.append(1) or real(self))
    with tensorcanon.open(path) as f:
        f.check()
        assert not calls
        assert f.keys() == ["$" + '["k"]' * 50 + '["t"]'] and calls == [1]
