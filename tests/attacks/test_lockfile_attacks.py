"""Attacks on lockfiles (issue 29): a lockfile is input like any file. Its lines may name files
inside its own folder only (no absolute path, no ``..``, no ``file://``/``local://`` URL, no
symlink leading out), objects only under URL prefixes the caller allows, every operation ends
within its timeout, and globs never follow symlinked folders."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest

import tensorcanon
from tensorcanon.tools import lockfile

from support import run_cli

ZERO = "xxh3-128:" + "0" * 32
SECRET = b"TOP-SECRET-CONTENT-0123456789"


@pytest.fixture
def tree(tmp_path):
    """A lockfile folder ``locks/`` beside a secret file and a real tensor file."""
    (tmp_path / "secret.txt").write_bytes(SECRET)
    locks = tmp_path / "locks"
    locks.mkdir()
    tensorcanon.save({"w": np.arange(4.0)}, str(locks / "ok.safetensors"))
    tensorcanon.save({"w": np.arange(3.0)}, str(tmp_path / "outside.safetensors"))
    return tmp_path


def _lock(folder, *paths: str) -> str:
    path = os.path.join(folder, "t.lock")
    with open(path, "w") as f:
        f.write("tensorcanon-lock 2\n" + "".join(f"{ZERO} 10 {p}\n" for p in paths))
    return path


@pytest.mark.parametrize("line", [
    "local://{root}/secret.txt", "file://{root}/secret.txt", "{root}/secret.txt", "../secret.txt",
    "sub/../../secret.txt", "../outside.safetensors", "link/secret.txt", "secret-link",
])
def test_check_refuses_lines_outside_the_lockfile_folder_before_reading_anything(tree, line):
    locks = tree / "locks"
    os.symlink(tree, locks / "link")  # a symlinked folder leading out
    os.symlink(tree / "secret.txt", locks / "secret-link")  # a symlinked file leading out
    lock = _lock(locks, "ok.safetensors", line.format(root=tree))
    code, out, err = run_cli("check", lock)
    assert code == 2 and out == "", (out, err)
    assert "outside the lockfile's folder" in err and "--allow" in err, err
    assert SECRET[:8].decode() not in err and line.format(root=tree) in err  # named, never quoted
    with pytest.raises(tensorcanon.FormatError, match="line 3"):
        lockfile.check_lock(lock)


def test_allow_widens_the_scope_explicitly(tree):
    locks = tree / "locks"
    lock = _lock(locks, "../outside.safetensors", "../secret.txt")
    results = lockfile.check_lock(lock, allow=[tree])
    assert [r.status for r in results] == ["mismatch", "unreadable"]
    # an unrecognized file is named but its bytes are never printed
    assert all(SECRET[:4].decode() not in r.message for r in results), results
    code, out, err = run_cli("check", "--allow", str(tree), lock)
    assert code == 1 and "SECRET" not in out + err


def test_lock_refuses_files_outside_its_folder_unless_allowed(tree):
    locks = tree / "locks"
    code, _, err = run_cli("lock", str(tree / "outside.safetensors"), "-o", str(locks / "t.lock"))
    assert code == 2 and "outside the lockfile's folder" in err and not (locks / "t.lock").exists()
    code, _, err = run_cli("lock", "--allow", str(tree), str(tree / "outside.safetensors"), "-o",
                           str(locks / "t.lock"))
    assert code == 0, err
    assert (locks / "t.lock").read_text().splitlines()[1].endswith(" ../outside.safetensors")
    assert run_cli("check", str(locks / "t.lock"))[0] == 2
    assert run_cli("check", "--allow", str(tree), str(locks / "t.lock"))[0] == 0


class _Silent:
    """A TCP server on 127.0.0.1 that accepts connections and never answers."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.accepted: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted.append(conn)

    def close(self) -> None:
        self.sock.close()
        for c in self.accepted:
            c.close()


def test_url_lines_are_not_followed_unless_their_prefix_is_allowed(tmp_path):
    server = _Silent()
    try:
        url = f"http://127.0.0.1:{server.port}/ckpt/a.safetensors"
        lock = _lock(tmp_path, url)
        code, out, err = run_cli("check", lock)
        assert code == 2 and "outside the allowed URL prefixes" in err, err
        other = f"http://127.0.0.1:{server.port}/other"
        for line in (url, f"http://127.0.0.1:{server.port}/ckpt/../other/a.safetensors",
                     f"http://127.0.0.1:{server.port}/ckpt/%2e%2e/other/a.safetensors"):
            with pytest.raises(tensorcanon.FormatError, match="outside the allowed URL prefixes"):
                lockfile.check_lock(_lock(tmp_path, line), allow=[other])
        assert server.accepted == []  # no request was sent
    finally:
        server.close()


def test_a_host_that_never_answers_is_bounded_by_the_timeout(tmp_path):
    server = _Silent()
    try:
        prefix = f"http://127.0.0.1:{server.port}/ckpt"
        lock = _lock(tmp_path, f"{prefix}/a.safetensors")
        proc = subprocess.run([sys.executable, "-m", "tensorcanon", "check", "--allow", prefix, "--timeout", "2",
                               lock], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1, proc.stderr
        assert proc.stdout.startswith("UNREADABLE") and "not finished within the timeout of 2 s" in proc.stdout
    finally:
        server.close()


def test_timeout_must_be_positive(tmp_path):
    lock = _lock(tmp_path)
    with pytest.raises(tensorcanon.UsageError):
        lockfile.check_lock(lock, timeout=0)
    assert run_cli("check", "--timeout", "0", lock)[0] == 2


def test_a_huge_lockfile_is_refused_without_reading_it_whole(tmp_path):
    lock = tmp_path / "big.lock"
    with open(lock, "wb") as f:
        f.write(b"tensorcanon-lock 2\n")
        f.truncate(lockfile.MAX_LOCKFILE_BYTES + 10)
    code, _, err = run_cli("check", str(lock))
    assert code == 2 and "not a lockfile" in err


def test_glob_does_not_follow_symlinked_folders(tmp_path):
    d = tmp_path / "dir"
    (d / "sub").mkdir(parents=True)
    tensorcanon.save({"w": np.ones(2)}, str(d / "sub" / "a.safetensors"))
    tensorcanon.save({"w": np.zeros(2)}, str(d / "b.safetensors"))
    os.symlink(d, d / "sub" / "self")      # a cycle
    os.symlink(d, d / "again")             # a second one: glob.glob never finishes with two
    os.symlink(d / "b.safetensors", d / "sub" / "b-link.safetensors")  # a symlinked file: matched
    found = lockfile.collect([str(d / "**" / "*.safetensors")])
    assert found == sorted(str(p) for p in (d / "b.safetensors", d / "sub" / "a.safetensors",
                                            d / "sub" / "b-link.safetensors"))
    assert lockfile.collect([str(d / "*" / "*.safetensors")]) == [str(d / "sub" / "a.safetensors"),
                                                                  str(d / "sub" / "b-link.safetensors")]
    assert lockfile.collect([str(d / "s?b" / "[a]*.safetensors")]) == [str(d / "sub" / "a.safetensors")]
    (d / ".hidden").mkdir()
    tensorcanon.save({"w": np.ones(2)}, str(d / ".hidden" / "h.safetensors"))
    assert str(d / ".hidden" / "h.safetensors") not in lockfile.collect([str(d / "**" / "*.safetensors")])
    code, out, err = run_cli("lock", "dir/**/*.safetensors", "-o", "t.lock", cwd=tmp_path)
    assert code == 0 and out == "wrote t.lock: 3 files\n", err


def test_lock_treats_local_urls_as_the_paths_they_are(tree):
    locks = tree / "locks"
    code, _, err = run_cli("lock", f"local://{tree}/outside.safetensors", "-o", str(locks / "t.lock"))
    assert code == 2 and "outside the lockfile's folder" in err, err
    code, _, err = run_cli("lock", f"local://{locks}/ok.safetensors", "-o", str(locks / "t.lock"))
    assert code == 0, err
    assert (locks / "t.lock").read_text().splitlines()[1].endswith(" ok.safetensors")  # relative, as a path's
    assert run_cli("check", str(locks / "t.lock"))[0] == 0


def test_a_file_that_is_not_a_lockfile_is_not_quoted(tree):
    code, out, err = run_cli("check", str(tree / "secret.txt"))
    assert code == 2 and "not a tensorcanon lockfile" in err and "TOP-SECRET" not in err + out, err


def test_lock_refuses_a_checkpoint_whose_rank_file_leads_out(tmp_path):
    """The scope judges every file a checkpoint line's digest reads, in `lock` as in `check`."""
    import torch

    import tensorcanon.dcp as dcp

    repo, outside = tmp_path / "repo", tmp_path / "outside"
    repo.mkdir()
    outside.mkdir()
    dcp.save({"w": torch.arange(6.0)}, str(repo / "ckpt"))
    rank = next(p for p in (repo / "ckpt").iterdir() if p.name != "index.safetensors")
    rank.rename(outside / rank.name)
    rank.symlink_to(outside / rank.name)
    with pytest.raises(tensorcanon.FormatError, match=f"{rank.name}.*leads out"):
        lockfile.make_lock([str(repo / "ckpt")], str(repo / "t.lock"))
    entries = lockfile.make_lock([str(repo / "ckpt")], str(repo / "t.lock"), allow=[str(outside)])
    assert [e.path for e in entries] == ["ckpt"]


def test_lock_output_must_be_a_lockfile_or_new(tree):
    ok = tree / "locks" / "ok.safetensors"
    before = ok.read_bytes()
    for argv in (["-o", str(ok), str(ok)],                                # onto the file it locks
                 ["-o", str(ok), str(tree / "locks")],                     # onto a tensor file
                 ["-o", str(tree / "locks" / "t.lock"), str(tree / "locks" / "t.lock")]):  # nothing
        (tree / "locks" / "t.lock").write_text("tensorcanon-lock 2\n")
        code, _, err = run_cli("lock", *argv)
        assert code == 2 and "Traceback" not in err, (argv, err)
    assert ok.read_bytes() == before
    code, _, err = run_cli("lock", "-o", str(tree / "locks" / "t.lock"), str(ok))  # a lockfile: not unasked
    assert code == 2 and "pass --force" in err, err
    code, _, err = run_cli("lock", "--force", "-o", str(tree / "locks" / "t.lock"), str(ok))  # asked: replaced
    assert code == 0, err
    assert lockfile.check_lock(str(tree / "locks" / "t.lock"))[0].ok


def test_follow_redirects_option_must_be_a_bool():
    from tensorcanon.io import storage

    with pytest.raises(tensorcanon.UsageError, match="True or False"):
        storage.open_store("memory://x/a", {storage.REDIRECTS_OPTION: "no"})
