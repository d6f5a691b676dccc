"""Saving to a path is atomic: a failed save leaves the previous file intact and no temp file."""

import os
import stat

import pytest
import torch

import tensorcanon as tc
from tensorcanon.io import writer

from support import fail_at_tensor


class Boom:
    pass


def previous(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    digest = tc.save({"w": torch.arange(4.0), "v": 1}, path)
    return path, path.read_bytes(), digest


def assert_untouched(tmp_path, path, data, digest):
    assert path.read_bytes() == data and tc.verify(path) == digest
    assert sorted(os.listdir(tmp_path)) == [path.name], "a temp file was left behind"


def test_encode_failure_leaves_previous_file(tmp_path):
    path, data, digest = previous(tmp_path)
    tc.register(Boom, name="test.Boom", encode=lambda b: 1 / 0, decode=lambda s: Boom())
    try:
        with pytest.raises(tc.UnsupportedTypeError):
            tc.save({"w": torch.zeros(3), "b": Boom()}, path)
    finally:
        tc.unregister(Boom)
    assert_untouched(tmp_path, path, data, digest)


def test_failure_while_streaming_tensor_bytes_leaves_previous_file(tmp_path, monkeypatch):
    path, data, digest = previous(tmp_path)
    calls = fail_at_tensor(monkeypatch, 2, OSError("disk vanished"))  # the temp file already holds the first
    with pytest.raises(OSError, match="disk vanished"):
        tc.save({"a": torch.ones(1000), "b": torch.ones(1000, dtype=torch.float64), "c": torch.ones(3)}, path)
    assert len(calls) == 2
    assert_untouched(tmp_path, path, data, digest)


def test_failure_in_fsync_leaves_previous_file(tmp_path, monkeypatch):
    path, data, digest = previous(tmp_path)

    def no_fsync(fd):
        raise OSError("fsync failed")

    monkeypatch.setattr(writer.os, "fsync", no_fsync)
    with pytest.raises(OSError, match="fsync"):
        tc.save({"x": torch.zeros(2)}, path)
    monkeypatch.undo()
    assert_untouched(tmp_path, path, data, digest)


def test_keyboard_interrupt_mid_write_cleans_up(tmp_path, monkeypatch):
    path, data, digest = previous(tmp_path)

    def interrupted(value, kind):
        raise KeyboardInterrupt

    monkeypatch.setattr(writer, "host_bytes", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tc.save({"x": torch.zeros(2)}, path)
    assert_untouched(tmp_path, path, data, digest)


def test_successful_save_replaces_the_file(tmp_path):
    path, data, _ = previous(tmp_path)
    digest = tc.save({"new": torch.ones(2)}, path)
    assert path.read_bytes() != data and tc.verify(path) == digest
    assert os.listdir(tmp_path) == [path.name]


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_permissions_follow_the_umask(tmp_path, mask):
    old = os.umask(mask)
    try:
        path = tmp_path / "p.safetensors"
        tc.save({"x": 1}, path)
        tc.save({"x": 2}, path)  # replacing keeps following the umask too
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~mask


def test_every_atomic_writer_shares_one_path(tmp_path):
    # Lockfiles and `convert` outputs go through the same helper as save: a failing fill
    # leaves the previous file and no temp file; a good one leaves only the new file.
    from tensorcanon import lockfile

    target = tmp_path / "tensors.lock"
    previous = b"tensorcanon-lock 1\n"  # (a lockfile: write_lock replaces only a lockfile)
    target.write_bytes(previous)

    def failing(f, tmp):
        f.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        writer.replace_atomically(target, failing)
    assert target.read_bytes() == previous
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tensors.lock"]

    lockfile.write_lock([], target)
    assert target.read_bytes() != previous
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tensors.lock"]
