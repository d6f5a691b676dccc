"""The hashing paths of issue 41 (item 3): what they do, checked by structure, never by speed.

- a large save to a file hands every tensor that is its own memory to the hashing thread at once
  (no hand-over, and so no wake-up of that thread, per tensor);
- an eager load of a large regular file reads and hashes on two threads, and still names the first
  damaged tensor in file order;
- a small save and a lazy read of one small tensor make no MiB-sized buffer;
- tensorcanon.open finds the table rows it needs, not all of them;
- a dict of int keys (a label map) is encoded with no Python call per key, to the same bytes.
"""

from __future__ import annotations

import os
import threading
import tracemalloc

import pytest
import torch

import tensorcanon
from tensorcanon.format import digest, tree
from tensorcanon.io import lazyindex, reader, source, writer

MiB = 1 << 20
HANG_S = 120  # only a hang waits this long


def _big(contiguous: bool = True) -> dict:
    g = torch.Generator().manual_seed(41)
    obj = {f"t{i}": torch.rand(1 << 20, generator=g) for i in range(6)}  # 24 MiB: over the threads' threshold
    if not contiguous:
        obj = {k: v.reshape(1024, 1024).t() for k, v in obj.items()}
    obj["small"] = torch.arange(5.0)
    obj["bf16"] = torch.rand(1 << 19, generator=g).to(torch.bfloat16)  # 1 MiB, viewed as int16: not copied
    obj["zz"] = torch.arange(7.0)  # small ones after the last large one in file order (float32: after t5)
    obj["steps"] = [torch.tensor(float(i)) for i in range(3)]
    obj["mask"] = torch.arange(9, dtype=torch.uint8)  # (1-byte dtypes last)
    return obj


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _threads(prefix: str) -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(prefix)]


# ----------------------------------------------------------------- save


def test_a_large_save_hands_its_contiguous_tensors_to_the_hashing_thread_at_once(tmp_path, monkeypatch):
    handed, led, hashed_on = [], [], set()
    real_hash, real_lead = writer._Lane.hash, writer._Lane.lead

    def hash_(self, src, h, data):
        handed.append(src.name)
        real_hash(self, src, h, data)

    def lead(self, new, views):
        led.append([src.name for src, _, _ in views])
        real_lead(self, new, views)

    real = digest.constructor

    class Watched:
        def __init__(self, h):
            self.h = h

        def update(self, data):
            if memoryview(data).nbytes > MiB // 2:
                hashed_on.add(threading.current_thread().name)
            self.h.update(data)

        def digest(self):
            return self.h.digest()

    monkeypatch.setattr(writer._Lane, "hash", hash_)
    monkeypatch.setattr(writer._Lane, "lead", lead)
    monkeypatch.setattr(digest, "constructor", lambda algorithm: lambda prefix: Watched(real(algorithm)(prefix)))
    obj = _big()
    with open(tmp_path / "big.st", "wb") as f:
        written = tensorcanon.save(obj, f)
    monkeypatch.undo()
    assert led == [["t0", "t1", "t2", "t3", "t4", "t5", "bf16"]]  # one hand-over, in data order (the small: here)
    assert handed == []  # none handed over one at a time
    assert hashed_on and all(name.startswith("tensorcanon-hash") for name in hashed_on)
    assert (tmp_path / "big.st").read_bytes() == tensorcanon.dumps(obj)
    assert tensorcanon.verify(tmp_path / "big.st") == written
    assert _threads("tensorcanon-hash") == []


def test_copies_are_still_handed_over_one_at_a_time(tmp_path, monkeypatch):
    # Non-contiguous tensors are copied to be written: at most two such copies wait for the lane
    # (tests/test_perf_structure.py holds the bound); they are not led.
    handed, led = [], []
    real_hash, real_lead = writer._Lane.hash, writer._Lane.lead
    monkeypatch.setattr(writer._Lane, "hash", lambda self, src, h, data: (handed.append(src.name),
                                                                          real_hash(self, src, h, data)))
    monkeypatch.setattr(writer._Lane, "lead", lambda self, new, views: (led.extend(s.name for s, _, _ in views),
                                                                        real_lead(self, new, views)))
    obj = _big(contiguous=False)
    with open(tmp_path / "t.st", "wb") as f:
        tensorcanon.save(obj, f)
    monkeypatch.undo()
    assert sorted(handed) == [f"t{i}" for i in range(6)] and led == ["bf16"]
    assert (tmp_path / "t.st").read_bytes() == tensorcanon.dumps(obj)


def test_an_error_hashing_a_led_tensor_fails_the_save_and_leaves_no_thread(tmp_path, monkeypatch):
    real = digest.constructor

    class Broken:
        def __init__(self, h):
            self.h = h

        def update(self, data):
            if memoryview(data).nbytes > MiB:
                raise MemoryError("hash failed")
            self.h.update(data)

        def digest(self):
            return self.h.digest()

    monkeypatch.setattr(digest, "constructor", lambda algorithm: lambda prefix: Broken(real(algorithm)(prefix)))
    with open(tmp_path / "x.st", "wb") as f, pytest.raises(MemoryError, match="hash failed"):
        tensorcanon.save(_big(), f)
    assert _threads("tensorcanon-hash") == []


def test_host_view_is_host_bytes_without_a_copy():
    from tensorcanon.format import tensorbytes

    g = torch.Generator().manual_seed(2)
    viewed = [torch.rand(3, 4, generator=g), torch.rand(5, generator=g).to(torch.bfloat16),
              torch.arange(6, dtype=torch.int16), torch.nn.Parameter(torch.rand(2, generator=g)),
              torch.rand(4, generator=g).to(torch.float8_e4m3fn)]
    for t in viewed:
        view = tensorbytes.host_view(t, "tensor")
        assert view is not None and bytes(view) == bytes(tensorbytes.host_bytes(t, "tensor"))
        assert tensorbytes.address(view) == t.data_ptr()  # the tensor's own memory
    copied = [torch.rand(4, 3, generator=g).t(), torch.tensor([True, False]), torch.zeros(0),
              torch.randn(3, dtype=torch.complex64, generator=g).conj()]
    for t in copied:
        assert tensorbytes.host_view(t, "tensor") is None


# ----------------------------------------------------------------- eager load


def test_an_eager_load_of_a_large_file_reads_and_hashes_on_two_threads(tmp_path, monkeypatch):
    obj = _big()
    p = tmp_path / "big.st"
    tensorcanon.save(obj, p)
    readers: set[str] = set()
    real_preadv = os.preadv
    helped, mained = threading.Event(), threading.Event()

    def preadv(fd, buffers, offset):
        # Each thread's reads wait until the other has read once (each says so before it waits):
        # on a busy machine either thread could otherwise take every tensor before the other runs.
        name = threading.current_thread().name
        readers.add(name)
        mine, other = (mained, helped) if name == "MainThread" else (helped, mained)
        mine.set()
        other.wait(HANG_S)
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(reader.os, "preadv", preadv)
    out = tensorcanon.load(p)
    monkeypatch.undo()
    assert "MainThread" in readers and any(r.startswith("tensorcanon-read") for r in readers), readers
    assert _same(out, obj)
    assert _threads("tensorcanon-read") == []
    readers.clear()
    helped.clear()
    mained.clear()
    monkeypatch.setattr(reader.os, "preadv", preadv)
    with open(p, "rb") as f:  # a file object of a regular file too
        out = tensorcanon.load(f)
    monkeypatch.undo()
    assert any(r.startswith("tensorcanon-read") for r in readers)
    assert _same(out, obj)


def test_the_two_threads_name_the_first_damaged_tensor_in_file_order(tmp_path):
    obj = _big()
    p = tmp_path / "big.st"
    tensorcanon.save(obj, p)
    with reader.open_file(p) as cf:
        rows = sorted(cf.rows, key=lambda r: r.begin)
        start = cf.data_start
    big = [r for r in rows if r.end - r.begin >= MiB]
    first, last = big[1], big[-1]  # one each side of where the two threads meet
    data = bytearray(p.read_bytes())
    for r in (last, first):
        data[start + (r.begin + r.end) // 2] ^= 0x40
    p.write_bytes(bytes(data))
    with pytest.raises(tensorcanon.IntegrityError) as err:
        tensorcanon.load(p)
    assert f'$["{first.name}"]' in str(err.value) and f"'{last.name}'" not in str(err.value)
    assert tensorcanon.load(p, verify=False)[first.name].shape == obj[first.name].shape
    assert _threads("tensorcanon-read") == []


def test_a_file_cut_short_after_it_was_opened_is_a_format_error(tmp_path):
    obj = _big()
    p = tmp_path / "big.st"
    tensorcanon.save(obj, p)
    with open(p, "r+b") as f:
        cf = reader.CheckedFile(source.Source(f, name=str(p)))
        f.truncate(os.path.getsize(p) - 3 * MiB)  # after the header was checked against the size
        with pytest.raises(tensorcanon.FormatError, match="file ends inside the data of tensor"):
            cf.load()
    assert _threads("tensorcanon-read") == []


# ----------------------------------------------------------------- fixed costs


def _peak(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_small_save_makes_no_mebibyte_buffer(tmp_path):
    config = {"lr": 3e-4, "betas": [0.9, 0.95], "name": "run", "labels": {i: f"c{i}" for i in range(10)},
              "w": torch.ones(3)}
    tensorcanon.dumps(config)  # (first-call caches)
    # (msgpack's Packer starts with a buffer of 256 KiB: the manifest's; the staging buffer was a MiB)
    assert _peak(lambda: tensorcanon.dumps(config)) < 512 << 10
    with open(tmp_path / "c.st", "wb") as f:
        assert _peak(lambda: tensorcanon.save(config, f)) < 512 << 10
    assert tensorcanon.load(tmp_path / "c.st")["labels"] == config["labels"]


def test_a_lazy_read_of_one_small_tensor_makes_no_mebibyte_buffer(tmp_path):
    p = tmp_path / "k.st"
    tensorcanon.save({f"layer{i:03d}": torch.full((256,), float(i)) for i in range(100)}, p)

    def one():
        with tensorcanon.open(p) as f:
            return f['$["layer050"]']

    assert torch.equal(one(), torch.full((256,), 50.0))
    assert _peak(one) < 512 << 10


def test_open_finds_only_the_rows_it_needs(tmp_path):
    p = tmp_path / "k.st"
    tensorcanon.save({f"layer{i:04d}": torch.full((4,), float(i)) for i in range(1000)}, p)
    src = source.map_file(str(p))
    try:
        q = lazyindex.QuickIndex(src, tensorcanon.Limits())
        assert len(q._rows) == 1  # where the table starts; no row skipped yet
        i = q.index_of('$["layer0010"]')
        assert i == 10 and q.info(i).name == "layer0010"
        assert len(q._rows) <= 12  # rows 0-10 and where row 11 starts
        assert q.index_of("layer0999") == 999  # by name: found by its encoding, every row up to it
        assert len(q._rows) == 1001 and q._rows[-1] == q._table_end
    finally:
        src.release()
    with tensorcanon.open(p) as f:
        assert torch.equal(f['$["layer0999"]'], torch.full((4,), 999.0)) and len(f) == 1000


# ----------------------------------------------------------------- int keys


def _python_calls(fn) -> int:
    import sys

    calls = 0

    def profile(frame, event, arg):
        nonlocal calls
        if event == "call":
            calls += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def test_int_keys_are_encoded_with_no_python_call_per_key():
    def calls(n):
        labels = {i: f"class {i}" for i in range(n)}
        return _python_calls(lambda: tree.Encoder(256).encode(labels))
    assert calls(1000) - calls(500) < 10


@pytest.mark.parametrize("obj", [
    {i: f"c{i}" for i in range(300)},
    {-(2**63): "min", 2**64 - 1: "max", 0: [1, {"a": torch.ones(2)}], 7: None},
    {3: {2: {1: "deep"}}, 1: (1, 2.5)},
    {i * 7919 % 1000: float(i) for i in range(100)},
])
def test_int_keys_give_the_general_paths_bytes(obj, monkeypatch):
    fast = tensorcanon.dumps(obj)
    monkeypatch.setattr(tree, "_int_keys", lambda d: None)  # every int-keyed dict through enc_container
    assert tensorcanon.dumps(obj) == fast
    monkeypatch.undo()
    assert tensorcanon.loads(fast).keys() == obj.keys()


def test_int_keys_the_fast_path_leaves_alone_are_still_refused_or_written_as_before():
    assert tensorcanon.loads(tensorcanon.dumps({2**64: 1, 1: 2})) == {2**64: 1, 1: 2}  # a big int key
    assert tensorcanon.loads(tensorcanon.dumps({True: 1, 2: 3})) == {True: 1, 2: 3}  # a bool among ints
    with pytest.raises(tensorcanon.UnsupportedTypeError, match="share one Python hash"):
        tensorcanon.dumps({i * (2**61 - 1): i for i in range(100)})  # crowded, as before


def _kinds_around_large_ones() -> dict:
    """Large tensors of every kind the reader makes (Parameter, requires_grad, numpy, bool, bfloat16,
    channels-last), with small ones before, between and after them in file order."""
    import numpy as np

    g = torch.Generator().manual_seed(7)
    return {
        "a_first": torch.arange(3.0),
        "p": torch.nn.Parameter(torch.rand(1 << 18, generator=g)),  # 1 MiB
        "b_between": [torch.tensor(float(i)) for i in range(5)],
        "grad": torch.rand(1 << 18, generator=g).requires_grad_(),
        "nd": np.arange(1 << 17, dtype=np.float64),  # 1 MiB
        "mask": torch.rand(1 << 21, generator=g) > 0.5,  # 2 MiB of bool
        "bf": torch.rand(1 << 19, generator=g).to(torch.bfloat16),
        "cl": torch.rand(8, 64, 32, 32, generator=g).to(memory_format=torch.channels_last),  # 2 MiB
        "big": {f"w{i}": torch.rand(1 << 20, generator=g) for i in range(4)},
        "z_last": torch.arange(4, dtype=torch.int8),
        "y_int": torch.arange(6, dtype=torch.int64),
    }


def test_two_threads_load_what_one_thread_loads(tmp_path, monkeypatch):
    import numpy as np

    obj = _kinds_around_large_ones()
    p = tmp_path / "k.st"
    tensorcanon.save(obj, p)
    two = tensorcanon.load(p)
    monkeypatch.setattr(reader.CheckedFile, "_read_large", lambda *a: {})
    one = tensorcanon.load(p)
    monkeypatch.undo()

    def same(a, b):
        if isinstance(a, np.ndarray):
            return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
        if isinstance(a, torch.Tensor):
            return (type(a) is type(b) and a.dtype == b.dtype and torch.equal(a, b)
                    and a.requires_grad == b.requires_grad and a.stride() == b.stride())
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, list):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
        return a == b

    assert same(two, one) and same(two, obj)
    assert two["cl"].is_contiguous(memory_format=torch.channels_last)
    assert type(two["p"]) is torch.nn.Parameter and two["grad"].requires_grad
    assert tensorcanon.load(p, verify=False).keys() == obj.keys()


def test_open_finds_a_far_row_and_a_top_level_key_without_decoding_the_rest(tmp_path):
    """Row 500 of 1,000 is found by one skip over the rows before it (none kept one by one), and
    `$["layer0500"]` of a flat dict without decoding the root; both as the full decoding says."""
    p = tmp_path / "k.st"
    tensorcanon.save({f"layer{i:04d}": torch.full((4,), float(i)) for i in range(1000)}, p)
    src = source.map_plain(str(p))
    try:
        q = lazyindex.QuickIndex(src, tensorcanon.Limits())
        assert q.index_of('$["layer0500"]') == 500 and q._root is None  # the root was not decoded
        assert q.info(500).name == "layer0500" and len(q._rows) == 1 and set(q._far) == {500, 501}
        assert q.index_of('$["layer0999"]') == 999 and q.info(999).name == "layer0999"
        src.seek(0)
        dense = lazyindex.QuickIndex(src, tensorcanon.Limits())
        assert [dense._dense_to(i) for i in (500, 501, 1000)] == [q._row_start(i) for i in (500, 501, 1000)]
        assert q._row_start(1000) == q._table_end
        assert q.index_of('$["layer1000"]') is None and q._root is not None  # absent: decoded, not found
    finally:
        src.release()


@pytest.mark.parametrize("obj, key", [
    ({"a": torch.zeros(2), "b": "a"}, "a"),  # the key's text elsewhere too: the root is decoded
    ({"x": {"a": torch.zeros(2)}, "a": torch.ones(2)}, "a"),  # a key of that text deeper down too
    ([torch.zeros(2)], None),  # not a dict
    ({"a": [torch.zeros(2)], "b": torch.ones(2)}, "b"),  # b's tensor is not tensor 0: checked by the skip
])
def test_a_top_level_key_is_found_without_decoding_only_where_that_is_proven(tmp_path, obj, key):
    p = tmp_path / "t.st"
    tensorcanon.save(obj, p)
    src = source.map_plain(str(p))
    try:
        q = lazyindex.QuickIndex(src, tensorcanon.Limits())
        if key is not None:
            fast = q._top_key(key)
            src.seek(0)
            full = lazyindex.QuickIndex(src, tensorcanon.Limits())
            full._root = full._root or _decoded_root(full)
            assert fast in (None, full._follow((key,)))
            assert q.index_of(f'$["{key}"]') == full._follow((key,))
        else:
            assert q._top_key("a") is None
    finally:
        src.release()
    loaded = tensorcanon.load(p)
    with tensorcanon.open(p) as f:
        for k in (loaded if isinstance(loaded, dict) else {}):
            if isinstance(loaded[k], torch.Tensor):
                assert torch.equal(f[f'$["{k}"]'], loaded[k])


def _decoded_root(q):
    import msgpack

    from tensorcanon.format import manifest

    a, b = q._root_span
    return msgpack.unpackb(q.manifest[a:b], **manifest.UNPACK_OPTIONS)


@pytest.mark.parametrize("fast", [True, False])
def test_the_manifests_base64_decodes_alike_with_and_without_pybase64(tmp_path, monkeypatch, fast):
    """The manifest's base64 is decoded by pybase64 where installed (the `fast` extra), else by
    binascii: both give the same bytes and refuse what is not strict base64."""
    import base64
    import binascii

    if fast and lazyindex._fast_b64() is None:
        pytest.skip("pybase64 is not installed")
    if not fast:
        monkeypatch.setattr(lazyindex, "_fast_b64", lambda: None)
    for n in (0, 1, 2, 3, 100, 4097, 150_000):
        data = os.urandom(n)
        assert lazyindex._b64decode(memoryview(base64.b64encode(data))) == data
    for bad in (b"AAA!", b"AAAA=AAA", b"AA==AAAA", b"A===", b"AAA", b"A" * 4096 + b"\nAAA"):
        with pytest.raises(binascii.Error):
            lazyindex._b64decode(memoryview(bad))
    p = tmp_path / "b.st"
    tensorcanon.save({f"t{i:03d}": torch.full((3,), float(i)) for i in range(300)}, p)
    with tensorcanon.open(p) as f:
        assert torch.equal(f['$["t150"]'], torch.full((3,), 150.0))
        assert f._quick is not None and f._full is None  # proven by the quick index


def test_open_maps_without_torch_and_unmaps_with_the_last_view(tmp_path):
    """tensorcanon.open's map (source.map_plain: libc's mmap, no torch storage, no descriptor) stays
    while any view of its bytes is held, and goes with the last one."""
    import gc
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc/self")
    p = tmp_path / "m.st"
    tensorcanon.save({"a": torch.arange(100.0)}, p)
    real = os.path.realpath(p)

    def maps() -> int:
        with open("/proc/self/maps") as fh:
            return sum(1 for line in fh if line.rstrip().endswith(real))

    fds = len(os.listdir("/proc/self/fd"))
    src = source.map_plain(str(p))
    assert src.mapped is None and maps() == 1 and len(os.listdir("/proc/self/fd")) == fds
    head = src.data[:8]
    src.release()
    gc.collect()
    assert maps() == 1 and bytes(head) == p.read_bytes()[:8]  # a view held: still mapped
    del head
    gc.collect()
    assert maps() == 0
