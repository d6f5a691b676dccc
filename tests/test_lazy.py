"""tensorcanon.open: validated up front, per-tensor reads touch and verify only that tensor."""

import numpy as np
import pytest
import torch

import tensorcanon
from tensorcanon import digest as digest_module


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
    hashed = []
    real = digest_module.tensor_hasher

    class Counting:
        def __init__(self, h):
            self.h = h

        def update(self, data):
            hashed.append(memoryview(data).nbytes)
            self.h.update(data)

        def digest(self):
            return self.h.digest()

    monkeypatch.setattr(digest_module, "tensor_hasher", lambda *a: Counting(real(*a)))
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
    from tensorcanon import paths

    p = tmp_path / "k.safetensors"
    t = torch.ones(2)
    tensorcanon.save({(1, "a"): torch.zeros(1), 3: {"w": t}, b"k": [t]}, p)
    with tensorcanon.open(p) as f:
        assert set(f.keys()) == {paths.join(((1, "a"),)), paths.join((3, "w")), paths.join((b"k", 0))}
        assert torch.equal(f[paths.join(((1, "a"),))], torch.zeros(1))
        assert torch.equal(f[paths.join((b"k", 0))], t)
