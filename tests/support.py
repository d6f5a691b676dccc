"""Helpers shared by test modules (conftest.py holds only fixtures: a module named conftest
exists in several test folders, so importing from it would pick one at random)."""

import pytest
import torch

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def torch_dtype(name: str) -> torch.dtype:
    """``torch.<name>``; parametrize with :func:`have_dtypes` so that it exists."""
    dtype = getattr(torch, name)
    assert isinstance(dtype, torch.dtype), name
    return dtype


def have_dtypes(names: list[str]) -> list[str]:
    """The names of ``names`` that the running torch has as dtypes, for parametrizing.

    The floor, torch 2.4, has no float8_e8m0fnu, float4_e2m1fn_x2 or int1..int7: a test of
    such a dtype cannot run there (it is left out, not skipped), and what a file holding one
    does on such a torch (refused by name) is tested on its own (test_golden.py,
    test_vocabulary.py).
    """
    return [n for n in names if isinstance(getattr(torch, n, None), torch.dtype)]


def torch_dtypes(*names: str) -> list:
    """The named torch dtypes that the running torch has (for random sampling, where a dtype
    missing from an older torch is left out rather than skipping the whole test)."""
    return [d for d in (getattr(torch, n, None) for n in names) if isinstance(d, torch.dtype)]


def count_hashed_bytes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make every tensor hasher record the size of each piece it hashes; the list they append to.

    (Patched where every tensor hasher is made: ``tensorcanon.format.digest.constructor``; a reader
    opened before the call keeps the hashers it made.)
    """
    from tensorcanon.format import digest

    hashed: list[int] = []
    real = digest.constructor

    class Counting:
        def __init__(self, h):
            self.h = h

        def update(self, data):
            hashed.append(memoryview(data).nbytes)
            self.h.update(data)

        def digest(self):
            return self.h.digest()

    monkeypatch.setattr(digest, "constructor", lambda algorithm: lambda prefix: Counting(real(algorithm)(prefix)))
    return hashed
