"""A URL that names both an object and a sharded checkpoint (a prefix holding index.safetensors):
refused as ambiguous by every reader and command, by one rule (storage.names_checkpoint), so that
`verify` can never pass on content that `load` does not return. The fast tier, on fsspec's
in-memory filesystem (the same attack against moto's S3: test_storage_attacks.py)."""

import contextlib
import io
import uuid

import fsspec
import pytest
import torch

import tensorcanon as tc
import tensorcanon.dcp as tcd
from tensorcanon import lockfile
from tensorcanon.io import storage
from tensorcanon.tools import cli


@pytest.fixture
def base():
    folder = f"memory://tc-amb-{uuid.uuid4().hex[:8]}"
    yield f"{folder}/model"
    fs = fsspec.filesystem("memory")  # (removed by hand: older fsspec's rm fails on an object that is a folder too)
    root = folder.replace("memory://", "/")
    for name in [k for k in fs.store if k.startswith(root + "/")]:
        del fs.store[name]
    fs.pseudo_dirs[:] = [d for d in fs.pseudo_dirs if not (d == root or d.startswith(root + "/"))]


def run_cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(argv))
    return code, out.getvalue() + err.getvalue()


def test_each_alone_is_read_as_what_it_is(base):
    ckpt = tcd.save({"w": torch.arange(10.0)}, base)
    assert storage.names_checkpoint(storage.Location(base))
    assert tc.verify(base) == ckpt  # tensorcanon.verify of a checkpoint URL: the checkpoint
    with pytest.raises(tc.FormatError, match="is a sharded checkpoint"):
        tc.load(base)
    other = base + "-file"
    digest = tc.save({"w": torch.zeros(3)}, other)
    assert not storage.names_checkpoint(storage.Location(other))
    assert tc.verify(other) == digest and run_cli("verify", other)[0] == 0


def test_both_is_refused_everywhere(base, tmp_path):
    ckpt = tcd.save({"w": torch.arange(10.0)}, base)
    with pytest.raises(tc.UsageError, match="would make that URL name both"):  # (issue 37: tensorcanon never makes it)
        tc.save({"w": torch.zeros(3)}, base)
    with fsspec.open(base, "wb") as f:  # another tool writes the object
        f.write(tc.dumps({"w": torch.zeros(3)}))
    obj = tc.fingerprint({"w": torch.zeros(3)})
    for call in (lambda: tc.load(base), lambda: tc.verify(base), lambda: tc.verify(base, expect=obj),
                 lambda: tc.open(base), lambda: tc.read_metadata(base), lambda: tc.diff(base, base + "/"),
                 lambda: tcd.load_unsharded(base), lambda: tcd.verify(base), lambda: tcd.logical_digest(base),
                 lambda: lockfile.make_lock([base], tmp_path / "t.lock")):
        with pytest.raises(tc.UsageError, match="is ambiguous"):
            call()
    for argv in (["verify", base], ["verify", "--expect", obj, base], ["verify", "--expect", ckpt, base],
                 ["hash", base], ["hash", "--verify", base], ["inspect", base],
                 ["lock", base, "-o", str(tmp_path / "c.lock")]):
        code, text = run_cli(*argv)
        assert code == 2 and "is ambiguous" in text, (argv, code, text)
    assert tc.verify(base + "/") == ckpt  # a trailing '/' names the checkpoint
    assert tcd.verify(base + "/") == ckpt
