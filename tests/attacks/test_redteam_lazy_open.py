"""Red team (lazyred): `tensorcanon.open`'s fast path (pybase64 manifest decoding, top-level key
lookup from the manifest's bytes, libc mmap) against crafted files, differentially against `load`.

The promise (README "Comparing, lazy reading, CI", docs/SECURITY.md "Memory-mapped reading"):
a tensor `open` returns is exactly the one `load` returns; otherwise tensorcanon's own error
(a mapping miss is a KeyError, the Mapping protocol); never a foreign exception, hang or crash.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import struct
import subprocess
import sys
import textwrap

import pytest
import torch
import xxhash

import tensorcanon
from tensorcanon.format.errors import TensorCanonError


def _split(path):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write(path, header, data):
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(text)) + text + data)


def _reseal(path, edit_manifest=None, edit_b64=None):
    """Rewrite the manifest (bytes, then its base64 text) and seal it again with its digest
    (FORMAT.md §2.4: tensorcanon.digest is the xxh3-128 of the manifest bytes)."""
    header, data = _split(path)
    meta = header["__metadata__"]
    manifest = base64.b64decode(meta["tensorcanon.manifest"])
    if edit_manifest is not None:
        manifest = edit_manifest(manifest)
    meta["tensorcanon.digest"] = "xxh3-128:" + xxhash.xxh3_128_hexdigest(manifest)
    text = base64.b64encode(manifest).decode()
    meta["tensorcanon.manifest"] = edit_b64(text) if edit_b64 is not None else text
    _write(path, header, data)


def _tensor_paths(obj, trail="$"):
    if isinstance(obj, torch.Tensor):
        yield trail, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensor_paths(v, trail + "[" + json.dumps(k, ensure_ascii=False) + "]")


def _differential(path, probes, saved=None):
    """Every probe key through open: the tensor load gives for it, or tensorcanon's error/KeyError.
    From a file load refuses, open may still give a tensor it proves on its own (SECURITY.md: "a
    file load refuses for a defect elsewhere can still give the tensors that are proven"): then it
    must be exactly the one saved under that key (``saved``)."""
    try:
        want = dict(_tensor_paths(tensorcanon.load(path)))
    except TensorCanonError:
        want = None
    for key in probes:
        try:
            with tensorcanon.open(path) as f:
                got = f[key]
        except KeyError:
            assert want is None or key not in want, key
            continue
        except TensorCanonError:
            assert want is None or key not in want, key  # a valid file's tensor must be readable
            continue
        if want is None:
            assert saved is not None and key in saved, f"open gave {key} from a file load refuses"
            assert torch.equal(got, saved[key]) and got.dtype == saved[key].dtype, key
            continue
        if not key.startswith("$["):  # a stored tensor name (FORMAT.md §3): its header entry's bytes
            from safetensors.torch import load_file

            expect = load_file(path)[key]
            assert any(torch.equal(expect, w) and expect.dtype == w.dtype for w in want.values()), key
        else:
            assert key in want, f"open gave {key!r}, which load does not hold as a tensor"
            expect = want[key]
        assert torch.equal(got, expect) and got.dtype == expect.dtype, key


TREES = {
    # the key's text in a string value before and after the key, and as a nested key
    "key_in_string_value": {"a": "a", "b": torch.arange(3.0), "c": "b", "z": {"b": torch.ones(2)}},
    "key_only_nested": {"x": {"w": torch.zeros(2)}, "y": torch.ones(1)},
    "key_in_user_metadata_names": {"w": torch.arange(4), "m": {"w": torch.full((2,), 7.0)}},
    "prefix_keys": {"a": torch.ones(1), "ab": torch.zeros(1), "a\"": torch.full((1,), 3.0)},
    "escaped_keys": {'q"]["x': torch.ones(2), "q": {"x": torch.zeros(2)}, "\\": torch.arange(2.0),
                     "é": torch.ones(3), "\u2028": torch.zeros(3), "$": torch.arange(5)},
    "key_is_value_of_other_tensor_name": {"b.a": torch.ones(1), "b": {"a": torch.zeros(1)}},
}


@pytest.mark.parametrize("name", sorted(TREES))
def test_top_level_lookup_matches_load(tmp_path, name):
    path = str(tmp_path / "f.safetensors")
    tree = TREES[name]
    tensorcanon.save(tree, path, metadata={"a": "b", "w": "x"}) if _takes_metadata() else \
        tensorcanon.save(tree, path)
    probes = [p for p, _ in _tensor_paths(tensorcanon.load(path))]
    probes += ['$["a"]', '$["b"]', '$["w"]', '$["x"]', "a", "b", "b.a", "w", "q.x", '$["q"]["x"]', "$"]
    probes += ['$["\\u00e9"]', '$["\\u2028"]', '$["q\\"]"]']  # the same keys escaped otherwise
    _differential(path, probes)


def _takes_metadata():
    import inspect

    return "metadata" in inspect.signature(tensorcanon.save).parameters


def test_duplicate_top_level_key_is_refused(tmp_path):
    """A manifest whose root map holds `b` twice (a second key renamed in place, re-sealed)."""
    path = str(tmp_path / "f.safetensors")
    tensorcanon.save({"a": torch.full((2,), 1.0), "b": torch.full((2,), 2.0)}, path)
    saved = {"a": torch.full((2,), 1.0), "b": torch.full((2,), 2.0)}  # names keep rows and entries: proven alone

    def rename(m):
        root = m.index(b"\xa4root")
        i = m.index(b"\xa1a", root)
        return m[:i] + b"\xa1b" + m[i + 2 :]

    _reseal(path, edit_manifest=rename)
    with pytest.raises(TensorCanonError):
        tensorcanon.load(path)
    _differential(path, ['$["a"]', '$["b"]', "a", "b"], saved)
    with pytest.raises(TensorCanonError), tensorcanon.open(path) as f:
        f.keys()


B64_EDITS = {
    "newline": lambda t: t[:8] + "\n" + t[8:],
    "space": lambda t: t[:8] + " " + t[8:],
    "tab_end": lambda t: t + "\t",
    "crlf_76": lambda t: "\r\n".join(t[i : i + 76] for i in range(0, len(t), 76)),
    "urlsafe": lambda t: t.replace("+", "-").replace("/", "_"),
    "non_alphabet": lambda t: t[:4] + "*" + t[5:],
    "no_padding": lambda t: t.rstrip("="),
    "extra_padding": lambda t: t + "==",
    "padding_inside": lambda t: t[:4] + "====" + t[4:],
    "padding_bits": lambda t: _nonzero_pad_bits(t),
    "trailing_garbage_after_pad": lambda t: t + "AAAA" if t.endswith("=") else t + "A===",
    "unicode_digit": lambda t: t[:4] + "\u0661" + t[5:],
    "nul": lambda t: t[:4] + "\x00" + t[4:],
}


def _nonzero_pad_bits(t):
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    core = t.rstrip("=")
    if len(core) == len(t):
        return t + "A==="  # no padding to abuse: a stray quantum
    last = alphabet.index(core[-1])
    return core[:-1] + alphabet[last | 1] + t[len(core) :]


@pytest.mark.parametrize("edit", sorted(B64_EDITS))
def test_manifest_base64_variants(tmp_path, edit):
    path = str(tmp_path / "f.safetensors")
    # 1 + 2 tensors: manifest lengths vary with the names, so try a few sizes for every padding
    for extra in ("", "x", "xy"):
        tree = {"a" + extra: torch.arange(3.0), "b": {"c": torch.ones(2)}}
        tensorcanon.save(tree, path)
        before = open(path, "rb").read()
        _reseal(path, edit_b64=B64_EDITS[edit])
        if open(path, "rb").read() == before:
            continue  # (this size has no padding, or no + or /: the edit changes nothing)
        with pytest.raises(TensorCanonError):
            tensorcanon.load(path)  # FORMAT.md §9.2.2: strict, canonical base64
        saved = {'$["a' + extra + '"]': tree["a" + extra], '$["b"]["c"]': tree["b"]["c"], "b.c": tree["b"]["c"]}
        _differential(path, list(saved), saved)
        with pytest.raises(TensorCanonError):
            with tensorcanon.open(path) as f:
                f.keys()


def test_truncated_and_odd_files(tmp_path):
    path = str(tmp_path / "f.safetensors")
    tensorcanon.save({"a": torch.arange(3.0), "b": {"c": torch.ones(2)}}, path)
    saved = {'$["a"]': torch.arange(3.0), '$["b"]["c"]': torch.ones(2), "b.c": torch.ones(2)}
    raw = open(path, "rb").read()
    cut = str(tmp_path / "cut.safetensors")
    for n in [0, 1, 7, 8, 9, 16, len(raw) // 2, len(raw) - 9, len(raw) - 1]:
        open(cut, "wb").write(raw[:n])
        _differential(cut, ['$["a"]', '$["b"]["c"]', "b.c"], saved)  # a tensor whose bytes remain: proven
        with pytest.raises(TensorCanonError), tensorcanon.open(cut) as f:
            f.keys()
    open(cut, "wb").write(raw + b"\0")  # trailing byte
    _differential(cut, ['$["a"]', '$["b"]["c"]'], saved)
    with pytest.raises(TensorCanonError):
        tensorcanon.open(str(tmp_path))  # a directory
    with pytest.raises(TensorCanonError):
        tensorcanon.open(str(tmp_path / "missing.safetensors"))


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs")
def test_fifo_does_not_hang(tmp_path):
    fifo = str(tmp_path / "p.safetensors")
    os.mkfifo(fifo)
    old = signal.signal(signal.SIGALRM, lambda *a: (_ for _ in ()).throw(TimeoutError("hang")))
    signal.alarm(5)
    try:
        with pytest.raises(TensorCanonError):
            tensorcanon.open(fifo)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_invalid_corpus_refused_as_load_refuses():
    corpus = os.path.join(os.path.dirname(__file__), "..", "conformance", "invalid")
    for name in sorted(os.listdir(corpus)):
        path = os.path.join(corpus, name)
        if not name.endswith(".bin"):
            continue
        try:
            with tensorcanon.open(path) as f:
                probes = ['$["a"]', '$["x"]', "x", "a"]
                for key in probes:
                    try:
                        got = f[key]
                    except (KeyError, TensorCanonError):
                        continue
                    _differential(path, [key])  # a returned tensor must be load's
                    del got
        except TensorCanonError:
            pass


def test_truncate_and_rewrite_after_open(tmp_path):
    """Changed in place or truncated while open holds the map: a later read refuses (hash, or
    the size check SECURITY.md describes) instead of a wrong answer or SIGBUS (one process)."""
    path = str(tmp_path / "f.safetensors")
    tensorcanon.save({"a": torch.arange(4096.0), "b": torch.ones(4096), "c": torch.zeros(2)}, path)
    code = textwrap.dedent(
        f"""
        import os, torch, tensorcanon
        from tensorcanon.format.errors import TensorCanonError
        p = {path!r}
        f = tensorcanon.open(p)
        a = f['$["a"]']
        size = os.path.getsize(p)
        with open(p, "r+b") as fh:  # rewrite in place: b's bytes
            fh.seek(size - 4096 * 4); fh.write(b"\\x01" * 64)
        try:
            f['$["b"]']; print("b-read")
        except TensorCanonError:
            print("b-refused")
        os.truncate(p, 64)
        for k in ('$["c"]', "c", '$["b"]'):
            try:
                f[k]; print("read-after-truncate")
            except (TensorCanonError, KeyError):
                print("refused")
        assert torch.equal(a, torch.arange(4096.0))
        f.close()
        print("done")
        """
    )
    env = dict(os.environ)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    lines = out.stdout.split()
    assert lines[0] == "b-refused" and "read-after-truncate" not in lines and lines[-1] == "done", out.stdout
