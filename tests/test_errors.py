"""Every failure raises the library's own exception, naming what and where."""

import base64
import collections
import json
import struct

import numpy as np
import pytest
import torch

import tensorcanon as tc

from support import on_cuda0

# --------------------------------------------------------------- unsupported values

class Opaque:
    pass


class MyTensor(torch.Tensor):
    pass


class MyDict(dict):
    pass


def sparse():
    s = torch.eye(3).to_sparse()
    s.note = print
    return s


def _with_attribute(value):
    t = torch.ones(2)
    t.hook = value
    return t


def cycle():
    a = []
    a.append(a)
    return a


@pytest.mark.parametrize("value, where, words", [
    ({"model": {"x": Opaque()}}, '$["model"]["x"]', ["Opaque", "register"]),
    ({"q": torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)}, '$["q"]', ["quantized"]),
    ({"s": [sparse()]}, '$["s"][0]["note"]', ["function", "builtins.print"]),  # an attribute (§6.12)
    ({"p": torch.nn.Parameter(torch.nested.nested_tensor([torch.ones(1)]))}, '$["p"]', ["nested", "p.detach()"]),
    ({"u": torch.nn.parameter.UninitializedParameter()}, '$["u"]', ["UninitializedParameter", "forward"]),
    ({"t": _with_attribute(print)}, '$["t"]["hook"]', ["function", "builtins.print"]),
    ({"sub": torch.ones(2).as_subclass(MyTensor)}, '$["sub"]', ["subclass", "MyTensor"]),
    ({"dd": collections.defaultdict(lambda: [])}, '$["dd"]', ["defaultdict", "<lambda>"]),
    ({"d": MyDict(a=1)}, '$["d"]', ["MyDict"]),
    ({"k": {torch.ones(1): 1}}, '$["k"]', ["Tensor", "key"]),
    ({"s": {Opaque()}}, '$["s"]', ["Opaque"]),
    ({"txt": ["ok", "bad \ud800"]}, '$["txt"][1]', ["surrogate"]),
    ({"fn": print}, '$["fn"]', ["function", "builtins.print", "code"]),
    ({"fn": lambda x: x}, '$["fn"]', ["lambda", "code", "name or settings"]),
    ({"cls": Opaque}, '$["cls"]', ["class", "Opaque", "code"]),
    ({"mod": collections}, '$["mod"]', ["module", "collections"]),
    ({"model": torch.nn.Linear(2, 2)}, '$["model"]', ["Linear", "torch.nn.Module", "state_dict()"]),
    ({"loss": torch.nn.CrossEntropyLoss()}, '$["loss"]', ["CrossEntropyLoss", "state_dict()"]),
    ({"opt": torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)}, '$["opt"]',
     ["SGD", "optimizer", "state_dict()"]),
    ({"sched": torch.optim.lr_scheduler.StepLR(
        torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1), 1)}, '$["sched"]',
     ["StepLR", "scheduler", "state_dict()"]),
    ({"scaler": torch.amp.GradScaler("cpu")}, '$["scaler"]', ["GradScaler", "state_dict()"]),
    ({"np": np.zeros(1, dtype="V4")}, '$["np"]', ["dtype"]),
    ({"np": np.array([1], dtype=object)}, '$["np"]', ["dtype"]),
])
def test_unsupported_values_name_their_path_and_type(value, where, words):
    with pytest.raises(tc.UnsupportedTypeError) as info:
        tc.dumps(value)
    assert isinstance(info.value, TypeError) and isinstance(info.value, tc.TensorCanonError)
    assert info.value.path == where
    msg = str(info.value)
    assert where in msg
    for w in words:
        assert w in msg, (w, msg)
    with pytest.raises(tc.UnsupportedTypeError):
        tc.fingerprint(value)


def test_cycles_hit_the_depth_limit():
    with pytest.raises(tc.LimitError) as info:
        tc.dumps({"a": cycle()})
    assert "max_depth" in str(info.value) and info.value.path.startswith('$["a"][0][0]')
    assert info.value.limit == "max_depth" and "to save and to every load" in str(info.value)
    d = {}
    d["self"] = d
    with pytest.raises(tc.LimitError, match="cycle"):
        tc.dumps(d)


def test_metadata_must_be_a_str_keyed_dict_without_tensors():
    with pytest.raises(tc.UnsupportedTypeError):
        tc.dumps(1, metadata={1: "x"})
    with pytest.raises(tc.UnsupportedTypeError, match="metadata"):
        tc.dumps(1, metadata={"t": torch.ones(1)})


# --------------------------------------------------------------- malformed files

def split(data: bytes):
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:], n


def join(header_text: bytes, body: bytes) -> bytes:
    return struct.pack("<Q", len(header_text)) + header_text + body


GOOD = tc.dumps({"model": {"fc.weight": torch.arange(6.0).reshape(2, 3), "fc.bias": torch.ones(2)}, "step": 4})


def test_truncated_files_name_the_offset():
    for cut in (0, 4, 8, 20, len(GOOD) - 30, len(GOOD) - 1):
        with pytest.raises(tc.FormatError) as info:
            tc.loads(GOOD[:cut])
        assert isinstance(info.value, ValueError)
        assert info.value.offset is not None and f"at byte {info.value.offset}" in str(info.value)


def test_truncated_file_on_disk(tmp_path):
    p = tmp_path / "t.safetensors"
    p.write_bytes(GOOD[:-5])
    with pytest.raises(tc.FormatError, match="byte"):
        tc.load(p)
    with pytest.raises(tc.FormatError):
        tc.verify(p)


def test_wrong_header_length():
    _, _, n = split(GOOD)
    for bad in (n + 8, n - 8, 1, 2**40):
        data = struct.pack("<Q", bad) + GOOD[8:]
        with pytest.raises(tc.FormatError) as info:
            tc.loads(data)
        assert info.value.offset is not None


def test_trailing_bytes_are_rejected():
    with pytest.raises(tc.FormatError):
        tc.loads(GOOD + b"\0")


def test_non_canonical_header_is_rejected():
    header, body, n = split(GOOD)
    for text in (json.dumps(header, indent=1).encode(),                      # not compact
                 json.dumps(header, sort_keys=False, separators=(",", ":")).encode(),
                 json.dumps(dict(reversed(list(header.items()))), separators=(",", ":")).encode()):
        padded = text + b" " * (-len(text) % 8)
        if padded == GOOD[8:8 + n]:
            continue
        with pytest.raises(tc.FormatError):
            tc.loads(join(padded, body))
    # padding with something other than spaces, or the wrong amount
    raw = GOOD[8:8 + n].rstrip(b" ")
    with pytest.raises(tc.FormatError):
        tc.loads(join(raw + b" " * (-len(raw) % 8 + 8), body))


def with_metadata(data: bytes, **changes) -> bytes:
    header, body, _ = split(data)
    header["__metadata__"].update(changes)
    text = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    return join(text + b" " * (-len(text) % 8), body)


def test_bad_manifests_are_format_errors():
    meta = split(GOOD)[0]["__metadata__"]
    raw = base64.b64decode(meta["tensorcanon.manifest"])
    cases = {
        "not base64": "!!!!",
        "not msgpack": base64.b64encode(b"\xc1\xc1\xc1").decode(),
        "not a map": base64.b64encode(b"\x90").decode(),
        "truncated": base64.b64encode(raw[:-3]).decode(),
    }
    for why, text in cases.items():
        with pytest.raises(tc.FormatError, match="manifest") as info:
            tc.loads(with_metadata(GOOD, **{"tensorcanon.manifest": text}))
        assert isinstance(info.value, ValueError), why
    with pytest.raises(tc.FormatError, match="manifest"):
        tc.loads(with_metadata(GOOD, format="tf"))


def test_flipped_tensor_byte_names_the_tensor_path():
    _, body, n = split(GOOD)
    header = split(GOOD)[0]
    begin = header["model.fc.weight"]["data_offsets"][0]
    pos = 8 + n + begin + 5
    data = bytearray(GOOD)
    data[pos] ^= 0x01
    for call in (tc.loads, tc.verify):
        with pytest.raises(tc.IntegrityError) as info:
            call(bytes(data))
        assert info.value.path == '$["model"]["fc.weight"]'
        assert '$["model"]["fc.weight"]' in str(info.value) and "damaged" in str(info.value)
    # verify=False skips the check (and loads the damaged value)
    out = tc.loads(bytes(data), verify=False)
    assert not torch.equal(out["model"]["fc.weight"], torch.arange(6.0).reshape(2, 3))


def test_manifest_digest_mismatch_is_an_integrity_error():
    other = tc.fingerprint({"x": 1})
    with pytest.raises(tc.IntegrityError) as info:
        tc.loads(with_metadata(GOOD, **{"tensorcanon.digest": other}))
    assert other in str(info.value)
    with pytest.raises(tc.IntegrityError):
        tc.verify(GOOD, expect=other)


def test_a_file_that_is_not_safetensors():
    for junk in (b"", b"PK\x03\x04" + bytes(100), b"\x80\x02}q\x00." + bytes(16)):
        with pytest.raises(tc.FormatError):
            tc.loads(junk)


# --------------------------------------------------------------- devices

@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_tensor_recorded_on_missing_cuda_suggests_map_location():
    obj = {"model": {"fc.weight": torch.arange(4.0)}, "n": 1}
    data = on_cuda0(obj)
    assert tc.verify(data) == tc.fingerprint(obj)  # the device is not part of the digest
    with pytest.raises(tc.DeviceUnavailableError) as info:
        tc.loads(data)
    assert "map_location" in str(info.value) and "cuda:0" in str(info.value)
    assert info.value.path == '$["model"]["fc.weight"]' and info.value.device == "cuda:0"
    expect = torch.arange(4.0)
    for ml in ("cpu", torch.device("cpu"), {"cuda:0": "cpu"}, lambda t, dev: t,
               lambda t, dev: None if dev == "cpu" else t.clone()):
        out = tc.loads(data, map_location=ml)
        assert torch.equal(out["model"]["fc.weight"], expect) and out["model"]["fc.weight"].device.type == "cpu"
    with pytest.raises(tc.DeviceUnavailableError):
        tc.loads(data, map_location={"cuda:1": "cpu"})  # does not cover cuda:0
    with pytest.raises(TypeError):
        tc.loads(data, map_location=3)


def test_map_location_forms_on_cpu_files():
    data = tc.dumps({"w": torch.arange(3.0), "a": np.arange(3)})
    seen = []

    def fn(t, dev):
        seen.append(dev)
        return t * 2

    out = tc.loads(data, map_location=fn)
    assert seen == ["cpu"] and torch.equal(out["w"], torch.arange(3.0) * 2)
    assert isinstance(out["a"], np.ndarray)  # arrays are never moved
    for ml in ("cpu", torch.device("cpu"), {"cpu": "cpu"}, {}):
        assert torch.equal(tc.loads(data, map_location=ml)["w"], torch.arange(3.0))
    with pytest.raises(TypeError, match="map_location"):
        tc.loads(data, map_location=lambda t, dev: "nope")


def test_bad_arguments_raise_the_library_usage_error():
    # Argument mistakes are tensorcanon's own UsageError, which is also a ValueError and a
    # TypeError, so callers catching either built-in keep working.
    cases = [
        lambda: tc.loads(tc.dumps({"t": torch.ones(1)}), map_location=3.5),
        lambda: tc.load(12345),
        lambda: tc.diff({}, {}, atol=-1),
        lambda: tc.seed_everything(-1),
        lambda: tc.register(42),
        lambda: tc.ResumableSampler(range(3), seed=-5),
    ]
    for call in cases:
        with pytest.raises(tc.UsageError) as info:
            call()
        assert isinstance(info.value, ValueError) and isinstance(info.value, TypeError)
        assert isinstance(info.value, tc.TensorCanonError)


def test_save_to_something_it_cannot_write_to_is_a_usage_error(tmp_path):
    """A bytes path, a number, None, a file opened for reading: tensorcanon's UsageError naming
    what it was given, before anything is planned or written (bytes took the file-object path and
    raised AttributeError: 'bytes' object has no attribute 'write')."""
    obj = {"t": torch.ones(2)}
    readonly = tmp_path / "r.bin"
    readonly.write_bytes(b"")
    with open(readonly, "rb") as r:
        for target, words in ((b"/tmp/x.safetensors", "bytes"), (12345, "int"), (None, "NoneType"),
                              (r, "BufferedReader")):
            with pytest.raises(tc.UsageError, match=words) as info:
                tc.save(obj, target)
            assert "a path" in str(info.value) and isinstance(info.value, tc.TensorCanonError)
    assert "tensorcanon.dumps" in str(pytest.raises(tc.UsageError, tc.save, obj, b"x").value)
    assert readonly.read_bytes() == b""
    store = tc.Store(tmp_path / "s")
    store.save("a", obj)
    for target in (str(tmp_path / "x").encode(), 12345, None):  # (Store.export: a path or a URL)
        with pytest.raises(tc.UsageError, match=f"not {type(target).__name__}"):
            store.export("a", target)


# ---------------------------------------------------------------- files, devices, load arguments


def test_a_missing_file_is_a_library_error_and_a_file_not_found_error(tmp_path):
    missing = tmp_path / "nope.safetensors"
    for call in (tc.load, tc.verify, tc.read_metadata, tc.open):
        with pytest.raises(tc.MissingFileError) as info:
            call(missing)
        assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, tc.TensorCanonError)
        assert info.value.filename == str(missing) and "no such file" in str(info.value)


def test_saving_into_a_missing_folder_names_the_users_path(tmp_path):
    target = tmp_path / "runs" / "ckpt.safetensors"
    with pytest.raises(tc.MissingFileError) as info:
        tc.save({"w": torch.ones(1)}, target)
    assert isinstance(info.value, FileNotFoundError)
    assert str(target) in str(info.value) and "does not exist" in str(info.value)
    assert "tensorcanon-tmp" not in str(info.value)  # never the temporary file's name
    with pytest.raises(tc.FileAccessError, match="is a directory"):
        tc.save({"w": torch.ones(1)}, tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_device_error_blames_map_location_when_it_chose_the_device():
    data = tc.dumps({"w": torch.ones(2)})
    with pytest.raises(tc.DeviceUnavailableError) as info:
        tc.loads(data, map_location="cuda:0")
    msg = str(info.value)
    assert "map_location sends tensor $[\"w\"] (saved on cpu) to cuda:0" in msg
    assert info.value.device == "cuda:0" and info.value.path == '$["w"]'
    with pytest.raises(tc.DeviceUnavailableError, match="map_location sends"):
        tc.loads(data, map_location={"cpu": "cuda:1"})


def test_weights_only_is_accepted_as_torch_load_takes_it():
    data = tc.dumps({"w": torch.ones(2)})
    assert torch.equal(tc.loads(data, weights_only=True)["w"], torch.ones(2))
    with pytest.warns(UserWarning, match="never unpickles"):
        assert torch.equal(tc.loads(data, weights_only=False)["w"], torch.ones(2))
    with pytest.raises(tc.UsageError, match="weights_only"):
        tc.loads(data, weights_only="yes")


def test_every_error_survives_pickling_with_its_attributes():
    """Errors cross process boundaries (torch.distributed.checkpoint pickles a failing rank's
    exception to the others): each class comes back with its message and attributes."""
    import pickle

    from tensorcanon.format import errors
    from tensorcanon.sharded import errors as sharded_errors

    made = [
        errors.FormatError("bad header", offset=8),
        errors.LimitError("too deep", limit="max_depth", path='$["a"]', saving=True),
        errors.IntegrityError("damaged", path='$["w"]', expected="a", actual="b"),
        errors.UnsupportedTypeError("no", path="$"),
        errors.DeviceUnavailableError("no gpu", path='$["w"]', device="cuda:0"),
        errors.UnsupportedAlgorithmError("md5?", algorithm="md5"),
        errors.UsageError("bad argument"),
        errors.FileAccessError("cannot read 'x'", filename="x", errno=13),
        errors.MissingFileError("cannot read 'y': no such file", filename="y", errno=2),
        sharded_errors.CheckpointNotFoundError("no index", filename="d"),
        sharded_errors.ReplicaMismatchError("differs", path='$["step"]'),
        sharded_errors.CheckpointError("dcp failed"),
    ]
    for e in made:
        back = pickle.loads(pickle.dumps(e))
        assert type(back) is type(e) and str(back) == str(e) and back.args == e.args
        assert back.__dict__ == e.__dict__
        if isinstance(e, OSError):
            assert (back.errno, back.filename) == (e.errno, e.filename)
