"""What PyTorch's own test/test_serialization.py found when run with tensorcanon in place of
torch.save/torch.load (benchmarks/torch_serialization_suite.py), each kept as a test of ours.

- Loading inside ``with torch.device("meta")``, after ``torch.set_default_device("meta")`` or under
  ``FakeTensorMode`` crashed the interpreter: tensors were made on the default device and then
  written through a null data pointer. Every reader path now makes its tensors on the CPU
  (format/tensorbytes.host_empty) and refuses a mode that makes tensors without memory.
- A file object with ``read`` but no ``readinto`` failed with a bare AttributeError.
- An efficient zero tensor (``torch._efficientzerotensor``) raised torch's RuntimeError from inside
  the writer, and two of them would have been merged into one stored tensor (both have address 0).
- ``load(mmap=True)`` maps the file privately: writes to the tensors never reach the file.
"""

import io
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import tensorcanon
from tensorcanon.format.errors import UsageError

HERE = os.path.dirname(os.path.abspath(__file__))

# Every reader path, under each way of changing where torch makes new tensors. It runs in a fresh
# interpreter: the crash this guards against kills the process, and set_default_device is global.
_EVERY_READER = textwrap.dedent("""
    import io, os, sys, tempfile, contextlib
    import numpy as np, torch, tensorcanon, tensorcanon.dcp as tcd

    def state():
        return {"f": torch.arange(12.).reshape(3, 4), "b": torch.tensor([True, False, True]),
                "e": torch.zeros(0, 3), "s": torch.tensor(7, dtype=torch.int64),
                "p": torch.nn.Parameter(torch.ones(2, 2)),
                "cl": torch.arange(2 * 3 * 4 * 5.).reshape(2, 3, 4, 5).contiguous(memory_format=torch.channels_last),
                "big": torch.arange(1_500_000, dtype=torch.float32),   # above the 4 MB small-read path
                "np": np.arange(5, dtype=np.int16), "h": torch.arange(6, dtype=torch.float16)}

    tmp = tempfile.mkdtemp()
    path = os.path.join(tmp, "f.safetensors")
    tensorcanon.save(state(), path)
    data = open(path, "rb").read()
    ckpt = os.path.join(tmp, "ckpt")
    tcd.save({"m": {"w": torch.arange(10.), "b": torch.tensor([True])}, "step": 3}, ckpt)

    def same(got, want, where):
        assert type(got) is type(want), (where, type(got), type(want))
        if isinstance(want, torch.Tensor):
            assert got.device.type == "cpu", (where, got.device)
            assert got.dtype == want.dtype and got.shape == want.shape, where
            assert torch.equal(got.detach(), want.detach()), where
        elif isinstance(want, np.ndarray):
            assert np.array_equal(got, want), where

    def check(name, got):
        want = state()
        for k in want:
            same(got[k], want[k], f"{name}: {k}")

    WANT = state()

    def check(name, got):
        for k in WANT:
            same(got[k], WANT[k], f"{name}: {k}")

    def dcp_load():
        s = {"m": {"w": torch.empty(10, device="cpu"), "b": torch.empty(1, dtype=torch.bool, device="cpu")},
             "step": 0}
        return lambda: (tcd.load(s, ckpt), s)[1]

    # name: (what makes the reader's input outside the mode, the read under the mode, the check after it)
    readers = {
        "load(path)": lambda: tensorcanon.load(path),
        "load(path, mmap=True)": lambda: tensorcanon.load(path, mmap=True),
        "loads(bytes)": lambda: tensorcanon.loads(data),
        "load(BytesIO)": lambda: tensorcanon.load(io.BytesIO(data)),
        "load(map_location=cpu)": lambda: tensorcanon.load(path, map_location="cpu"),
        "open(path)": lambda: {k: tensorcanon.open(path)[f'$["{k}"]'] for k in WANT},
        "open(bytes)": lambda: {k: tensorcanon.open(data)[f'$["{k}"]'] for k in WANT},
        "open(path).values": lambda: dict(zip(WANT, [tensorcanon.open(path)[f'$["{k}"]'] for k in WANT])),
        "open(path, verify=False)": lambda: {k: tensorcanon.open(path, verify=False)[f'$["{k}"]'] for k in WANT},
    }
    sharded = {
        "load_unsharded": lambda: tcd.load_unsharded(ckpt),
        "dcp.load": None,
    }

    def meta_context():
        return torch.device("meta")

    @contextlib.contextmanager
    def default_meta():
        torch.set_default_device("meta")
        try:
            yield
        finally:
            torch.set_default_device("cpu")

    def fake():
        from torch._subclasses.fake_tensor import FakeTensorMode
        return FakeTensorMode()

    for mode_name, mode in [("torch.device('meta')", meta_context), ("set_default_device('meta')", default_meta),
                            ("FakeTensorMode", fake)]:
        for name, read in {**readers, **sharded}.items():
            print(mode_name, name, flush=True)
            if read is None:
                read = dcp_load()
            try:
                with mode():
                    got = read()
            except tensorcanon.TensorCanonError as e:  # (dcp.load wraps it: DCP gathers the ranks' errors)
                assert mode_name == "FakeTensorMode", (mode_name, name, e)
                assert "FakeTensorMode" in str(e) and "outside the mode" in str(e), e
                print("  refused:", e, flush=True)
                continue
            if name in readers:
                check(f"{mode_name} {name}", got)
            else:
                same(got["m"]["w"], torch.arange(10.), name)
                same(got["m"]["b"], torch.tensor([True]), name)
                assert got["step"] == 3, got
    print("ALL READERS DONE")
""")


def test_every_reader_makes_cpu_tensors_whatever_the_default_device():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.join(os.path.dirname(HERE), "src"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _EVERY_READER], capture_output=True, text=True,
                          timeout=300, env=env)
    out = proc.stdout + proc.stderr
    # A crash shows as a negative return code (-11: SIGSEGV) after the last reader it started.
    assert proc.returncode == 0, out[-4000:]
    assert "ALL READERS DONE" in proc.stdout, out[-4000:]
    # under FakeTensorMode the refusal is the library's, named, for a reader of each kind
    assert proc.stdout.count("refused:") >= 5, out[-4000:]


class ReadOnly:
    """A binary file object with ``read`` only, as torch's own tests mock one (no readinto, no fileno)."""

    def __init__(self, data: bytes) -> None:
        self._b = io.BytesIO(data)

    def read(self, n: int = -1) -> bytes:
        return self._b.read(n)


class TextLike:
    def read(self, n: int = -1) -> str:
        return "x" * max(n, 0)


@pytest.mark.parametrize("n", [10, 3_000_000])  # both sides of the 4 MB small-read path
def test_read_only_file_object_loads_and_verifies(n):
    obj = {"w": torch.arange(n, dtype=torch.float32), "b": torch.tensor([True, False])}
    data = tensorcanon.dumps(obj)
    out = tensorcanon.load(ReadOnly(data))
    assert torch.equal(out["w"], obj["w"]) and torch.equal(out["b"], obj["b"])
    assert tensorcanon.verify(ReadOnly(data)) == tensorcanon.verify(data)


def test_read_only_file_object_that_returns_str_is_a_usage_error():
    with pytest.raises(UsageError, match="binary mode"):
        tensorcanon.load(TextLike())


def test_read_only_file_object_that_returns_more_than_asked_is_refused():
    class Overlong:
        def read(self, n: int = -1) -> bytes:
            return b"\0" * (n + 1)

    with pytest.raises(UsageError, match="more than asked"):
        tensorcanon.load(Overlong())


def test_efficient_zero_tensor_saves_as_zeros():
    z = torch._efficientzerotensor((2, 3), dtype=torch.float64)
    w = torch._efficientzerotensor((2, 3), dtype=torch.float64)
    assert z._is_zerotensor()
    out = tensorcanon.loads(tensorcanon.dumps({"z": z, "w": w}))
    assert torch.equal(out["z"], torch.zeros(2, 3, dtype=torch.float64))
    assert not out["z"]._is_zerotensor()
    # Two of them have the same (null) address, yet are not one tensor: they must not be tied.
    assert out["z"] is not out["w"]
    assert tensorcanon.fingerprint({"z": z}) == tensorcanon.fingerprint({"z": torch.zeros(2, 3, dtype=torch.float64)})


def test_efficient_zero_tensor_through_dcp_staging():
    from tensorcanon.dcp.staging import staged_copy

    staged = staged_copy({"z": torch._efficientzerotensor(3)})
    assert torch.equal(staged["z"], torch.zeros(3)) and not staged["z"]._is_zerotensor()


def test_mmap_load_is_private_writes_never_reach_the_file(tmp_path):
    path = tmp_path / "f.safetensors"
    tensorcanon.save({"w": torch.zeros(1024)}, path)
    before = path.read_bytes()
    out = tensorcanon.load(path, mmap=True)
    out["w"].fill_(1.0)
    assert path.read_bytes() == before
    assert torch.equal(tensorcanon.load(path)["w"], torch.zeros(1024))


# ------------------------------------------------------------------ the harness itself

_FAKE_SUITE = textwrap.dedent('''
    import ctypes, io, unittest
    import torch

    class T(unittest.TestCase):
        def test_round_trip(self):
            f = io.BytesIO()
            torch.save({"w": torch.arange(3.0)}, f)
            f.seek(0)
            self.assertTrue(torch.equal(torch.load(f)["w"], torch.arange(3.0)))

        def test_refused(self):
            torch.save(torch.nn.Linear(2, 2), io.BytesIO())

        def test_pickle_option_refused(self):
            torch.load(io.BytesIO(b""), pickle_module=object())

        def test_assertion(self):
            self.assertEqual(1, 2)

        def test_z_crash(self):
            ctypes.string_at(0)

        def test_zz_after_the_crash(self):
            pass
''')


def test_the_suite_harness_classifies_and_survives_a_crash(tmp_path):
    fake = tmp_path / "test_fake.py"
    fake.write_text(_FAKE_SUITE)
    out = tmp_path / "out.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.join(os.path.dirname(HERE), "src"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, os.path.join(os.path.dirname(HERE), "benchmarks",
                                                        "torch_serialization_suite.py"), str(fake), "--json", str(out)],
                          capture_output=True, text=True, timeout=300, env=env)
    import json

    result = json.loads(out.read_text())
    got = {r["test"].rsplit(".", 1)[1]: r["outcome"] for r in result["tests"]}
    assert got == {"test_round_trip": "pass", "test_refused": "refusal", "test_pickle_option_refused": "refusal",
                   "test_assertion": "assertion", "test_z_crash": "crash", "test_zz_after_the_crash": "pass"}, got
    assert proc.returncode == 1  # a crash fails the run
    assert "crash" in proc.stdout and "counts: pass 2, refusal 2, assertion 1" in proc.stdout, proc.stdout


def test_a_file_object_read_from_where_it_stands():
    # torch's test_serialization_with_header: bytes before the file, then the file
    f = io.BytesIO()
    f.write(b"header")
    tensorcanon.save({"w": torch.arange(3.0)}, f)
    f.seek(6)
    assert torch.equal(tensorcanon.load(f)["w"], torch.arange(3.0))
