"""Paths that name no regular file (a FIFO, a device) are refused at once, never read as a stream.

Opening a FIFO for reading waits for a writer, forever if none comes, and a device such as
/dev/zero never ends: every reader opens a path without blocking and refuses anything but a
regular file (source.open_fd), with an error that says what the path is. A stream is still
read when the caller passes it as an open file object. Each call runs with a time limit, so a
regression fails here instead of hanging the suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import torch

import tensorcanon
import tensorcanon.dcp as tcd
from tensorcanon.sharded import layout

from support import within

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs (os.mkfifo)")

STATE = {"w": torch.arange(12.0).reshape(3, 4), "step": 3}


def finishes(fn, timeout: float = 20.0):
    """``fn()``'s exception (or None), failing the test if it still runs after ``timeout`` seconds:
    a reader blocked in open() is left behind, not waited for (support.within)."""
    try:
        within(timeout, fn)
    except Exception as e:  # noqa: BLE001 - handed to the test
        return e
    return None


def refused(fn, path, kind: str = "a FIFO") -> tensorcanon.TensorCanonError:
    e = finishes(fn)
    assert isinstance(e, tensorcanon.FileAccessError), repr(e)
    assert f"is {kind}, not a regular file" in str(e) and os.fspath(path) in str(e)
    assert "open binary file object" in str(e)
    return e


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "x.safetensors"
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("via_link", [False, True], ids=["fifo", "symlink-to-fifo"])
def test_every_reader_refuses_a_fifo(tmp_path, fifo, via_link):
    path = fifo
    if via_link:
        path = tmp_path / "link.safetensors"
        os.symlink(fifo, path)
    for fn in (lambda: tensorcanon.load(path), lambda: tensorcanon.load(str(path), mmap=True),
               lambda: tensorcanon.open(path), lambda: tensorcanon.verify(path),
               lambda: tensorcanon.read_metadata(path), lambda: tensorcanon.diff(path, path)):
        e = refused(fn, path)
        assert e.filename == os.fspath(path)


def test_devices_are_refused():
    for fn in (lambda: tensorcanon.load("/dev/zero"), lambda: tensorcanon.verify("/dev/zero"),
               lambda: tensorcanon.open("/dev/zero"), lambda: tensorcanon.load("/dev/zero", mmap=True)):
        refused(fn, "/dev/zero", "a character device")


def test_a_folder_keeps_its_error_and_a_symlink_to_a_file_works(tmp_path):
    with pytest.raises(tensorcanon.FormatError, match="is a directory"):
        tensorcanon.load(tmp_path)
    tensorcanon.save(STATE, tmp_path / "real.safetensors")
    os.symlink(tmp_path / "real.safetensors", tmp_path / "link.safetensors")
    assert torch.equal(tensorcanon.load(tmp_path / "link.safetensors", mmap=True)["w"], STATE["w"])
    assert tensorcanon.verify(tmp_path / "link.safetensors") == tensorcanon.fingerprint(STATE)


def test_a_stream_passed_as_a_file_object_is_still_read(fifo):
    data = tensorcanon.dumps(STATE)

    def write() -> None:
        with open(fifo, "wb") as w:
            w.write(data)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    got: dict = {}

    def read() -> None:
        with open(fifo, "rb") as f:  # deliberately: the caller opened the stream
            got["value"] = tensorcanon.load(f)

    assert finishes(read) is None
    assert torch.equal(got["value"]["w"], STATE["w"])


def test_saving_over_a_fifo_replaces_it(fifo):
    assert finishes(lambda: tensorcanon.save(STATE, fifo)) is None
    assert fifo.is_file() and torch.equal(tensorcanon.load(fifo)["w"], STATE["w"])


@pytest.fixture
def checkpoint(tmp_path):
    folder = tmp_path / "ckpt"
    tcd.save(STATE, folder)  # one process, no process group: a 1-rank checkpoint
    return folder


@pytest.mark.parametrize("via_link", [False, True], ids=["fifo", "symlink-to-fifo"])
def test_a_rank_file_replaced_by_a_fifo_is_refused(tmp_path, checkpoint, via_link):
    rank_file = layout.read(checkpoint).file_path(0)
    os.unlink(rank_file)
    if via_link:
        os.mkfifo(tmp_path / "elsewhere")
        os.symlink(tmp_path / "elsewhere", rank_file)
    else:
        os.mkfifo(rank_file)
    out = tmp_path / "out.safetensors"
    for fn in (lambda: tcd.verify(checkpoint), lambda: tcd.load_unsharded(checkpoint),
               lambda: tcd.consolidate(checkpoint, out), lambda: tensorcanon.verify(checkpoint),
               lambda: tcd.load({"w": torch.zeros(3, 4), "step": 0}, checkpoint)):
        e = finishes(fn)
        assert isinstance(e, tensorcanon.TensorCanonError), repr(e)
        assert "is a FIFO, not a regular file" in str(e) and os.path.basename(rank_file) in str(e)
    assert not out.exists()


def test_command_line(tmp_path, fifo, checkpoint):
    """Every command that reads a path, on a FIFO, in one process (a hang fails at the timeout)."""
    folder = tmp_path / "folder"
    folder.mkdir()
    os.mkfifo(folder / "x.safetensors")
    tensorcanon.save(STATE, tmp_path / "ok.safetensors")
    lock = tmp_path / "fifo.lock"
    lock.write_text(f"tensorcanon-lock 2\n{tensorcanon.fingerprint(STATE)} 1 x.safetensors\n")
    rank_file = layout.read(checkpoint).file_path(0)
    os.unlink(rank_file)
    os.mkfifo(rank_file)
    commands = [["verify", str(fifo)], ["hash", str(fifo)], ["hash", "--verify", str(fifo)], ["inspect", str(fifo)],
                ["diff", str(fifo), str(tmp_path / "ok.safetensors")], ["convert", str(fifo), str(tmp_path / "c")],
                ["lock", str(folder), "-o", str(tmp_path / "a.lock")],
                ["lock", str(fifo), "-o", str(tmp_path / "b.lock")],
                ["lock", str(tmp_path / "*.safetensors"), "-o", str(tmp_path / "c.lock")],
                ["check", str(fifo)], ["check", str(lock)], ["verify", "/dev/zero"], ["verify", "/dev/stdin"],
                ["verify", str(checkpoint)], ["consolidate", str(checkpoint), str(tmp_path / "d")]]
    script = (
        "import contextlib, io, json, sys\n"
        "from tensorcanon.tools.cli import main\n"
        "results = []\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    out, err = io.StringIO(), io.StringIO()\n"
        "    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):\n"
        "        code = main(argv)\n"
        "    results.append([code, out.getvalue() + err.getvalue()])\n"
        "print(json.dumps(results))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(commands)], input=b"", capture_output=True,
                          timeout=60)  # stdin is a pipe: /dev/stdin names a FIFO
    assert proc.returncode == 0, proc.stderr.decode()
    results = json.loads(proc.stdout)
    for argv, (code, text) in zip(commands, results, strict=True):
        if argv[:2] == ["check", str(lock)]:  # the lockfile is read; the FIFO it lists is unreadable
            assert code == 1 and "UNREADABLE" in text and "is a FIFO, not a regular file" in text, (argv, text)
            continue
        named = argv[1] if argv[1].startswith("/dev/") else os.path.basename(
            rank_file if argv[1] == str(checkpoint) else "x.safetensors")
        assert code == 2 and "not a regular file" in text and named in text, (argv, code, text)
    assert "is a character device, not a regular file" in results[commands.index(["verify", "/dev/zero"])][1]
    assert "is a FIFO, not a regular file" in results[commands.index(["verify", "/dev/stdin"])][1]
    assert not any((tmp_path / name).exists() for name in ("a.lock", "b.lock", "c.lock", "c", "d"))
