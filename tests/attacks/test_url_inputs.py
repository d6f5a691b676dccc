"""No command destroys its input through any path or URL, and no save makes a URL ambiguous
(issue 37, item 7).

Each attack names a command's output by another spelling of one of its inputs: a URL of fsspec's
in-memory filesystem written two ways (``memory://a`` and ``memory:///a``, with and without a
trailing ``/``), a ``local://`` or ``file://`` URL of a local file, a symlink, ``./x`` for ``x``.
Each is refused before a byte is written (exit 2 on the command line), and the input still verifies
after. The last test runs the two URL attacks against moto's S3 server.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import uuid

import fsspec
import pytest
import torch

import tensorcanon as tc
import tensorcanon.dcp as tcd
from tensorcanon.tools import cli


def run_cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main([str(a) for a in argv])
    return code, out.getvalue() + err.getvalue()


@pytest.fixture
def mem():
    """A fresh folder of fsspec's in-memory filesystem: ``(memory://name, memory:///name)``."""
    name = f"tc-urls-{uuid.uuid4().hex[:8]}"
    yield f"memory://{name}", f"memory:///{name}"
    fs = fsspec.filesystem("memory")
    for key in [k for k in fs.store if k.startswith(f"/{name}/") or k == f"/{name}"]:
        del fs.store[key]
    fs.pseudo_dirs[:] = [d for d in fs.pseudo_dirs if not (d == f"/{name}" or d.startswith(f"/{name}/"))]


STATE = {"w": torch.arange(12.0).reshape(3, 4), "step": 7}


def _rank_file(folder: str) -> str:
    from tensorcanon.sharded import layout

    index = layout.read(folder)
    return index.file_path(0)


# ------------------------------------------------------------------ consolidate


def test_consolidate_into_its_own_checkpoint_through_a_url_is_refused(mem):
    one, other = mem
    ckpt = tcd.save(STATE, f"{one}/ckpt")
    rank = _rank_file(f"{one}/ckpt")
    outs = [f"{one}/ckpt/index.safetensors", f"{other}/ckpt/index.safetensors", f"{other}/ckpt/index.safetensors/",
            rank, rank.replace(one, other), f"{one}/ckpt", f"{other}/ckpt/"]
    for source in (f"{one}/ckpt", f"{other}/ckpt/"):
        for out in outs:
            with pytest.raises(tc.UsageError, match="being read, which writing it would destroy"):
                tcd.consolidate(source, out)
            code, text = run_cli("consolidate", source, out)
            assert code == 2 and "would destroy" in text, (source, out, text)
            assert tcd.verify(f"{one}/ckpt") == ckpt, (source, out)
    assert tcd.consolidate(f"{one}/ckpt", f"{one}/ckpt/merged.safetensors") == ckpt  # a new object under it: fine
    assert tc.verify(f"{one}/ckpt/merged.safetensors") == ckpt == tcd.verify(f"{one}/ckpt")


def test_consolidate_into_its_own_local_checkpoint_through_a_url_or_alias_is_refused(tmp_path, monkeypatch):
    folder = tmp_path / "ckpt"
    ckpt = tcd.save(STATE, folder)
    index = folder / "index.safetensors"
    (tmp_path / "link").symlink_to(index)
    monkeypatch.chdir(tmp_path)
    for out in (f"local://{index}", f"file://{index}", tmp_path / "link", "./ckpt/index.safetensors",
                f"local://{_rank_file(str(folder))}", f"local://{folder}"):
        with pytest.raises(tc.UsageError, match="would destroy"):
            tcd.consolidate("ckpt", out)
        assert run_cli("consolidate", "./ckpt", out)[0] == 2, out
    assert tcd.verify(folder) == ckpt


def test_consolidate_onto_another_checkpoints_prefix_is_refused(mem):
    one, other = mem
    first = tcd.save(STATE, f"{one}/a")
    second = tcd.save({"w": torch.ones(2)}, f"{one}/b")
    with pytest.raises(tc.UsageError, match="would make that URL name both"):
        tcd.consolidate(f"{one}/a", f"{other}/b")
    assert tcd.verify(f"{one}/b") == second and tcd.verify(f"{one}/a") == first
    assert not fsspec.filesystem("memory").isfile(f"{one}/b")


# ------------------------------------------------------------------ save


def test_save_onto_a_checkpoints_prefix_is_refused_naming_both(mem):
    one, other = mem
    ckpt = tcd.save(STATE, f"{one}/model")
    for url in (f"{one}/model", f"{other}/model", f"{one}/model/"):
        with pytest.raises(tc.UsageError) as info:
            tc.save({"x": 1}, url)
        shown = url.rstrip("/")
        assert f"{shown}/index.safetensors" in str(info.value) and f"{shown!r}" in str(info.value)
    assert tc.verify(f"{one}/model/") == ckpt == tcd.verify(f"{one}/model")  # not ambiguous: no object was made
    assert tc.save({"x": 1}, f"{one}/model-2") == tc.fingerprint({"x": 1})  # another name is fine


# ------------------------------------------------------------------ convert, lock, diverge


def test_convert_over_its_input_is_refused_by_any_spelling_even_with_force(tmp_path, monkeypatch, mem):
    one, other = mem
    path = tmp_path / "m.safetensors"
    digest = tc.save(STATE, path)
    (tmp_path / "link.safetensors").symlink_to(path)
    monkeypatch.chdir(tmp_path)
    for out in ("./m.safetensors", tmp_path / "link.safetensors", f"file://{path}", f"local://{path}"):
        for to in ("tensorcanon", "safetensors"):
            code, text = run_cli("convert", "m.safetensors", out, "--force", "--to", to)
            assert code == 2 and "would destroy the input" in text, (out, to, text)
    assert tc.verify(path) == digest
    url = tc.save(STATE, f"{one}/m.safetensors") and f"{one}/m.safetensors"
    code, text = run_cli("convert", url, f"{other}/m.safetensors", "--force", "--algorithm", "sha256")
    assert code == 2 and "would destroy the input" in text
    assert tc.verify(url) == digest
    ckpt = tcd.save(STATE, tmp_path / "ckpt")
    for out in ("ckpt/index.safetensors", f"local://{tmp_path}/ckpt/index.safetensors", _rank_file("ckpt")):
        code, text = run_cli("convert", "ckpt", out, "--force")
        assert code == 2 and "would destroy the input" in text, (out, text)
    assert tcd.verify(tmp_path / "ckpt") == ckpt


def test_convert_to_a_url_that_exists_needs_force(tmp_path, mem):
    one, _ = mem
    src = tmp_path / "m.safetensors"
    tc.save(STATE, src)
    target = f"{one}/out.safetensors"
    before = tc.save({"other": 1}, target)
    code, text = run_cli("convert", src, target, "--to", "tensorcanon")
    assert code == 2 and "already exists; pass --force" in text
    assert tc.verify(target) == before
    assert run_cli("convert", src, target, "--to", "tensorcanon", "--force")[0] == 0
    assert tc.verify(target) == tc.verify(src)


def test_lock_and_diverge_never_write_over_an_input(tmp_path, monkeypatch):
    model = tmp_path / "m.safetensors"
    digest = tc.save(STATE, model)
    (tmp_path / "link").symlink_to(model)
    monkeypatch.chdir(tmp_path)
    for out in ("./m.safetensors", "link"):
        code, text = run_cli("lock", "m.safetensors", "-o", out)
        assert code == 2 and "not a lockfile" in text, (out, text)
    (tmp_path / "a.trace").write_bytes(b"trace a")
    (tmp_path / "b.trace").write_bytes(b"trace b")
    (tmp_path / "alias.trace").symlink_to(tmp_path / "b.trace")
    for out in ("./a.trace", "alias.trace", tmp_path / "a.trace"):
        code, text = run_cli("diverge", "a.trace", "b.trace", "--html", out)
        assert code == 2 and "would destroy" in text, (out, text)
    assert (tmp_path / "a.trace").read_bytes() == b"trace a" and (tmp_path / "b.trace").read_bytes() == b"trace b"
    assert tc.verify(model) == digest


# ------------------------------------------------------------------ every refusal names its path


def test_a_subclass_of_a_registered_dataclass_is_refused_at_its_path():
    @dataclasses.dataclass
    class Base:
        lr: float = 0.1

    @dataclasses.dataclass
    class Child(Base):
        warmup: int = 3

    tc.register(Base)
    try:
        with pytest.raises(tc.UnsupportedTypeError) as info:
            tc.dumps({"cfg": [Base(), Child()]})
        assert info.value.path == '$["cfg"][1]' and str(info.value).endswith('(at $["cfg"][1])')
        assert "tensorcanon.register(" in str(info.value)
    finally:
        tc.unregister(Base)


# ------------------------------------------------------------------ against moto's S3 server


def test_the_url_attacks_on_s3(s3_direct):
    from s3_support import BUCKET

    opts, _ = s3_direct
    base = f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}"
    ckpt = tcd.save(STATE, f"{base}/model", storage_options=opts)
    with pytest.raises(tc.UsageError, match="would make that URL name both"):
        tc.save({"x": 1}, f"{base}/model", storage_options=opts)
    for out in (f"{base}/model/index.safetensors", f"{base}/model"):
        with pytest.raises(tc.UsageError):
            tcd.consolidate(f"{base}/model/", out, storage_options=opts)
    assert tcd.verify(f"{base}/model", storage_options=opts) == ckpt
    assert tc.verify(f"{base}/model/", storage_options=opts) == ckpt
