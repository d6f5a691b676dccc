"""Helpers shared by test modules (conftest.py holds only fixtures: a module named conftest
exists in several test folders, so importing from it would pick one at random)."""

import pytest
import torch

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def torch_dtype(name: str) -> torch.dtype:
    """``torch.<name>``, or skip the calling test where the running torch lacks that dtype (the
    floor, torch 2.4, has no float8_e8m0fnu, float4_e2m1fn_x2 or int1..int7)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        pytest.skip(f"torch {torch.__version__} has no torch.{name} (a later torch added it)")
    return dtype


def torch_dtypes(*names: str) -> list:
    """The named torch dtypes that the running torch has (for random sampling, where a dtype
    missing from an older torch is left out rather than skipping the whole test)."""
    return [d for d in (getattr(torch, n, None) for n in names) if isinstance(d, torch.dtype)]


def count_hashed_bytes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make every tensor hasher record the size of each piece it hashes; the list they append to.

    (Patched where the reader and the lazy index look it up: ``tensorcanon.digest.tensor_hasher``.)
    """
    from tensorcanon import digest

    hashed: list[int] = []
    real = digest.tensor_hasher

    class Counting:
        def __init__(self, h):
            self.h = h

        def update(self, data):
            hashed.append(memoryview(data).nbytes)
            self.h.update(data)

        def digest(self):
            return self.h.digest()

    monkeypatch.setattr(digest, "tensor_hasher", lambda *a: Counting(real(*a)))
    return hashed
