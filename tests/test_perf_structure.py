"""Performance regression guards that check structure, never speed.

- saving holds no second copy of the checkpoint (peak RSS, measured in a subprocess);
- each tensor is hashed exactly once when saving to a seekable target, and
  once when loading with verification;
- contiguous CPU tensors are hashed and written straight from their own memory.
"""

import gc
import io
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch

import tensorcanon
from tensorcanon.format import digest
from tensorcanon.io import writer

MiB = 1 << 20
HANG_S = 120  # only a hang waits this long


class _CountingHasher:
    # Each hasher adds to its own slot: the writer's hash thread may still be feeding one tensor's
    # hasher after the main thread has made the next one.
    _lock = threading.Lock()

    def __init__(self, real, log):
        self.real, self.log = real, log
        with self._lock:
            self.slot = len(log)
            log.append(0)

    def update(self, data):
        self.log[self.slot] += memoryview(data).nbytes
        self.real.update(data)

    def digest(self):
        return self.real.digest()


def _count_hashing(monkeypatch):
    log: list[int] = []
    real = digest.constructor
    monkeypatch.setattr(digest, "constructor",
                        lambda algorithm: lambda prefix: _CountingHasher(real(algorithm)(prefix), log))
    return log


def _obj():
    return {"a": torch.randn(1000), "b": torch.randn(30, 40).t(), "c": np.arange(77, dtype=np.int32),
            "d": [torch.ones(3, dtype=torch.float16)], "e": torch.zeros(0)}


def test_each_tensor_hashed_once_when_saving_to_a_seekable_target(monkeypatch, tmp_path):
    obj = _obj()
    sizes = sorted([4000, 4800, 308, 6, 0])
    log = _count_hashing(monkeypatch)
    tensorcanon.save(obj, tmp_path / "x.st")
    assert sorted(log) == sizes
    log.clear()
    tensorcanon.save(obj, io.BytesIO())
    assert sorted(log) == sizes


def test_each_tensor_hashed_once_when_loading(monkeypatch, tmp_path):
    p = tmp_path / "x.st"
    tensorcanon.save(_obj(), p)
    log = _count_hashing(monkeypatch)
    tensorcanon.load(p)
    assert sorted(log) == sorted([4000, 4800, 308, 6, 0])
    log.clear()
    tensorcanon.load(p, verify=False)
    assert log == []


class _RecordingFile(io.BytesIO):
    """A seekable target that records the address of every buffer written to it."""

    def __init__(self):
        super().__init__()
        self.addresses = []

    def write(self, data):
        arr = np.frombuffer(data, dtype=np.uint8)
        self.addresses.append((arr.ctypes.data, arr.nbytes) if arr.nbytes else (0, 0))
        return super().write(data)


def test_contiguous_tensors_are_written_from_their_own_memory():
    # Tensors over 64 KiB go straight from their own memory to the file, 1 MiB at a time.
    obj = {f"t{i}": torch.randn(1 << 18) for i in range(4)}  # 1 MiB each
    obj["arr"] = np.ones(100_000, dtype=np.float64)
    f = _RecordingFile()
    tensorcanon.save(obj, f)
    written = set(f.addresses)
    for name, v in obj.items():
        ptr = v.data_ptr() if isinstance(v, torch.Tensor) else v.ctypes.data
        nbytes = v.numel() * v.element_size() if isinstance(v, torch.Tensor) else v.nbytes
        assert (ptr, nbytes) in written, f"{name} was copied before being written"


def test_small_tensors_are_written_a_mebibyte_at_a_time():
    # Small tensors are gathered into one buffer: a write call per MiB, not one per tensor.
    obj = {f"s{i:04d}": torch.full((256,), float(i)) for i in range(3000)}  # 3000 x 1 KiB
    f = _RecordingFile()
    tensorcanon.save(obj, f)
    assert len(f.addresses) <= 2 + 3000 * 1024 // (1 << 20) + 1  # header reserved, header, data
    assert f.getvalue() == tensorcanon.dumps(obj)


_MEM_CHILD = textwrap.dedent(r"""
    import os, resource, sys, torch, tensorcanon
    objs = {f"t{i:02d}": torch.empty(4 << 20, dtype=torch.float32).fill_(i) for i in range(16)}  # 256 MiB
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    tensorcanon.save(objs, os.path.join(sys.argv[1], "mem.st"))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print((peak - base) * 1024)
""")


def test_saving_holds_no_second_copy_of_the_checkpoint(tmp_path):
    out = subprocess.run([sys.executable, "-c", _MEM_CHILD, str(tmp_path)],
                         check=True, capture_output=True, text=True)
    extra = int(out.stdout.strip().splitlines()[-1])
    # A second copy would be >= 256 MiB; one tensor-sized copy would be 16 MiB.
    assert extra < 8 * MiB, f"saving 256 MiB raised peak RSS by {extra / MiB:.1f} MiB"
    assert (tmp_path / "mem.st").stat().st_size > 256 * MiB


def test_real_file_gets_the_same_bytes_with_large_and_small_tensors_mixed(tmp_path):
    # Large tensors are written in pieces, small ones whole: the file must equal dumps().
    g = torch.Generator().manual_seed(3)
    obj = {f"k{i:02d}": torch.rand(n, generator=g) for i, n in enumerate([600_000, 3, 400_000, 10, 300_000])}
    obj["z"] = torch.rand(5, generator=g, dtype=torch.float64)
    p = tmp_path / "m.st"
    with open(p, "wb") as f:
        d = tensorcanon.save(obj, f)
    assert p.read_bytes() == tensorcanon.dumps(obj)
    assert tensorcanon.verify(p) == d


def test_fast_byte_path_gives_the_general_paths_bytes(monkeypatch):
    # host_bytes takes a shortcut for contiguous CPU tensors numpy can view; it must give
    # exactly the bytes of the general path (which copies through reshape and view).
    from tensorcanon.format import tensorbytes

    g = torch.Generator().manual_seed(5)
    cases = [
        torch.rand(3, 4, generator=g), torch.tensor(2.5), torch.rand(4, 1, generator=g).t(),
        torch.nn.Parameter(torch.rand(5, generator=g)), torch.arange(6, dtype=torch.int16).reshape(2, 3),
        torch.randn(3, dtype=torch.complex64, generator=g), torch.arange(5, dtype=torch.uint8),
        torch.randn(2, 2, dtype=torch.float64, generator=g).requires_grad_(),
    ]
    fast = [bytes(tensorbytes.host_bytes(t, "tensor")) for t in cases]
    monkeypatch.setattr(tensorbytes, "numpy_viewable", frozenset)  # () -> frozenset(): no dtype takes the shortcut
    general = [bytes(tensorbytes.host_bytes(t, "tensor")) for t in cases]
    assert fast == general


def test_a_large_save_to_a_file_hashes_on_a_second_thread_with_the_same_bytes(tmp_path, monkeypatch):
    # Over 16 MiB to a real file, large tensors are hashed on a second thread while written:
    # same bytes as dumps(), every tensor hashed exactly once, on that thread.
    g = torch.Generator().manual_seed(4)
    obj = {f"t{i}": torch.rand(1 << 20, generator=g) for i in range(6)}  # 24 MiB
    obj["small"] = torch.ones(5)
    threads: set[str] = set()
    log = _count_hashing(monkeypatch)
    real_update = _CountingHasher.update

    def update(self, data):
        threads.add(threading.current_thread().name)
        real_update(self, data)

    monkeypatch.setattr(_CountingHasher, "update", update)
    p = tmp_path / "big.st"
    with open(p, "wb") as f:
        digest = tensorcanon.save(obj, f)
    assert sorted(log) == sorted([4 << 20] * 6 + [20])
    assert any(t.startswith("tensorcanon-hash") for t in threads)
    monkeypatch.undo()
    assert p.read_bytes() == tensorcanon.dumps(obj)
    assert tensorcanon.save(obj, tmp_path / "atomic.st") == digest
    assert (tmp_path / "atomic.st").read_bytes() == p.read_bytes()


def _big():
    g = torch.Generator().manual_seed(5)
    return {f"t{i}": torch.rand(1 << 20, generator=g) for i in range(6)}  # 24 MiB: hashed on the lane


def _hash_threads():
    return [t for t in threading.enumerate() if t.name.startswith("tensorcanon-hash")]


def test_the_hashing_thread_stays_at_most_two_tensors_behind(tmp_path, monkeypatch):
    # A hash slower than the write makes the writer wait: no more than two tensors (and so no more
    # than two copies of non-contiguous ones) are handed over and not yet hashed. The hash is made
    # slower than the write by events, not by sleeping: the hashing thread starts on tensor i only
    # once the writer has asked for room for tensor i + 2 (where it must wait) or handed over the
    # last one, so the lane is always as far behind as the writer lets it get.
    obj = {k: v.reshape(1024, 1024).t() for k, v in _big().items()}  # not contiguous: copied to write
    n = len(obj)
    state = threading.Condition()
    asked, handed, hashed, behind, overrun, stuck = [0], [0], [0], [], [], []
    real = digest.constructor

    class Held:
        def __init__(self, h):
            self.h = h

        def update(self, data):
            with state:
                if not state.wait_for(lambda: asked[0] >= hashed[0] + 3 or handed[0] == n, timeout=HANG_S):
                    stuck.append((asked[0], handed[0], hashed[0]))  # the writer waited for the lane too soon
            self.h.update(data)

        def digest(self):
            with state:
                hashed[0] += 1
            return self.h.digest()

    monkeypatch.setattr(digest, "constructor", lambda algorithm: lambda prefix: Held(real(algorithm)(prefix)))
    real_reserve, real_hash = writer._Lane.reserve, writer._Lane.hash

    def reserve(self):
        with state:  # the lane is held until `asked` grows: what is outstanding cannot change meanwhile
            full = handed[0] - hashed[0] >= 2
        if full and self._room.acquire(blocking=False):  # room while two are outstanding: the bound broken
            self._room.release()
            overrun.append(handed[0])
        with state:
            asked[0] += 1
            state.notify_all()
        real_reserve(self)

    def hash_(self, src, h, data):
        with state:
            handed[0] += 1
            behind.append(handed[0] - hashed[0])
            state.notify_all()
        real_hash(self, src, h, data)

    monkeypatch.setattr(writer._Lane, "reserve", reserve)
    monkeypatch.setattr(writer._Lane, "hash", hash_)
    made, alive = [0], []
    real_host_bytes = writer.host_bytes

    def host_bytes(value, kind):
        out = real_host_bytes(value, kind)
        made[0] += 1
        alive.append(made[0] - hashed[0])  # copies made and not yet hashed, this one included
        return out

    monkeypatch.setattr(writer, "host_bytes", host_bytes)
    with open(tmp_path / "slow.st", "wb") as f:
        tensorcanon.save(obj, f)
    monkeypatch.undo()
    assert stuck == [] and overrun == []
    assert behind == [1] + [2] * (n - 1)  # the held lane did fall behind, by two at most
    assert alive == [1] + [2] * (n - 1)  # a copy is made only once there is room for it on the lane
    assert (tmp_path / "slow.st").read_bytes() == tensorcanon.dumps(obj)
    assert _hash_threads() == []


def test_an_error_on_the_hashing_thread_fails_the_save_and_leaves_no_thread(tmp_path, monkeypatch):
    real = digest.constructor

    class Broken:
        def __init__(self, h):
            self.h = h

        def update(self, data):
            if memoryview(data).nbytes > 1 << 20:
                raise MemoryError("hash failed")
            self.h.update(data)

        def digest(self):
            return self.h.digest()

    monkeypatch.setattr(digest, "constructor", lambda algorithm: lambda prefix: Broken(real(algorithm)(prefix)))
    with open(tmp_path / "x.st", "wb") as f, pytest.raises(MemoryError, match="hash failed"):
        tensorcanon.save(_big(), f)
    assert _hash_threads() == []


def test_an_error_while_writing_waits_for_the_hashing_thread_and_is_the_one_raised(tmp_path, monkeypatch):
    real = writer._write_all
    calls = [0]

    def failing(f, data):
        calls[0] += 1
        if calls[0] == 4:  # the reserved header, then the third tensor
            raise OSError(28, "No space left on device")
        real(f, data)

    monkeypatch.setattr(writer, "_write_all", failing)
    with open(tmp_path / "x.st", "wb") as f, pytest.raises(OSError, match="No space left"):
        tensorcanon.save(_big(), f)
    assert _hash_threads() == []


def test_a_plan_hashes_with_the_algorithm_it_holds_now():
    # tensorcanon.dcp sets the logical plan's algorithm after planning: its hashers must follow.
    p = writer.plan({"w": torch.ones(3)})
    src = p.tensors[0]
    assert p.hasher(src).digest() == digest.tensor_hasher("float32", (3,), "xxh3-128").digest()
    p.algorithm = "sha256"
    assert p.hasher(src).digest() == digest.tensor_hasher("float32", (3,), "sha256").digest()


# ----------------------------------------------------------------- Python calls per element
# The speed of saving Python-heavy objects (benchmarks/python_objects.py) and of loading many small
# tensors comes from how few Python-level calls each element costs. Counted, not timed: the
# difference between N and 2N elements is the cost of N elements, whatever the fixed overhead.


def _python_calls(fn) -> int:
    """How many Python functions (frames) ``fn()`` enters; calls of C functions are not counted."""
    calls = 0

    def profile(frame, event, arg):
        nonlocal calls
        if event == "call":
            calls += 1

    old = sys.getprofile()
    collecting = gc.isenabled()
    gc.disable()  # (the collector's callbacks, and finalizers it runs, are Python calls too)
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(old)
        if collecting:
            gc.enable()
    return calls


def _per_element(make, run, n: int = 500) -> float:
    """Python calls per element of ``run(make(n))``, to within 0.05 (a stray call of another
    thread, or of a hook, counts too: a few in 500 elements are not a regression)."""
    a, b = make(n), make(2 * n)
    return round((_python_calls(lambda: run(b)) - _python_calls(lambda: run(a))) / n, 1)


def _encode(obj):
    from tensorcanon.format.tree import Encoder

    return Encoder(256).encode(obj)


def test_encoding_leaves_in_bulk_costs_no_python_call_per_leaf():
    assert _per_element(lambda n: list(range(n)), _encode) == 0  # token ids
    assert _per_element(lambda n: [i / 7 for i in range(n)], _encode) == 0
    assert _per_element(lambda n: [f"w{i}\u0120" for i in range(n)], _encode) == 0
    assert _per_element(lambda n: {f"w{i}": i for i in range(n)}, _encode) == 0  # a vocabulary
    assert _per_element(lambda n: tuple(range(n)), _encode) == 0


def test_encoding_records_costs_one_python_call_per_record():
    """A list of dicts with the same str keys (a Trainer's log history): a ``records`` node
    (FORMAT.md §6.13), its key order remembered, its leaves written inline: no call per dict. A list
    of lists costs one call per inner list (its encoder), none per value."""
    def records(n):
        return [{"loss": 0.5, "grad_norm": 1.5, "learning_rate": 1e-4, "epoch": i / 10, "step": i}
                for i in range(n)]
    assert _per_element(records, _encode) == 0
    assert _per_element(lambda n: [[1, 2.0, "x"] for _ in range(n)], _encode) == 1
    # every other value still goes through encode(): a nested tensor is found, and named by its path
    from tensorcanon.format.tree import Encoder

    enc = Encoder(256)
    enc.encode([{"a": 1.0, "t": torch.zeros(1)}, ({"u": [torch.ones(1)]},)])
    assert [s.path for s in enc.tensors] == [(0, "t"), (1, 0, "u", 0)]


def test_the_checks_the_bulk_path_skips_still_apply():
    """Leaves checked in bulk: a big int is still written as one (not refused), a lone surrogate
    still refused, naming its path, as the value-by-value path does."""
    big = [0] * 20 + [2**64]
    assert tensorcanon.loads(tensorcanon.dumps(big)) == big
    with pytest.raises(tensorcanon.UnsupportedTypeError, match=r"\$\[20\]"):
        tensorcanon.dumps(["a"] * 20 + ["\ud800"])
    with pytest.raises(tensorcanon.UnsupportedTypeError, match=r'\$\["k"\]'):
        tensorcanon.dumps({f"w{i}": i for i in range(20)} | {"k": "\ud800"})


def test_loading_small_tensors_costs_a_bounded_number_of_python_calls_per_tensor():
    """Loading many small tensors (benchmarks/compare.py's 'load small tensors'): each costs its
    table row's checks, its tree node's, its hash; no more (7, and a fraction per run of them: at
    c9b3b59 14, at 7c8aba2 16, with the DType.torch descriptor and the copy helper in the loop)."""
    def saved(n):
        return tensorcanon.dumps({f"s{i:05d}": torch.ones(4) for i in range(n)})
    per = _per_element(saved, tensorcanon.loads)
    assert per <= 7.2, per


def test_the_small_tensor_run_makes_cpu_tensors_whatever_the_default_device():
    """The run's inline copy gives torch.empty its device: under ``with torch.device("meta")`` a
    tensor made on the default device would have no memory to copy into."""
    data = tensorcanon.dumps({"a": torch.arange(3.0), "b": torch.arange(4), "p": torch.nn.Parameter(torch.ones(2))})
    with torch.device("meta"):
        out = tensorcanon.loads(data)
    assert {k: v.device.type for k, v in out.items()} == {"a": "cpu", "b": "cpu", "p": "cpu"}
    assert torch.equal(out["a"], torch.arange(3.0)) and torch.equal(out["b"], torch.arange(4))
    assert type(out["p"]) is torch.nn.Parameter and out["p"].requires_grad
