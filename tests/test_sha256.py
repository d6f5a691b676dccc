"""The opt-in SHA-256 digest: ``save(..., algorithm="sha256")``.

Digests are recomputed here independently (hashlib, the header parsed by hand),
so these tests pin the format, not just the library agreeing with itself.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import pathlib
import struct
import subprocess
import sys

import msgpack
import pytest
import torch

import tensorcanon as tc
from tensorcanon.format import digest

from support import WriteOnlyStream, run_cli

GOLDEN = pathlib.Path(__file__).parent / "golden"
SHA_RE = r"sha256:[0-9a-f]{64}"


def _obj():
    return {
        "model": {"fc.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3),
                  "fc.bias": torch.tensor([0.5, -1.0], dtype=torch.float64)},
        "ids": torch.arange(5),
        "step": 7,
        "tags": {"b", "a", "c"},
    }


def _split(data: bytes):
    """(header JSON, data section start) of a file, parsed without tensorcanon."""
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), 8 + n


def _manifest_raw(data: bytes) -> bytes:
    header, _ = _split(data)
    return base64.b64decode(header["__metadata__"]["tensorcanon.manifest"])


def _rebuild(data: bytes, manifest: dict, file_algorithm: str) -> bytes:
    """``data`` with its manifest replaced (canonical msgpack) and the file digest recomputed."""
    header, start = _split(data)
    raw = msgpack.packb(manifest, use_bin_type=True)
    meta = dict(header["__metadata__"])
    meta["tensorcanon.manifest"] = base64.b64encode(raw).decode()
    h = hashlib.sha256(raw).hexdigest() if file_algorithm == "sha256" else digest.manifest_digest(raw).hex()
    meta["tensorcanon.digest"] = f"{file_algorithm}:{h}"
    header["__metadata__"] = meta
    text = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data[start:]


# ----------------------------------------------------------------- round trip


def test_round_trip_with_sha256(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    d = tc.save(_obj(), path, algorithm="sha256")
    assert digest.is_text(d) and d.startswith("sha256:") and len(d) == len("sha256:") + 64
    out = tc.load(path)
    assert out["step"] == 7 and out["tags"] == {"a", "b", "c"}
    assert torch.equal(out["model"]["fc.weight"], _obj()["model"]["fc.weight"])
    assert out["model"]["fc.bias"].dtype == torch.float64
    assert tc.verify(path) == d == tc.verify(path, expect=d)
    assert tc.fingerprint(_obj(), algorithm="sha256") == d
    data = path.read_bytes()
    assert tc.dumps(_obj(), algorithm="sha256") == data
    assert tc.save(_obj(), io.BytesIO(), algorithm="sha256") == d
    assert tc.dumps(tc.loads(data), algorithm="sha256") == data  # load + save again: same bytes
    with tc.open(path) as f:
        assert f.digest == d and f.algorithm == "sha256"
        assert torch.equal(f['$["ids"]'], torch.arange(5))


def test_non_seekable_target_gives_the_same_bytes():
    s = WriteOnlyStream()
    d = tc.save(_obj(), s, algorithm="sha256")
    assert s.data == tc.dumps(_obj(), algorithm="sha256")
    assert tc.verify(s.data) == d


def test_the_algorithm_is_recorded_in_the_manifest():
    data = tc.dumps(_obj(), algorithm="sha256")
    m = msgpack.unpackb(_manifest_raw(data), raw=False)
    assert m["algorithm"] == "sha256" and m["version"] == 3 == tc.FORMAT_VERSION
    assert all(len(row["digest"]) == 32 for row in m["tensors"])
    assert msgpack.unpackb(_manifest_raw(tc.dumps(_obj())), raw=False)["algorithm"] == "xxh3-128"


# ----------------------------------------------------------------- independent recomputation


def test_file_digest_is_sha256_of_the_canonical_manifest():
    data = tc.dumps(_obj(), metadata={"epoch": 3}, algorithm="sha256")
    header, _ = _split(data)
    raw = _manifest_raw(data)
    expected = "sha256:" + hashlib.sha256(raw).hexdigest()
    assert header["__metadata__"]["tensorcanon.digest"] == expected
    assert tc.verify(data) == expected
    assert tc.fingerprint(_obj(), metadata={"epoch": 3}, algorithm="sha256") == expected


def test_tensor_digest_is_sha256_of_prefix_and_bytes():
    w = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    data = tc.dumps({"w": w}, algorithm="sha256")
    (row,) = msgpack.unpackb(_manifest_raw(data), raw=False)["tensors"]
    assert row["name"] == "w" and row["dtype"] == "float32" and row["shape"] == [2, 3]
    payload = w.numpy().astype("<f4").tobytes()
    assert row["digest"] == hashlib.sha256(b"float32[2,3]" + payload).digest()
    # ...and those are the bytes stored in the file
    header, start = _split(data)
    b, e = header["w"]["data_offsets"]
    assert data[start + b : start + e] == payload


# ----------------------------------------------------------------- damage and hostile files


def _flip_first_data_byte(data: bytes, name: str) -> bytes:
    header, start = _split(data)
    b, _ = header[name]["data_offsets"]
    out = bytearray(data)
    out[start + b] ^= 0x01
    return bytes(out)


def test_bit_flip_in_tensor_data_names_the_tensor(tmp_path):
    data = _flip_first_data_byte(tc.dumps(_obj(), algorithm="sha256"), "model.fc.weight")
    for call in (tc.loads, tc.verify):
        with pytest.raises(tc.IntegrityError) as info:
            call(data)
        assert info.value.path == '$["model"]["fc.weight"]'
        assert '$["model"]["fc.weight"]' in str(info.value) and "damaged" in str(info.value)
        assert info.value.expected.startswith("sha256:") and info.value.actual.startswith("sha256:")
    path = tmp_path / "bad.safetensors"
    path.write_bytes(data)
    with tc.open(path) as f:
        assert torch.equal(f['$["ids"]'], torch.arange(5))  # an undamaged tensor still reads
        with pytest.raises(tc.IntegrityError, match=r'\$\["model"\]\["fc.weight"\]'):
            f['$["model"]["fc.weight"]']


def test_sha256_claim_with_16_byte_digests_is_a_format_error():
    data = tc.dumps(_obj())  # xxh3-128: 16-byte tensor digests
    m = msgpack.unpackb(_manifest_raw(data), raw=False)
    m["algorithm"] = "sha256"
    bad = _rebuild(data, m, "sha256")  # the file digest itself is valid sha256
    with pytest.raises(tc.FormatError, match=r"digest must be 32 bytes for algorithm 'sha256', not 16 bytes"):
        tc.loads(bad)
    with pytest.raises(tc.FormatError):
        tc.verify(bad)


def test_recorded_file_digest_must_use_the_manifest_algorithm():
    data = tc.dumps(_obj(), algorithm="sha256")
    m = msgpack.unpackb(_manifest_raw(data), raw=False)
    bad = _rebuild(data, m, "xxh3-128")  # a valid xxh3 digest of a manifest that says sha256
    with pytest.raises(tc.FormatError, match="is a xxh3-128 digest but the manifest says the file uses sha256"):
        tc.loads(bad)


@pytest.mark.parametrize("name", ["md5", "SHA256", "sha-256", "", 256, None])
def test_unknown_algorithm_in_a_file_is_a_format_error(name):
    data = tc.dumps(_obj(), algorithm="sha256")
    m = msgpack.unpackb(_manifest_raw(data), raw=False)
    m["algorithm"] = name
    with pytest.raises(tc.FormatError, match="is not supported"):
        tc.loads(_rebuild(data, m, "sha256"))


def test_tampering_with_a_tensor_and_its_digest_is_caught_by_the_file_digest():
    data = tc.dumps({"w": torch.zeros(4)}, algorithm="sha256")
    header, start = _split(data)
    m = msgpack.unpackb(_manifest_raw(data), raw=False)
    evil = torch.ones(4).numpy().tobytes()
    m["tensors"][0]["digest"] = hashlib.sha256(b"float32[4]" + evil).digest()
    raw = msgpack.packb(m, use_bin_type=True)
    meta = header["__metadata__"]
    meta["tensorcanon.manifest"] = base64.b64encode(raw).decode()  # file digest left as it was
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    tampered = struct.pack("<Q", len(text)) + text + evil
    with pytest.raises(tc.IntegrityError, match="does not match the file digest"):
        tc.loads(tampered)
    # An attacker who also rewrites the recorded file digest gets a self-consistent file...
    rewritten = _rebuild(tampered, m, "sha256")
    assert torch.equal(tc.loads(rewritten)["w"], torch.ones(4))
    # ...which only a digest obtained out of band exposes.
    with pytest.raises(tc.IntegrityError, match="expected"):
        tc.verify(rewritten, expect=tc.verify(data))


# ----------------------------------------------------------------- arguments


def test_unknown_algorithm_argument_is_refused_before_writing(tmp_path):
    path = tmp_path / "x.safetensors"
    for call in (lambda a: tc.save({"x": 1}, path, algorithm=a), lambda a: tc.dumps({"x": 1}, algorithm=a),
                 lambda a: tc.fingerprint({"x": 1}, algorithm=a)):
        with pytest.raises(tc.UnsupportedAlgorithmError) as info:
            call("md5")
        assert isinstance(info.value, tc.TensorCanonError) and isinstance(info.value, ValueError)
        assert "'md5'" in str(info.value) and "sha256" in str(info.value) and "xxh3-128" in str(info.value)
    assert not path.exists() and os.listdir(tmp_path) == []


def test_verify_expect_with_the_other_algorithm_says_so():
    data = tc.dumps(_obj(), algorithm="sha256")
    xxh = tc.fingerprint(_obj())
    with pytest.raises(tc.IntegrityError) as info:
        tc.verify(data, expect=xxh)
    text = str(info.value)
    assert "the file uses sha256 digests but expect is a xxh3-128 digest" in text
    assert info.value.expected == xxh and info.value.actual == tc.verify(data)
    with pytest.raises(tc.IntegrityError, match="the file uses xxh3-128 digests but expect is a sha256 digest"):
        tc.verify(tc.dumps(_obj()), expect=tc.verify(data))
    # same algorithm, different digest: the plain mismatch message
    with pytest.raises(tc.IntegrityError, match=r"file digest is sha256:\w+, expected sha256:0{64}"):
        tc.verify(data, expect="sha256:" + "0" * 64)


@pytest.mark.parametrize("bad", ["nope", "sha256:" + "0" * 63, "SHA256:" + "0" * 64, "sha256:" + "A" * 64,
                                 "xxh3-128:" + "0" * 64, "md5:" + "0" * 32])
def test_verify_expect_malformed_is_a_usage_error(bad, tmp_path):
    # the argument is wrong, not the file: a UsageError (a ValueError too), before the file is read
    for target in (tc.dumps(_obj()), str(tmp_path / "not-even-there.safetensors")):
        with pytest.raises(tc.UsageError, match="is not a digest .*'xxh3-128:' and 32 .*'sha256:' and 64") as info:
            tc.verify(target, expect=bad)
        assert isinstance(info.value, ValueError) and str(info.value).startswith("expect=")


def test_digest_text_helpers():
    raw = bytes(range(32))
    text = digest.to_text(raw, "sha256")
    assert text == "sha256:" + raw.hex() and digest.is_text(text)
    assert digest.parse_text(text) == ("sha256", raw) and digest.from_text(text) == raw
    assert digest.parse_text("xxh3-128:" + "ab" * 16) == ("xxh3-128", bytes([0xAB]) * 16)
    assert digest.size("sha256") == 32 and digest.size("xxh3-128") == 16
    with pytest.raises(ValueError):
        digest.to_text(bytes(16), "sha256")
    with pytest.raises(tc.UnsupportedAlgorithmError):
        digest.tensor_hasher("float32", [1], "blake3")


# ----------------------------------------------------------------- determinism, default unchanged


_CHILD = """
import sys, hashlib, torch, tensorcanon as tc
obj = {"z": 1, "a": {"set": {"x", "y", "q", "long string"}, "fs": frozenset({"k1", "k2", "k3"})},
       "w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "t": ("b", "a")}
file_digest = hashlib.sha256(tc.dumps(obj, algorithm="sha256")).hexdigest()
sys.stdout.write(file_digest + " " + tc.fingerprint(obj, algorithm="sha256"))
"""


def test_same_bytes_across_processes_with_different_hash_seeds():
    outs = []
    for seed in ("0", "1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        proc = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        outs.append(proc.stdout)
    assert outs[0] == outs[1] == outs[2]
    assert outs[0].split(" ")[1].startswith("sha256:")


@pytest.mark.parametrize("name", ["checkpoint", "state_dict", "metadata"])
def test_default_output_is_byte_identical_to_golden(name):
    sys.path.insert(0, str(GOLDEN))
    try:
        import vectors
    finally:
        sys.path.remove(str(GOLDEN))
    obj, meta = vectors.build(name)
    golden = (GOLDEN / f"{name}.safetensors").read_bytes()
    assert tc.dumps(obj, metadata=meta) == golden
    assert tc.dumps(obj, metadata=meta, algorithm="xxh3-128") == golden
    recorded = json.loads((GOLDEN / "digests.json").read_text())["digests"][name]
    assert tc.verify(golden) == recorded == tc.fingerprint(obj, metadata=meta)
    assert tc.fingerprint(obj, metadata=meta, algorithm="sha256") != recorded


# ----------------------------------------------------------------- command line


def test_cli_verify_and_hash_accept_sha256(tmp_path):
    path = str(tmp_path / "m.safetensors")
    d = tc.save(_obj(), path, algorithm="sha256")
    code, out, _ = run_cli("verify", "--expect", d, path)
    assert code == 0 and out == f"OK        {path}  {d}\n"
    code, out, _ = run_cli("verify", "--expect", "sha256:" + "0" * 64, path)
    assert code == 1 and out.startswith(f"MISMATCH  {path}: digest {d}, expected sha256:")
    xxh = tc.fingerprint(_obj())
    code, out, _ = run_cli("verify", "--expect", xxh, path)
    assert code == 1 and "the file uses sha256 digests, --expect is xxh3-128" in out
    code, out, _ = run_cli("hash", path)
    assert code == 0 and out == f"{d}  {path}\n"
    code, out, _ = run_cli("hash", "--verify", path)
    assert code == 0 and out == f"{d}  {path}\n"
    code, out, _ = run_cli("inspect", "--json", path)
    rows = json.loads(out)["entries"]
    assert code == 0 and json.loads(out)["digest"] == d
    assert all(r["digest"].startswith("sha256:") and len(r["digest"]) == 71 for r in rows if r["dtype"])
    code, _, err = run_cli("verify", "--expect", "sha256:abc", path)
    assert code == 2 and "'sha256:' and 64 lowercase hex digits" in err


def test_cli_verify_corrupt_sha256_file(tmp_path):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(_flip_first_data_byte(tc.dumps(_obj(), algorithm="sha256"), "ids"))
    code, out, _ = run_cli("verify", str(path))
    assert code == 1 and out.startswith(f"CORRUPT   {path}: tensor $[\"ids\"]")


def test_cli_convert_with_algorithm(tmp_path):
    src = str(tmp_path / "in.safetensors")
    tc.save(_obj(), src)
    dst = str(tmp_path / "out.safetensors")
    code, out, _ = run_cli("convert", "--algorithm", "sha256", src, dst)  # implies --to tensorcanon
    d = tc.fingerprint(_obj(), algorithm="sha256")
    assert code == 0 and out == f"wrote {dst} (tensorcanon, {d})\n"
    assert tc.verify(dst) == d and open(dst, "rb").read() == tc.dumps(_obj(), algorithm="sha256")
    code, _, err = run_cli("convert", "--to", "safetensors", "--algorithm", "sha256", src, dst)
    assert code == 2 and "--algorithm sha256 applies to tensorcanon output only" in err
    code, _, err = run_cli("convert", "--algorithm", "md5", src, dst)
    assert code == 2 and "invalid choice" in err
    # tensorcanon -> tensorcanon keeps the input's algorithm: identical bytes
    same = str(tmp_path / "same.safetensors")
    code, _, _ = run_cli("convert", "--to", "tensorcanon", dst, same)
    assert code == 0 and open(same, "rb").read() == open(dst, "rb").read()
    # back to xxh3-128: the default bytes again
    back = str(tmp_path / "back.safetensors")
    code, _, _ = run_cli("convert", "--algorithm", "xxh3-128", dst, back)
    assert code == 0 and open(back, "rb").read() == open(src, "rb").read()


def test_cli_lock_and_check_with_sha256(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    d = tc.save(_obj(), "m.safetensors", algorithm="sha256")
    code, _, _ = run_cli("lock", "m.safetensors", "-o", "t.lock")
    assert code == 0
    assert (tmp_path / "t.lock").read_text().splitlines()[1].startswith(d + " ")
    code, out, _ = run_cli("check", "t.lock")
    assert code == 0 and "1 file matches" in out


def test_real_process_verify_expect_sha256(tmp_path):
    path = str(tmp_path / "m.safetensors")
    d = tc.save(_obj(), path, algorithm="sha256")
    proc = subprocess.run([sys.executable, "-m", "tensorcanon", "verify", "--expect", d, path],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"OK        {path}  {d}\n"


def test_a_malformed_expect_for_a_sharded_checkpoint_is_a_usage_error_too(tmp_path):
    import tensorcanon.dcp as tcd

    folder = str(tmp_path / "ckpt")
    tcd.save({"w": torch.ones(2)}, folder)
    for verify in (tc.verify, tcd.verify):
        with pytest.raises(tc.UsageError, match=r"^expect='sha256:…' is not a digest"):
            verify(folder, expect="sha256:…")
