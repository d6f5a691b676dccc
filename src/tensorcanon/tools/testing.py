"""Assertions for tests: identical outputs, deterministic functions.

:func:`assert_identical` fails with the :func:`tensorcanon.diff` of its two
arguments, so the message says which tensor differs, where and by how much.
:func:`assert_deterministic` calls a function several times from the same
seed and fails, with the same kind of message, when the outputs' digests
differ. The pytest plugin (``tensor_snapshot`` fixture) lives in
:mod:`tensorcanon_pytest`.

Example::

    from tensorcanon.testing import assert_deterministic, assert_identical

    assert_identical(model.state_dict(), tensorcanon.load("expected.safetensors"))
    assert_deterministic(train_one_step, batch, runs=3, seed=1)
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .. import api
from ..format.errors import UnsupportedTypeError, UsageError
from ..io import reader
from .diff import diff

__all__ = ["assert_identical", "assert_deterministic"]


def assert_identical(a: Any, b: Any, *, atol: float = 0.0, rtol: float = 0.0, msg: str | None = None) -> None:
    """Fail unless ``a`` and ``b`` are identical (bit for bit by default), naming every difference.

    ``a`` is the expected value and ``b`` the actual one; either may be a file
    path (see :func:`tensorcanon.diff`). With ``atol``/``rtol`` tensors and
    numbers only need to be close. Without a tolerance the digests must match
    too, so two objects that tensorcanon would save differently never pass.

    Example::

        assert_identical({"w": torch.zeros(2)}, {"w": torch.zeros(2)})
    """
    result = diff(a, b, atol=atol, rtol=rtol)
    head = f"{msg}: " if msg else ""
    if result:
        raise AssertionError(f"{head}expected (A) and actual (B) differ:\n{result}")
    if atol or rtol or _is_path(a) or _is_path(b):
        return
    try:
        fa, fb = api.fingerprint(a), api.fingerprint(b)
    except UnsupportedTypeError:
        return  # not saveable: the structural comparison above is all there is
    if fa != fb:
        raise AssertionError(
            f"{head}expected (A) and actual (B) have no difference diff can name, but their digests "
            f"differ ({fa} and {fb}): they would be saved differently (for example tensors shared "
            "differently, or a registered type's state)"
        )


def _is_path(x: Any) -> bool:
    import os

    return isinstance(x, (str, os.PathLike))


def _seed_function() -> Callable[[int], Any] | None:
    import tensorcanon

    fn = getattr(tensorcanon, "seed_everything", None)
    if fn is None:
        try:
            from ..training.determinism import seed_everything as fn
        except ImportError:
            fn = None
    return fn


def _seed(seed: int) -> None:
    """Seed every generator, with tensorcanon.seed_everything when this version has it."""
    fn = _seed_function()
    if fn is not None:
        fn(seed)
        return
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


class _GlobalState:
    """The global RNG states and determinism switches, put back after the assertion."""

    def __init__(self) -> None:
        self.py = random.getstate()
        self.np = np.random.get_state()
        self.torch = torch.random.get_rng_state()
        cuda_in_use = torch.cuda.is_available() and torch.cuda.is_initialized()
        self.cuda = torch.cuda.get_rng_state_all() if cuda_in_use else None
        self.det = torch.are_deterministic_algorithms_enabled()
        self.det_warn = torch.is_deterministic_algorithms_warn_only_enabled()
        self.cudnn = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)

    def restore(self) -> None:
        random.setstate(self.py)
        np.random.set_state(self.np)
        torch.random.set_rng_state(self.torch)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        torch.use_deterministic_algorithms(self.det, warn_only=self.det_warn)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = self.cudnn


def assert_deterministic(fn: Callable[..., Any], *args: Any, runs: int = 2, seed: int = 0, **kwargs: Any) -> str:
    """Call ``fn(*args, **kwargs)`` ``runs`` times, each from ``seed``, and require equal outputs.

    Before each call every generator is seeded (``tensorcanon.seed_everything``
    where available, else Python's ``random``, numpy's global generator and
    torch's). Outputs are compared by their tensorcanon digest, so they must be
    saveable; on a mismatch the message is the diff between run 1 and the
    first run that differed. The callers' RNG states and torch determinism
    switches are restored afterwards. Returns the outputs' digest.

    Within one process this catches nondeterministic kernels, unseeded
    generators and state carried between calls; run the test in fresh
    processes (``tensorcanon repro``) to catch hash-seed or environment effects.

    Example::

        digest = assert_deterministic(lambda x: torch.nn.Linear(4, 2)(x), torch.ones(3, 4))
    """
    if runs < 2:
        raise UsageError(f"runs must be at least 2, got {runs}")
    name = getattr(fn, "__qualname__", None) or repr(fn)
    saved = _GlobalState()
    try:
        _seed(seed)
        first = fn(*args, **kwargs)
        data = api.dumps(first)  # a snapshot: later runs cannot change it in place
        expected = reader.open_file(data).digest
        assert expected is not None  # dumps writes a tensorcanon file, which records its digest
        for run in range(2, runs + 1):
            _seed(seed)
            out = fn(*args, **kwargs)
            got = api.fingerprint(out)
            if got != expected:
                result = diff(api.loads(data), out)
                detail = str(result) if result else (
                    f"no difference diff can name, but the digests differ ({expected} and {got})")
                raise AssertionError(
                    f"{name} is not deterministic: with seed={seed}, run 1 and run {run} of {runs} "
                    f"returned different outputs (A: run 1, B: run {run}):\n{detail}"
                )
        return expected
    finally:
        saved.restore()
