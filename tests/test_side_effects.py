"""Saving a tensor leaves it as it was, and a loaded tensor is an ordinary tensor.

numpy marks the memory of a tensor it views (``t.numpy()``) as not resizable, for good: a save that
viewed the caller's tensors that way broke a later ``storage.resize_(0)`` (FSDP2 frees a parameter's
memory so), and a load that filled its tensors that way returned tensors ``torch.load``'s can do more
with. Every dtype family takes its own path through format/tensorbytes.py, so each is checked.
"""

from __future__ import annotations

import io

import pytest
import torch

import tensorcanon as tc


# One tensor per path through host_view / _canonical and empty_tensor / empty_buffer: a dtype numpy
# views, bool, a dtype numpy lacks (viewed as an int of its size), a non-contiguous view (copied),
# a tensor that requires grad, a large one (read straight into its own tensor) and a small one.
def _state() -> dict[str, torch.Tensor]:
    return {
        "float32": torch.arange(1000, dtype=torch.float32),
        "bool": torch.tensor([True, False, True]),
        "bfloat16": torch.arange(5, dtype=torch.bfloat16),
        "float8": torch.zeros(7, dtype=torch.float8_e4m3fn),
        "transposed": torch.arange(16, dtype=torch.float32).reshape(4, 4).t(),
        "grad": torch.ones(3, requires_grad=True),
        "large": torch.arange(1 << 20, dtype=torch.int32),
        "small": torch.arange(3, dtype=torch.int64),
    }


def _resizable(t: torch.Tensor) -> bool:
    storage = t.untyped_storage()
    try:
        storage.resize_(storage.nbytes())  # a no-op resize: allowed only on a resizable storage
    except RuntimeError as e:
        assert "not resizable" in str(e), e
        return False
    return True


@pytest.mark.parametrize("how", ["file object", "path", "dumps"])
def test_save_leaves_every_tensor_resizable(how: str, tmp_path) -> None:
    state = _state()
    assert all(_resizable(t) for t in state.values())
    if how == "file object":
        tc.save(state, io.BytesIO())
    elif how == "path":
        tc.save(state, tmp_path / "x.safetensors")
    else:
        tc.dumps(state)
    assert [k for k, t in state.items() if not _resizable(t)] == []
    state["large"].untyped_storage().resize_(0)  # what FSDP2 does to a parameter after its save
    assert state["large"].untyped_storage().nbytes() == 0


@pytest.mark.parametrize("how", ["load", "loads", "open"])
def test_loaded_tensors_are_resizable_and_equal(how: str, tmp_path) -> None:
    state = _state()
    path = tmp_path / "x.safetensors"
    tc.save(state, path)
    if how == "load":
        out = tc.load(path)
    elif how == "loads":
        out = tc.loads(path.read_bytes())
    else:
        with tc.open(path) as f:
            out = {k: f[k] for k in state}
    assert [k for k, t in out.items() if not _resizable(t)] == []
    for k, t in state.items():
        assert torch.equal(out[k].view(torch.uint8) if t.dtype == torch.float8_e4m3fn else out[k],
                           t.detach().view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t.detach()), k


@pytest.mark.parametrize("make", [lambda: torch.empty(0)[::2], lambda: torch.empty(0, dtype=torch.bfloat16)[::3],
                                  lambda: torch.empty(0, dtype=torch.bool)[::2], lambda: torch.empty(0, 3).t()])
def test_an_empty_view_of_any_stride_saves(make) -> None:
    # An empty tensor may keep a stride other than 1; viewing it as bytes failed with torch's
    # RuntimeError ("self.stride(-1) must be 1 to view ...") instead of saving its no bytes.
    t = make()
    out = tc.loads(tc.dumps({"t": t}))["t"]
    assert out.shape == t.shape and out.dtype == t.dtype
    assert tc.dumps({"t": t}) == tc.dumps({"t": torch.empty(t.shape, dtype=t.dtype)})
