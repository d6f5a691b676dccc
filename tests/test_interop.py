"""Every file tensorcanon writes is an ordinary safetensors file, and plain
safetensors files load as flat dicts."""

import json
import pathlib
import struct

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import tensorcanon as tc
from tensorcanon.format import dtypes

GOLDEN = pathlib.Path(__file__).parent / "golden"
import vectors
from compare import canonical_bytes

GOLDEN_FILES = sorted(GOLDEN.glob("*.safetensors"))


def header_of(data: bytes) -> dict:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n])


def check_readable(path: pathlib.Path) -> dict:
    """Open ``path`` with both safetensors readers; return {name: tensor} as safetensors sees it."""
    plain = load_file(str(path))
    with safe_open(str(path), framework="pt") as f:
        names = set(f.keys())
        meta = f.metadata()
        for name in names:  # (by bytes: torch < 2.13 has no torch.equal for float8 dtypes)
            assert canonical_bytes(f.get_tensor(name)) == canonical_bytes(plain[name])
    assert names == set(plain)
    assert meta["format"] == "pt"
    assert "tensorcanon.manifest" in meta and meta["tensorcanon.digest"].startswith("xxh3-128:")
    return plain


@pytest.mark.parametrize("path", GOLDEN_FILES, ids=lambda p: p.stem)
def test_safetensors_reads_every_golden_file(path):
    plain = check_readable(path)
    data = path.read_bytes()
    header = header_of(data)
    assert set(plain) == set(header) - {"__metadata__"}
    # values: every tensor safetensors returns is the canonical bytes of the one tensorcanon loads
    if not vectors.buildable(path.stem):  # torch 2.4, the floor, lacks some dtypes of dtypes_u8:
        if path.stem == "tensor_kinds_kept":  # (a torch that cannot give jagged tensors cached lengths
            assert tc.fingerprint(tc.load(path)) == tc.verify(path)  # still loads the file, whole)
            return
        with pytest.raises(TypeError, match="which this torch"):  # tensorcanon refuses it by name
            tc.load(path)
        return
    obj, _ = vectors.build(path.stem)
    import tensorcanon.io.writer as writer

    p = writer.plan(obj)
    for src in p.tensors:
        st_value = plain[src.name]
        if src.dtype.native:
            assert tuple(st_value.shape) == src.shape
            assert st_value.dtype == (src.dtype.torch if src.kind != "ndarray" else st_value.dtype)
        else:
            assert st_value.dtype == torch.uint8 and tuple(st_value.shape) == (*src.shape, src.dtype.itemsize)
        expect = src.value if src.kind != "ndarray" else torch.from_numpy(
            np.ascontiguousarray(src.value.astype(src.value.dtype.newbyteorder("="))))
        assert canonical_bytes(st_value) == canonical_bytes(expect), src.name


def test_flat_state_dict_keeps_keys_and_values(tmp_path):
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), torch.nn.BatchNorm2d(3), torch.nn.Flatten(),
                                torch.nn.Linear(3, 2))
    sd = model.state_dict()
    path = tmp_path / "m.safetensors"
    tc.save(sd, path)
    plain = check_readable(path)
    assert set(plain) == set(sd)
    for k, v in sd.items():
        assert plain[k].dtype == v.dtype and torch.equal(plain[k], v), k
    # and it loads into a fresh model with plain safetensors
    fresh = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), torch.nn.BatchNorm2d(3), torch.nn.Flatten(),
                                torch.nn.Linear(3, 2))
    fresh.load_state_dict(load_file(str(path)))
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, sd[k])


@pytest.mark.parametrize("dtype", sorted(dtypes.BY_TORCH, key=str), ids=str)
def test_every_dtype_is_readable_by_safetensors(tmp_path, dtype):
    def make():  # a strided view (every other element) of arange-based bytes
        if dtype is torch.bool:
            return torch.tensor([True, False, True, True])[::2]
        return (torch.arange(6 * dtype.itemsize, dtype=torch.uint8) * 37).view(dtype)[::2]

    t = make()
    path = tmp_path / "t.safetensors"
    tc.save({"t": t, "nested": {"x": [make()]}}, path)
    plain = check_readable(path)
    row = dtypes.BY_TORCH[dtype]
    got = plain["t"]
    if row.native:
        assert got.dtype == dtype and tuple(got.shape) == tuple(t.shape)
    else:
        assert got.dtype == torch.uint8 and tuple(got.shape) == (*t.shape, dtype.itemsize)
    assert canonical_bytes(got) == canonical_bytes(t)
    assert "nested.x.0" in plain


def test_nested_objects_get_readable_dotted_names(tmp_path):
    obj = {"model": {"fc.weight": torch.ones(2)}, "opt": {"state": {0: {"exp_avg": torch.zeros(2)}}},
           "list": [torch.ones(1), (torch.zeros(1),)]}
    path = tmp_path / "n.safetensors"
    tc.save(obj, path)
    assert set(check_readable(path)) == {"model.fc.weight", "opt.state.0.exp_avg", "list.0", "list.1.0"}


def test_plain_safetensors_files_load_as_flat_dicts(tmp_path):
    tensors = {"b.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3),
               "a": torch.tensor([1, 2], dtype=torch.int8),
               "c": torch.zeros(0, 3, dtype=torch.bfloat16), "d": torch.tensor(True)}
    path = tmp_path / "plain.safetensors"
    save_file(tensors, str(path), metadata={"x": "1", "format": "pt"})
    out = tc.load(path)
    assert type(out) is dict and set(out) == set(tensors)
    for k, v in tensors.items():
        assert out[k].dtype == v.dtype and out[k].shape == v.shape and torch.equal(out[k], v)
    out2 = tc.load(path, map_location=torch.device("cpu"), verify=False)
    assert all(torch.equal(out2[k], v) for k, v in tensors.items())
    # a plain file has no digest to verify against
    with pytest.raises(tc.FormatError):
        tc.verify(path)


def test_tensorcanon_reads_what_it_wrote_after_safetensors_round_trip(tmp_path):
    """A flat state_dict re-saved by safetensors (losing our manifest) still loads, as plain tensors."""
    sd = {"w": torch.arange(4.0), "b": torch.ones(2, dtype=torch.float16)}
    path = tmp_path / "a.safetensors"
    tc.save(sd, path)
    save_file(load_file(str(path)), str(tmp_path / "b.safetensors"))
    out = tc.load(tmp_path / "b.safetensors")
    assert set(out) == set(sd) and all(torch.equal(out[k], sd[k]) for k in sd)
