"""The GPU-aware path (cuda.py): round trips, digests equal to the CPU's, map_location to CUDA.

Every test needs a CUDA device and is skipped without one.
"""

import io

import pytest
import torch

import tensorcanon
from tensorcanon.format.tensorbytes import host_bytes
from tensorcanon.io import cuda

from support import requires_cuda

pytestmark = requires_cuda


def _state():
    g = torch.Generator().manual_seed(0)
    return {
        "big": torch.randn(3 * cuda.CHUNK // 4 + 123, generator=g),  # spans several staging chunks
        "w": torch.randn(64, 32, generator=g),
        "t": torch.randn(32, 64, generator=g).t(),  # not contiguous
        "c": torch.randn(8, dtype=torch.complex64, generator=g).conj(),  # lazy conjugate
        "b": torch.rand(100, generator=g) > 0.5,
        "h": torch.randn(7, generator=g).to(torch.bfloat16),
        "empty": torch.zeros(0, 3),
        "p": torch.nn.Parameter(torch.randn(5, generator=g)),
    }


def _to(obj, device):
    out = {}
    for k, v in obj.items():
        if isinstance(v, torch.nn.Parameter):
            out[k] = torch.nn.Parameter(v.detach().to(device), requires_grad=v.requires_grad)
        else:
            out[k] = v.to(device)
    return out


def test_cuda_bytes_and_digest_equal_cpu():
    cpu = _state()
    gpu = _to(cpu, "cuda")
    for k in cpu:
        assert tensorcanon.dumps({"x": cpu[k].detach()}) == tensorcanon.dumps({"x": gpu[k].detach().cpu()})
        chunks = b"".join(bytes(c) for c in cuda.host_chunks(gpu[k]))
        assert chunks == bytes(host_bytes(cpu[k], "tensor")), k


def test_cuda_round_trip(tmp_path):
    gpu = _to(_state(), "cuda")
    p = tmp_path / "g.st"
    d = tensorcanon.save(gpu, p)
    assert tensorcanon.verify(p) == d
    back = tensorcanon.load(p)
    for k, v in gpu.items():
        assert back[k].device.type == "cuda", k
        assert torch.equal(back[k], v), k
    assert type(back["p"]) is torch.nn.Parameter
    # A non-seekable target takes the two-pass path: same bytes.
    buf = io.BytesIO()
    tensorcanon.save(gpu, buf)
    assert buf.getvalue() == p.read_bytes()


def test_map_location_cuda_and_back(tmp_path):
    cpu = _state()
    p = tmp_path / "c.st"
    tensorcanon.save(cpu, p)
    on_gpu = tensorcanon.load(p, map_location="cuda")
    for k, v in cpu.items():
        assert on_gpu[k].device.type == "cuda"
        assert torch.equal(on_gpu[k].cpu(), v.detach()), k
    g = tmp_path / "g.st"
    tensorcanon.save(_to(cpu, "cuda"), g)
    on_cpu = tensorcanon.load(g, map_location="cpu")
    for k, v in cpu.items():
        assert on_cpu[k].device.type == "cpu" and torch.equal(on_cpu[k], v.detach()), k


def test_damaged_file_fails_on_the_gpu_path(tmp_path):
    p = tmp_path / "c.st"
    tensorcanon.save({"x": torch.ones(1000)}, p)
    raw = bytearray(p.read_bytes())
    raw[-1] ^= 1
    p.write_bytes(bytes(raw))
    with pytest.raises(tensorcanon.IntegrityError):
        tensorcanon.load(p, map_location="cuda")


def test_tensor_digest_is_device_independent():
    cpu = _state()
    gpu = _to(cpu, "cuda")
    # Same tensors in the same tree: the manifests differ only by the devices line,
    # which lives outside the manifest, so the file digest is the same.
    assert tensorcanon.fingerprint(cpu) == tensorcanon.fingerprint(gpu)
