"""CUDA and NCCL variants: they skip cleanly on a machine without GPUs."""

from __future__ import annotations

import pytest
import torch

import tensorcanon
import tensorcanon.dcp as tcd

from helpers import zeros_like_state
from states import logical_digest, logical_state

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
requires_two_gpus = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.device_count() >= 2 and torch.distributed.is_nccl_available()),
    reason="needs 2 CUDA devices and NCCL",
)


def _to_cuda(state):
    if isinstance(state, torch.Tensor):
        return state.cuda()
    if isinstance(state, dict):
        out = type(state)((k, _to_cuda(v)) for k, v in state.items())
        if hasattr(state, "_metadata"):
            out._metadata = state._metadata
        return out
    if isinstance(state, list):
        return [_to_cuda(v) for v in state]
    if isinstance(state, tuple):
        return tuple(_to_cuda(v) for v in state)
    return state


@requires_cuda
def test_cuda_state_in_one_process(tmp_path):
    """Devices are placement: CUDA tensors give the CPU state's logical digest and files."""
    on_gpu = _to_cuda(logical_state())
    cpu_dir, gpu_dir = str(tmp_path / "cpu"), str(tmp_path / "gpu")
    assert tcd.save(on_gpu, gpu_dir) == logical_digest()
    tcd.save(logical_state(), cpu_dir)
    from helpers import rank_files

    assert rank_files(cpu_dir) == rank_files(gpu_dir)
    target = zeros_like_state(on_gpu)
    tcd.load(target, gpu_dir)
    assert target["model"]["layer.weight"].is_cuda
    assert tensorcanon.fingerprint(target) == logical_digest()
    full = tcd.load_unsharded(gpu_dir, map_location="cuda")
    assert full["model"]["layer.weight"].is_cuda


@requires_two_gpus
def test_nccl_two_ranks(tmp_path):
    from spawn import launch

    results = launch(2, "nccl", str(tmp_path), backend="cpu:gloo,cuda:nccl")
    assert [r["nccl_save_load"] for r in results] == [[True, True, True, "cuda"]] * 2
