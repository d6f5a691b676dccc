"""The README's "What comes back" table, row by row.

Each row of the table is a key of :data:`ROWS`, mapped to the test that shows
it; :func:`test_every_readme_row_has_a_test` keeps the two in step. Where a row
contrasts with ``torch.load``, the test shows torch's behaviour too (with
``weights_only=True``, on data this test wrote).
"""

from __future__ import annotations

import collections
import dataclasses
import io
import math
import mmap
import pathlib
import pickle
import re
import struct

import numpy as np
import pytest
import torch

import tensorcanon
from tensorcanon.format import dtypes

from support import on_cuda0

README = (pathlib.Path(__file__).parent.parent / "README.md").read_text(encoding="utf-8")

ROWS = {
    "Dict key order": "test_dict_key_order",
    "Tied tensors": "test_tied_tensors",
    "Other views": "test_other_views",
    "Strides and memory format": "test_strides_and_memory_format",
    "Lazy conjugate / negative views": "test_lazy_views",
    "`requires_grad`": "test_requires_grad",
    "`nn.Parameter`": "test_parameters",
    "Sparse tensors": "test_sparse_tensors",
    "Nested tensors": "test_nested_tensors",
    "Meta tensors": "test_meta_tensors",
    "Attributes on tensors": "test_attributes_on_tensors",
    "Tensor subclasses": "test_tensor_subclasses",
    "Devices": "test_devices",
    "Dtypes": "test_dtypes",
    "numpy": "test_numpy",
    "Registered types": "test_registered_types",
    "Python values": "test_python_values",
    "`load(path, mmap=True)`": "test_mmap_is_private",
    "Default device, tensor modes": "test_default_device_and_tensor_modes",
    "Efficient zero tensors": "test_efficient_zero_tensors",
    "`torch.serialization.skip_data()`": "test_skip_data",
}


def _torch_round_trip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_every_readme_row_has_a_test():
    section = README.split("### What comes back", 1)[1].split("\n### ", 1)[0]
    rows = re.findall(r"^\| ([^|]+?) \| ", section, flags=re.M)
    rows = [r for r in rows if r not in ("Saved", "---")]
    assert rows == list(ROWS)
    for test in ROWS.values():
        assert callable(globals().get(test)), test


def test_dict_key_order():
    obj = {"b": 1, "a": 2, 10: 3, 2: 4}
    assert list(tensorcanon.loads(tensorcanon.dumps(obj))) == [2, 10, "a", "b"]
    assert list(_torch_round_trip(obj)) == ["b", "a", 10, 2]  # torch keeps insertion order
    sd = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)).state_dict()
    back = tensorcanon.loads(tensorcanon.dumps(sd))
    assert type(back) is collections.OrderedDict and list(back) == list(sd)
    assert back._metadata == sd._metadata


def test_tied_tensors():
    w = torch.arange(6.0).reshape(2, 3)
    arr = np.arange(4.0)
    obj = {"emb": w, "head": w, "row": w[1], "row_again": w[1], "a": torch.from_numpy(arr), "b": torch.from_numpy(arr)}
    back = tensorcanon.loads(tensorcanon.dumps(obj))
    assert back["emb"] is back["head"] and back["row"] is back["row_again"] and back["a"] is back["b"]
    assert back["row"] is not back["emb"]


def test_other_views():
    base = torch.arange(6.0)
    obj = {"a": base[:3], "b": base[1:4]}
    back = tensorcanon.loads(tensorcanon.dumps(obj))
    back["a"][1] = 99.0
    assert back["b"][0] == 1.0  # no longer shared
    assert back["a"].untyped_storage().nbytes() == 3 * 4  # only the viewed elements
    theirs = _torch_round_trip(obj)
    theirs["a"][1] = 99.0
    assert theirs["b"][0] == 99.0  # torch.load restores the sharing


def test_strides_and_memory_format():
    x = torch.arange(2 * 3 * 2 * 2.0).reshape(2, 3, 2, 2)
    t = torch.arange(6.0).reshape(2, 3).t()
    obj = {"nhwc": x.contiguous(memory_format=torch.channels_last),
           "ndhwc": x.unsqueeze(2).contiguous(memory_format=torch.channels_last_3d), "t": t}
    back = tensorcanon.loads(tensorcanon.dumps(obj))
    assert back["nhwc"].is_contiguous(memory_format=torch.channels_last) and not back["nhwc"].is_contiguous()
    assert back["ndhwc"].is_contiguous(memory_format=torch.channels_last_3d)
    assert back["t"].is_contiguous() and torch.equal(back["t"], t)
    assert _torch_round_trip(obj)["t"].stride() == t.stride()  # torch keeps the strides


def test_lazy_views():
    z = torch.complex(torch.arange(3.0), torch.ones(3))
    obj = {"conj": z.conj(), "neg": z.conj().imag}
    assert obj["conj"].is_conj() and obj["neg"].is_neg()
    back = tensorcanon.loads(tensorcanon.dumps(obj))
    assert not back["conj"].is_conj() and torch.equal(back["conj"], z.conj().resolve_conj())
    assert not back["neg"].is_neg() and torch.equal(back["neg"], -torch.ones(3))


def test_requires_grad():
    leaf = torch.ones(2, requires_grad=True)
    obj = {"leaf": leaf, "computed": leaf * 2, "frozen": torch.ones(2)}
    back = tensorcanon.loads(tensorcanon.dumps(obj))
    assert back["leaf"].requires_grad and back["computed"].requires_grad and not back["frozen"].requires_grad
    assert back["computed"].grad_fn is None and back["computed"].is_leaf
    assert _torch_round_trip({"leaf": leaf})["leaf"].requires_grad


def test_parameters():
    obj = {"p": torch.nn.Parameter(torch.ones(2)), "q": torch.nn.Parameter(torch.ones(2), requires_grad=False)}
    back = tensorcanon.loads(tensorcanon.dumps(obj))
    assert type(back["p"]) is torch.nn.Parameter and back["p"].requires_grad
    assert type(back["q"]) is torch.nn.Parameter and not back["q"].requires_grad

    class Special(torch.Tensor):
        pass

    with pytest.raises(tensorcanon.UnsupportedTypeError, match="subclass"):
        tensorcanon.dumps(torch.ones(1).as_subclass(Special))


def test_devices():
    obj = {"w": torch.arange(3.0)}
    assert tensorcanon.loads(tensorcanon.dumps(obj))["w"].device.type == "cpu"
    if torch.cuda.is_available():  # pragma: no cover - exercised on GPU machines
        back = tensorcanon.loads(tensorcanon.dumps({"w": obj["w"].cuda()}))
        assert back["w"].device == torch.device("cuda:0")
        return
    data = on_cuda0(obj)  # a file recorded on cuda:0
    with pytest.raises(tensorcanon.DeviceUnavailableError, match=r'tensor \$\["w"\] was saved on cuda:0'):
        tensorcanon.loads(data)
    assert tensorcanon.loads(data, map_location="cpu")["w"].device.type == "cpu"
    assert tensorcanon.loads(data, map_location={"cuda:0": "cpu"})["w"].device.type == "cpu"


def test_dtypes():
    obj = {}
    for row in dtypes.BY_TORCH.values():
        raw = (torch.arange(6, dtype=torch.int64) % 2 if row.name == "bool" else torch.arange(6 * row.itemsize) % 251)
        obj[row.name] = raw.to(torch.uint8).view(row.torch) if row.name != "bool" else raw.bool()
    neg_zero_nan = torch.tensor([-0.0, struct.unpack(">d", bytes.fromhex("7ff800000000beef"))[0]])
    obj["bits"] = neg_zero_nan
    back = tensorcanon.loads(tensorcanon.dumps(obj))
    for k, v in obj.items():
        assert back[k].dtype == v.dtype
        assert bytes(back[k].view(torch.uint8).numpy()) == bytes(v.view(torch.uint8).numpy()), k


def test_numpy():
    obj = {"f": np.arange(6, dtype=np.float32).reshape(2, 3).T, "be": np.arange(3, dtype=">i4"),
           "s": np.float16(1.5), "u": np.uint64(2**64 - 1)}
    back = tensorcanon.loads(tensorcanon.dumps(obj))
    assert type(back["f"]) is np.ndarray and back["f"].flags.c_contiguous and back["f"].flags.writeable
    assert np.array_equal(back["f"], obj["f"])
    assert back["be"].dtype == np.dtype("<i4") and back["be"].tolist() == [0, 1, 2]
    assert type(back["s"]) is np.float16 and back["s"] == 1.5 and type(back["u"]) is np.uint64
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        _torch_round_trip({"f": obj["f"]})  # torch.load's safe mode refuses numpy arrays


@dataclasses.dataclass
class _Config:
    lr: float


def test_registered_types():
    tensorcanon.register(_Config, name="what_comes_back.Config")
    try:
        data = tensorcanon.dumps({"cfg": _Config(0.5)})
        assert tensorcanon.loads(data) == {"cfg": _Config(0.5)}
    finally:
        tensorcanon.unregister(_Config)
    with pytest.raises(tensorcanon.UnsupportedTypeError, match="not registered in this process"):
        tensorcanon.loads(data)


def test_python_values():
    nan = struct.unpack(">d", bytes.fromhex("7ff800000000beef"))[0]
    obj = [None, True, 10**5000, -0.0, nan, math.inf, 1 - 2j, "é", b"\x00", [1], (1,), {1}, frozenset({2})]
    back = tensorcanon.loads(tensorcanon.dumps(obj))
    assert [type(v) for v in back] == [type(v) for v in obj]
    assert back[2] == 10**5000 and math.copysign(1, back[3]) < 0
    assert struct.pack(">d", back[4]) == struct.pack(">d", nan)
    assert back[5:] == obj[5:]


def test_mmap_is_private(tmp_path):
    path = tmp_path / "f.safetensors"
    tensorcanon.save({"w": torch.zeros(8)}, path)
    before = path.read_bytes()
    tensorcanon.load(path, mmap=True)["w"].fill_(1.0)
    assert path.read_bytes() == before
    # torch's map is private by default too; MAP_SHARED is its opt-in, which tensorcanon does not have
    assert torch.serialization.get_default_mmap_options() == mmap.MAP_PRIVATE
    torch.save({"w": torch.zeros(8)}, tmp_path / "t.pt")
    torch.serialization.set_default_mmap_options(mmap.MAP_SHARED)  # (a plain function on torch 2.4)
    try:
        shared = torch.load(tmp_path / "t.pt", mmap=True, weights_only=True)["w"]
    finally:
        torch.serialization.set_default_mmap_options(mmap.MAP_PRIVATE)
    shared.fill_(1.0)
    del shared
    assert torch.equal(torch.load(tmp_path / "t.pt", weights_only=True)["w"], torch.ones(8))


def test_default_device_and_tensor_modes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    data = tensorcanon.dumps({"w": torch.arange(3.0)})
    with torch.device("meta"):
        back = tensorcanon.loads(data)
    assert back["w"].device.type == "cpu" and back["w"].tolist() == [0.0, 1.0, 2.0]
    with FakeTensorMode(), pytest.raises(tensorcanon.UsageError, match="FakeTensorMode"):
        tensorcanon.loads(data)


def test_efficient_zero_tensors():
    back = tensorcanon.loads(tensorcanon.dumps({"z": torch._efficientzerotensor(2, 3)}))
    assert torch.equal(back["z"], torch.zeros(2, 3)) and not back["z"]._is_zerotensor()
def test_skip_data(tmp_path):
    """Inside skip_data() (torch 2.5+) torch.save writes no tensor bytes; tensorcanon.save and dumps
    refuse, writing nothing, and what holds no tensor bytes (the meta skeleton the message advises,
    numpy arrays) is saved as always; load reads every byte. torch 2.4 has no skip_data: saving and
    loading are as always there (the check reads torch's setting only where it exists)."""
    state = {"w": torch.arange(6.0), "n": np.arange(3)}
    data = tensorcanon.dumps(state)
    skeleton = {"w": state["w"].to("meta"), "n": state["n"]}  # the message's advice
    no_bytes = [skeleton, {"n": state["n"]}, {"e": torch.zeros(0)}]
    expected = [tensorcanon.dumps(v) for v in no_bytes]
    skip_data = getattr(torch.serialization, "skip_data", None)
    if skip_data is None:
        assert torch.__version__ < (2, 5)
        assert tensorcanon.save(state, tmp_path / "a.safetensors") == tensorcanon.fingerprint(state)
        assert tensorcanon.loads(data)["w"].tolist() == list(range(6))
        return
    with skip_data():
        torch_file = io.BytesIO()
        torch.save({"w": state["w"]}, torch_file)
        path = tmp_path / "out" / "a.safetensors"
        path.parent.mkdir()
        buf = io.BytesIO()
        for write, call in [(lambda: tensorcanon.save(state, path), "tensorcanon.save"),
                            (lambda: tensorcanon.save(state, buf), "tensorcanon.save"),
                            (lambda: tensorcanon.dumps(state), "tensorcanon.dumps")]:
            with pytest.raises(tensorcanon.UsageError) as refused:
                write()
            message = str(refused.value)
            assert message.startswith(f"{call} was called inside torch.serialization.skip_data()")
            assert 'the tensor at $["w"] holds 24 bytes' in message and "v.to('meta')" in message
        assert list(path.parent.iterdir()) == [] and buf.getvalue() == b""  # nothing written, no temp file
        assert [tensorcanon.dumps(v) for v in no_bytes] == expected
        back = tensorcanon.loads(data)
        from_other_thread = _in_thread(lambda: tensorcanon.dumps(state))  # skip_data is per thread
    torch_file.seek(0)
    assert torch.equal(torch.load(torch_file, weights_only=True)["w"], torch.zeros(6))  # torch wrote no bytes
    assert back["w"].tolist() == list(range(6)) and back["n"].tolist() == [0, 1, 2]
    assert from_other_thread == data
    assert tensorcanon.dumps(state) == data  # and after it, as always
    meta = tensorcanon.loads(tensorcanon.dumps(skeleton))["w"]
    assert meta.is_meta and meta.shape == (6,) and meta.dtype is torch.float32


def _in_thread(call):
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(call).result()


def test_sparse_tensors():
    s = torch.sparse_coo_tensor(torch.tensor([[0, 0, 2]]), torch.tensor([1.0, 2.0, 3.0]), (4,))
    p = torch.nn.Parameter(torch.eye(3).to_sparse_csr(), requires_grad=False)
    back = tensorcanon.loads(tensorcanon.dumps({"s": s, "again": s, "p": p}))
    assert not back["s"].is_coalesced() and back["s"] is back["again"]  # as it was (issue 37), as torch keeps it
    assert torch.equal(back["s"]._indices(), s._indices()) and torch.equal(back["s"]._values(), s._values())
    assert torch.equal(back["s"].to_dense(), torch.tensor([3.0, 0.0, 3.0, 0.0]))
    assert not _torch_round_trip(s).is_coalesced()
    assert type(back["p"]) is torch.nn.Parameter and back["p"].layout is torch.sparse_csr
    assert torch.equal(back["p"].to_dense(), torch.eye(3)) and not back["p"].requires_grad


def test_nested_tensors():
    parts = [torch.ones(1, 2), torch.arange(4.0).reshape(2, 2)]
    for layout in (torch.strided, torch.jagged):
        back = tensorcanon.loads(tensorcanon.dumps(torch.nested.nested_tensor(parts, layout=layout)))
        assert back.is_nested and back.layout is layout
        assert all(torch.equal(a, b) for a, b in zip(back.unbind(), parts, strict=True))


def test_meta_tensors():
    m = torch.empty(2, 3, device="meta", dtype=torch.float16, requires_grad=True)
    back = tensorcanon.loads(tensorcanon.dumps({"a": m, "b": m}), map_location="cpu")
    assert back["a"].is_meta and back["a"].shape == (2, 3) and back["a"].dtype is torch.float16
    assert back["a"].requires_grad and back["a"] is not back["b"] and back["b"].is_meta
    assert _torch_round_trip(m).is_meta


def test_attributes_on_tensors():
    t = torch.ones(2)
    t.foo = {"step": 1}
    p = torch.nn.Parameter(torch.ones(1))
    p.tag = "x"
    back = tensorcanon.loads(tensorcanon.dumps({"t": t, "p": p}))
    assert back["t"].foo == {"step": 1} and back["p"].tag == "x" and type(back["p"]) is torch.nn.Parameter
    assert _torch_round_trip(t).foo == {"step": 1}  # torch keeps them too


def test_tensor_subclasses():
    from torch.testing._internal.two_tensor import TwoTensor

    x = TwoTensor(torch.ones(2), torch.zeros(2))
    with pytest.raises(tensorcanon.UnsupportedTypeError, match="register"):
        tensorcanon.dumps(x)
    tensorcanon.register(TwoTensor)
    try:
        back = tensorcanon.loads(tensorcanon.dumps(x))
        assert type(back) is TwoTensor and torch.equal(back.a, x.a) and torch.equal(back.b, x.b)
    finally:
        tensorcanon.unregister(TwoTensor)
