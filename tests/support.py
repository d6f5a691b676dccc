"""Helpers shared by test modules (conftest.py holds only fixtures: a module named conftest
exists in several test folders, so importing from it would pick one at random).

Helper scripts that run in a fresh interpreter import it too: their launchers put this folder on
PYTHONPATH (integrations/integration_support.run_script, dcp/spawn.launch)."""

import contextlib
import io
import os
import pickle
import random
import socket
import subprocess
import threading
import time

import numpy as np
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


# ------------------------------------------------------------------------- processes and threads


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(runs, timeout: float) -> list:
    """Start one process per ``(argv, env, log_path)`` of ``runs``, its stdout and stderr going to
    that log file, and wait for them all: at most ``timeout`` seconds together (a bound against a
    hang, such as a rank stuck in a collective), after which those still running are killed (by
    their pids). Their exit statuses, in order; None for one killed at the deadline."""
    procs: list = []
    try:
        for argv, env, log_path in runs:
            log = open(log_path, "w")
            try:
                procs.append((subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT), log))
            except BaseException:
                log.close()
                raise
        deadline = time.monotonic() + timeout
        codes: list = []
        for p, _ in procs:
            try:
                codes.append(p.wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        return codes
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()


def within(seconds: float, fn, *args):
    """``fn(*args)`` run on a daemon thread: what it returns, or what it raises; fails the test if it
    is still running after ``seconds`` (left behind, not waited for). A bound against a hang or
    runaway work, set far above what the call takes: never a measure of speed."""
    out: dict = {}

    def target() -> None:
        try:
            out["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed back to the test's thread
            out["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        name = getattr(fn, "__name__", fn)
        pytest.fail(f"{name} still running after {seconds} s (a hang, or far more work than it should take)")
    if "error" in out:
        raise out["error"]
    return out.get("value")


@contextlib.contextmanager
def no_unpickling(when: str = "while loading"):
    """Inside, torch.load and every way to unpickle raise AssertionError: a load path that still
    uses one fails the test. (DataLoader workers and torch.distributed's object collectives are
    unaffected: they bound their own references to pickle when they were imported.)"""

    def refuse(*args, **kwargs):
        raise AssertionError(f"torch.load / pickle was called {when}")

    class RefusingUnpickler:  # a class, so that code subclassing pickle.Unpickler still imports
        def __init__(self, *args, **kwargs):
            refuse()

    patched = {(torch, "load"): refuse, (torch.serialization, "load"): refuse, (pickle, "load"): refuse,
               (pickle, "loads"): refuse, (pickle, "Unpickler"): RefusingUnpickler}
    saved = {where: getattr(*where) for where in patched}
    for (module, name), value in patched.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for (module, name), value in saved.items():
            setattr(module, name, value)


# ------------------------------------------------------------------------- the command line


def run_cli(*argv: str, cwd=None, stderr=None) -> tuple[int, str, str]:
    """``tensorcanon ARGV`` run in this process (tensorcanon.tools.cli.main), in ``cwd`` when given:
    (exit status, stdout, stderr). ``stderr``: a stream to write it to instead (a fake terminal);
    what it holds is returned."""
    from tensorcanon.tools import cli

    out, err = io.StringIO(), stderr if stderr is not None else io.StringIO()
    here = os.getcwd()
    if cwd is not None:
        os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main([os.fspath(a) for a in argv])
    finally:
        os.chdir(here)
    return code, out.getvalue(), err.getvalue()


# ------------------------------------------------------------------------- files and streams


class WriteOnlyStream(io.RawIOBase):
    """A write-only stream that cannot seek or tell (a pipe, a socket); ``data`` is what it got."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def write(self, b) -> int:
        self.chunks.append(bytes(b))
        return len(self.chunks[-1])

    def tell(self) -> int:
        raise io.UnsupportedOperation("tell")

    @property
    def data(self) -> bytes:
        return b"".join(self.chunks)


def on_cuda0(obj) -> bytes:
    """Bytes of ``obj`` saved on the CPU, with its tensors recorded as if they were on cuda:0.

    Devices are outside every digest, so only the header's device record changes."""
    from tensorcanon.io import writer

    p = writer.plan(obj)
    buf = io.BytesIO()
    writer.write(p, buf)
    old_header, _ = p.header()
    for s in p.tensors:
        s.device = "cuda:0"
    new_header, _ = p.header()
    return new_header + buf.getvalue()[len(old_header):]


def fail_at_tensor(monkeypatch: pytest.MonkeyPatch, n: int, error: BaseException) -> list:
    """Make a save raise ``error`` when it comes to the bytes of its ``n``-th tensor (1-based; by
    then the target holds the ones before it); the kinds of the tensors it came to."""
    from tensorcanon.io import writer

    calls: list = []
    real = writer.host_bytes

    def failing(value, kind):
        calls.append(kind)
        if len(calls) == n:
            raise error
        return real(value, kind)

    monkeypatch.setattr(writer, "host_bytes", failing)
    return calls


# ------------------------------------------------------------------------- random streams and data


def global_random_states() -> tuple:
    """The process's global random states: Python's, numpy's legacy one, torch's CPU one."""
    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def same_random_states(a: tuple, b: tuple) -> bool:
    """True when two :func:`global_random_states` are the same."""
    return (a[0] == b[0] and len(a[1]) == len(b[1])
            and all(np.array_equal(x, y) for x, y in zip(a[1], b[1], strict=True))
            and torch.equal(a[2], b[2]))


def seeded_batches(dataset, seed: int, *, bs: int = 4, epochs: int = 2, workers: int = 0, persistent: bool = False,
                   stop: int | None = None, state: dict | None = None, collate_fn=None) -> tuple[list, dict | None]:
    """The batches of ``epochs`` epochs of ``SeededDataset(dataset)`` through a ResumableSampler of
    ``seed`` (``sampler.track``), or the first ``stop`` batches and the sampler's state there:
    ``(batches, state or None)``. With ``state``, resume from such a state."""
    from torch.utils.data import DataLoader

    import tensorcanon

    s = tensorcanon.ResumableSampler(range(len(dataset)), seed=seed)
    if state is not None:
        s.load_state_dict(state)
    loader = DataLoader(tensorcanon.SeededDataset(dataset, s), batch_size=bs, sampler=s, collate_fn=collate_fn,
                        num_workers=workers, persistent_workers=persistent and workers > 0, generator=s.generator)
    out = []
    while s.epoch < epochs:
        for batch in s.track(loader):
            out.append(batch)
            if len(out) == stop:
                return out, s.state_dict()
    return out, None
