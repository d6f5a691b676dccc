"""Closed vocabularies (docs/FORMAT.md §4.3-§4.5): dtype names, device text, requires_grad.

A file may name only the dtypes and device types the spec lists, spelled one
way; the checks do not ask torch, so every reader accepts the same files. A
name in the list that the reader's torch lacks is a clear error naming it.
"""

from __future__ import annotations

import io
import pathlib
import re

import numpy as np
import pytest
import torch

import tensorcanon
from tensorcanon.format import container, devices, dtypes, manifest
from tensorcanon.io import writer

import hostile_lib as h

# ------------------------------------------------------------------ dtype values


def test_every_listed_dtype_value_round_trips():
    # every one this torch has (an older torch lacks some: see the tests below)
    values = [getattr(torch, n) for n in dtypes.DTYPE_VALUE_NAMES if hasattr(torch, n)]
    assert len(values) >= 30
    assert tensorcanon.loads(tensorcanon.dumps(values)) == values


def test_the_list_is_torchs_list():
    """The list is torch 2.13's (docs/FORMAT.md §4.4): a newer torch's new dtypes need a spec
    update first; an older torch (2.4, the floor) has a subset of it."""
    have = {str(v).removeprefix("torch.") for v in vars(torch).values() if isinstance(v, torch.dtype)}
    assert have <= set(dtypes.DTYPE_VALUE_NAMES), "a torch with new dtypes needs a spec update first"
    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    if version >= (2, 13):
        assert have == set(dtypes.DTYPE_VALUE_NAMES)


@pytest.mark.parametrize("name", ["float128", "Float32", "torch.float32", "", "int"])
def test_a_dtype_name_outside_the_list_is_rejected(name):
    with pytest.raises(tensorcanon.FormatError, match="unknown torch dtype"):
        tensorcanon.loads(h.rerooted(tensorcanon.dumps({}), ["dtype", name]))


def test_a_listed_dtype_this_torch_lacks_is_named(monkeypatch):
    data = h.rerooted(tensorcanon.dumps([]), ["list", ["dtype", "float8_e8m0fnu"]])   # what a newer torch writes
    if "float8_e8m0fnu" in dtypes.TORCH_DTYPES_BY_NAME:
        assert tensorcanon.loads(data) == [torch.float8_e8m0fnu]
        monkeypatch.delitem(dtypes.TORCH_DTYPES_BY_NAME, "float8_e8m0fnu")  # as on an older torch
    with pytest.raises(tensorcanon.FormatError, match="torch.float8_e8m0fnu, which this torch"):
        tensorcanon.loads(data)


def test_a_tensor_of_a_dtype_this_torch_lacks_is_named(monkeypatch):
    if hasattr(torch, "float8_e8m0fnu"):
        data = tensorcanon.dumps({"w": torch.zeros(2, dtype=torch.float8_e8m0fnu)})
        row = dtypes.BY_NAME["float8_e8m0fnu"]
        monkeypatch.setitem(dtypes.BY_NAME, "float8_e8m0fnu", dtypes.DType(row.name, row.itemsize, row.st, None, None))
    else:  # an older torch (2.4, the floor) really lacks it: the golden file of such dtypes
        data = (pathlib.Path(__file__).parent / "golden" / "dtypes_u8.safetensors").read_bytes()
    with pytest.raises(tensorcanon.UnsupportedTypeError, match=r"(\w+), which this torch .* does not have") as e:
        tensorcanon.loads(data)
    named = re.search(r"(\w+), which this torch", str(e.value)).group(1)
    assert named == "float8_e8m0fnu" or not hasattr(torch, named)
    assert tensorcanon.verify(data)  # the file is valid: its bytes verify without such a torch


# ------------------------------------------------------------------ device text


def test_the_device_grammar_is_what_torch_prints():
    for kind in devices.DEVICE_TYPES:
        for text in (kind, f"{kind}:0", f"{kind}:9", f"{kind}:127"):
            assert devices.is_canonical(text)
            assert str(torch.device(text)) == text
    # torch's 8-bit index wraps: cuda:128 is printed cuda:-128, so the grammar stops at 127
    assert str(torch.device("cuda:128")) != "cuda:128" and not devices.is_canonical("cuda:128")


@pytest.mark.parametrize("text", ["cuda:01", "cuda:-1", "CUDA:0", "cuda: 0", "cuda:", "npu:0", "cuda:0:0",
                                  "cuda:١", ""])
def test_non_canonical_device_values_are_rejected(text):
    assert not devices.is_canonical(text)
    with pytest.raises(tensorcanon.FormatError, match="not canonical device text"):
        tensorcanon.loads(h.rerooted(tensorcanon.dumps({}), ["device", text]))


def test_device_values_round_trip():
    values = [torch.device("cpu"), torch.device("cuda"), torch.device("cuda", 3), torch.device("mps"),
              torch.device("meta"), torch.device("xla", 1)]
    assert tensorcanon.loads(tensorcanon.dumps(values)) == values


def _with_devices(text: str) -> bytes:
    """A file of two CPU tensors and one array whose devices text is ``text``."""
    p = writer.plan({"a": torch.ones(2), "b": torch.zeros(2), "n": np.arange(2)})
    buf = io.BytesIO()
    writer.write(p, buf)
    old, raw = p.header()
    meta = manifest.header_metadata(raw, ["cpu"] * 3, p.algorithm)
    meta[manifest.KEY_DEVICES] = text
    return container.build(p.layout, meta) + buf.getvalue()[len(old):]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_canonical_devices_text_is_read():
    with pytest.raises(tensorcanon.DeviceUnavailableError, match="saved on cuda:0"):
        tensorcanon.loads(_with_devices("0:cuda:0,1:xla:3"))
    out = tensorcanon.loads(_with_devices("0:cuda:0,1:xla:3"), map_location="cpu")
    assert torch.equal(out["a"], torch.ones(2))


@pytest.mark.parametrize("text, match", [
    ("", "is empty"),
    ("0:cpu", "not a device a tensor"),
    ("0:meta:0", "not a device a tensor"),
    ("0:cuda", "not a device a tensor"),
    ("0:cuda:128", "not one a file can record"),
    ("0:npu:0", "not one a file can record"),
    ("0:cuda:00", "not one a file can record"),
    ("1:cuda:0,0:cuda:0", "not in canonical form"),
    ("0:cuda:0,0:cuda:1", "not in canonical form"),
    ("00:cuda:0", "not in canonical form"),
    ("3:cuda:0", "malformed entry"),
    ("x:cuda:0", "malformed entry"),
    ("2:cuda:0", "numpy array"),
    ("0:cuda:0,", "malformed entry"),
])
def test_malformed_devices_text_is_rejected(text, match):
    with pytest.raises(tensorcanon.FormatError, match=match):
        tensorcanon.loads(_with_devices(text))


# ------------------------------------------------------------------ requires_grad


def test_torch_lets_only_floating_and_complex_tensors_require_grad():
    for row in dtypes.BY_NAME.values():
        if row.torch is None:
            continue
        t = torch.zeros(1, dtype=row.torch)
        if row.differentiable:
            t.requires_grad_(True)
        else:
            with pytest.raises(RuntimeError):
                t.requires_grad_(True)


@pytest.mark.parametrize("dtype", ["int64", "bool", "uint8"])
def test_requires_grad_on_a_non_floating_row_is_a_format_error(dtype):
    data = tensorcanon.dumps({"w": torch.zeros(2, dtype=getattr(torch, dtype))})
    m, header, body = h.manifest_of(data)
    m["tensors"][0]["requires_grad"] = True
    with pytest.raises(tensorcanon.FormatError, match=f"requires_grad true but dtype {dtype}"):
        tensorcanon.loads(h.rebuild(data, h.repack(m), header, body))


def test_requires_grad_round_trips_on_every_differentiable_dtype():
    obj = {n: torch.zeros(2, dtype=getattr(torch, n)).requires_grad_() for n in sorted(dtypes.DIFFERENTIABLE)
           if hasattr(torch, n)}  # an older torch (2.4, the floor) lacks some
    back = tensorcanon.loads(tensorcanon.dumps(obj))
    assert all(back[n].requires_grad and back[n].dtype == obj[n].dtype for n in obj)
