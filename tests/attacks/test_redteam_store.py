"""Red-team attacks on ``tensorcanon.Store`` and ``tensorcanon store ls|verify|export|gc|stats``,
written from docs/STORE.md (its user guide and Layout section), README.md and docs/SECURITY.md only.

A store is untrusted input. Blobs are crafted here from the Layout spec by an independent encoder
(struct + xxhash + zstandard), so a lie in a header is told the way any writer could tell it. Each
attack expects what the docs promise: the library's own error naming the tag, blob or path, no
foreign exception, no allocation for a claim, ``store verify`` exit 1 on damage, 2 on error, and no
store bytes quoted raw to a terminal.

Every blob here is written loose (the autouse fixture ``loose``), as layout 1 wrote them, so that
the crafted blobs replace files; the attacks on packs are in tests/attacks/test_store_attacks.py."""

import os
import struct
import tracemalloc

import pytest
import torch
import xxhash

import tensorcanon as tc
from tensorcanon.tools import cli

zstd = pytest.importorskip("zstandard")


@pytest.fixture(autouse=True)
def loose(monkeypatch):
    from tensorcanon.store import store as store_module

    monkeypatch.setattr(store_module, "PACK_BLOB_LIMIT", 0)

MAGIC = b"tcstore\x01"
RAW, ZSTD, GROUPED, DELTA, DELTA_SUB = 0, 1, 2, 3, 4


# ------------------------------------------------------------------ an independent encoder (Layout)

def prefix_of(t):
    dims = ",".join(str(d) for d in t.shape)
    return f"{str(t.dtype).removeprefix('torch.')}[{dims}]".encode()


def raw_bytes(t):
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def digest_of(prefix, data):
    return xxhash.xxh3_128(prefix + data).digest()


def blob_path(root, d):
    h = d.hex()
    return root / "blobs" / "xxh3-128" / h[:2] / h


def head(codec, depth, prefix, size, base=b"", pad=b"\x00"):
    h = MAGIC + struct.pack("<BBHQ", codec, depth, len(prefix), size) + prefix + base
    return h + pad * (-len(h) % 64)


def planes_of(data, k, compress=True):
    planes = [data[i::k] for i in range(k)]
    table, body = b"", b""
    for p in planes:
        if compress:
            f = zstd.ZstdCompressor(level=1, write_content_size=True).compress(p)
            table += struct.pack("<B7xQ", 1, len(f))
            body += f
        else:
            table += struct.pack("<B7xQ", 0, len(p))
            body += p
    return table + body


def errors_are_ours(call, *, match=None):
    """``call`` raises a TensorCanonError (never a foreign exception); returns its text."""
    try:
        call()
    except tc.TensorCanonError as e:
        text = str(e)
        if match is not None:
            assert match in text, text
        return text
    except Exception as e:  # noqa: BLE001 — the attack's point: nothing foreign escapes
        pytest.fail(f"foreign exception {type(e).__name__}: {e}")
    pytest.fail("accepted hostile input")


def run_cli(capsys, *argv):
    code = cli.main(["store", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def st(tmp_path):
    """A store with tags ``a`` (random floats, zeros, small ints) and ``b`` (a's floats drifted: a
    delta of depth 1), and the tensors of each."""
    root = tmp_path / "st"
    g = torch.Generator().manual_seed(7)
    w = torch.randn(64, 64, generator=g)
    z = torch.zeros(4096)
    i = torch.randint(0, 5, (300,), dtype=torch.int8, generator=g)
    s = tc.Store(root)
    a = {"w": w, "z": z, "i": i}
    b = {"w": w + 1e-6 * torch.randn(64, 64, generator=g), "z": z}
    s.save("a", a)
    s.save("b", b)
    return root, a, b


def refused(root, tag, match=None):
    """Every reader refuses ``tag`` with our own error; ``store verify`` exits 1 (damage)."""
    for call in (lambda: tc.Store(root).load(tag), lambda: tc.Store(root).verify(tag),
                 lambda: tc.Store(root).verify(), lambda: tc.Store(root).export(tag, str(root) + ".out")):
        errors_are_ours(call, match=match)
    assert not os.path.exists(str(root) + ".out")
    assert cli.main(["store", "verify", str(root)]) == 1
    assert cli.main(["store", "verify", str(root), tag]) == 1


def replace_blob(root, t, blob):
    d = digest_of(prefix_of(t), raw_bytes(t))
    path = blob_path(root, d)
    assert path.exists()
    path.write_bytes(blob)
    return path, d


# ------------------------------------------------------------------ blob headers that lie

@pytest.mark.parametrize("how", [
    "magic", "version", "codec_9", "raw_depth_1", "grouped_depth_3", "prefix_len_huge", "prefix_len_0",
    "prefix_other_shape", "prefix_not_utf8", "prefix_escape", "prefix_spaces", "prefix_leading_zero",
    "size_too_big", "size_too_small", "size_2_63", "pad_nonzero", "trailing", "truncated", "empty",
    "header_only",
])
def test_raw_blob_header_lies(st, how):
    root, a, _ = st
    t = a["i"]  # int8[300]: written raw (small random ints of a single byte pay no compression)
    prefix, data = prefix_of(t), raw_bytes(t)
    good = head(RAW, 0, prefix, len(data)) + data
    blob = {
        "magic": b"tcstorX\x01" + good[8:],
        "version": b"tcstore\x02" + good[8:],
        "codec_9": head(9, 0, prefix, len(data)) + data,
        "raw_depth_1": head(RAW, 1, prefix, len(data)) + data,
        "grouped_depth_3": head(GROUPED, 3, prefix, len(data)) + planes_of(data, 1),
        "prefix_len_huge": MAGIC + struct.pack("<BBHQ", RAW, 0, 65535, len(data)) + prefix + data,
        "prefix_len_0": head(RAW, 0, b"", len(data)) + data,
        "prefix_other_shape": head(RAW, 0, b"int8[3,100]", len(data)) + data,
        "prefix_not_utf8": head(RAW, 0, b"int8[300]\xff\xfe", len(data)) + data,
        "prefix_escape": head(RAW, 0, b"\x1b[2J\x1b]0;pwned\x07", len(data)) + data,
        "prefix_spaces": head(RAW, 0, b"int8[ 300]", len(data)) + data,
        "prefix_leading_zero": head(RAW, 0, b"int8[0300]", len(data)) + data,
        "size_too_big": head(RAW, 0, prefix, len(data) + 1) + data + b"\x00",
        "size_too_small": head(RAW, 0, prefix, len(data) - 1) + data[:-1],
        "size_2_63": head(RAW, 0, prefix, 1 << 63) + data,
        "pad_nonzero": head(RAW, 0, prefix, len(data), pad=b"\x01") + data,
        "trailing": good + b"\x00",
        "truncated": good[:-1],
        "empty": b"",
        "header_only": good[:20],
    }[how]
    if how == "pad_nonzero" and blob == good:
        pytest.skip("no padding in this header")
    replace_blob(root, t, blob)
    refused(root, "a")


def test_blob_errors_never_quote_store_bytes_raw(st, capsys):
    root, a, _ = st
    t = a["i"]
    data = raw_bytes(t)
    replace_blob(root, t, head(RAW, 0, b"\x1b[2J\x1b]0;pwned\x07int8[300]", len(data)) + data)
    for argv in (("verify", root), ("verify", root, "a"), ("export", root, "a", root.parent / "o.st"),
                 ("ls", root), ("stats", root), ("verify", "--json", root)):
        code, out, err = run_cli(capsys, *argv)
        assert "\x1b" not in out + err and "\x07" not in out + err, (argv, out, err)


@pytest.mark.parametrize("how", ["frame_lies_big", "frame_no_size", "frame_over_ratio", "two_frames",
                                 "frame_garbage", "frame_truncated"])
def test_zstd_blob_lies(st, how):
    root, a, _ = st
    t = a["z"]
    prefix, data = prefix_of(t), raw_bytes(t)
    c = zstd.ZstdCompressor(level=1, write_content_size=True)
    frame = c.compress(data)
    body = {
        "frame_lies_big": zstd.ZstdCompressor(level=1, write_content_size=True).compress(data + b"\x00"),
        "frame_no_size": zstd.ZstdCompressor(level=1, write_content_size=False).compress(data),
        "frame_over_ratio": zstd.ZstdCompressor(level=19, write_content_size=True).compress(bytes(1 << 22)),
        "two_frames": c.compress(data[:8192]) + c.compress(data[8192:]),
        "frame_garbage": frame[:6] + b"\xff" * (len(frame) - 6),
        "frame_truncated": frame[:-3],
    }[how]
    size = {"frame_over_ratio": 1 << 22}.get(how, len(data))
    pfx = b"float32[1048576]" if how == "frame_over_ratio" else prefix
    replace_blob(root, t, head(ZSTD, 0, pfx, size) + body)
    refused(root, "a")


@pytest.mark.parametrize("how", ["plane_len_huge", "plane_len_sum_wraps", "plane_codec_7", "plane_table_pad",
                                 "plane_frame_lies", "plane_stored_short", "planes_k_wrong", "plane_frame_ratio"])
def test_grouped_blob_lies(st, how):
    root, a, _ = st
    t = a["w"]
    prefix, data = prefix_of(t), raw_bytes(t)
    k = 4
    good = planes_of(data, k)
    table, body = bytearray(good[:16 * k]), good[16 * k:]
    if how == "plane_len_huge":
        table[8:16] = struct.pack("<Q", (1 << 64) - 1)
    elif how == "plane_len_sum_wraps":
        first = struct.unpack("<Q", table[8:16])[0]
        table[8:16] = struct.pack("<Q", first + (1 << 63))
        second = struct.unpack("<Q", table[24:32])[0]
        table[24:32] = struct.pack("<Q", (second + (1 << 63)) % (1 << 64))
    elif how == "plane_codec_7":
        table[0] = 7
    elif how == "plane_table_pad":
        table[3] = 1
    if how == "plane_frame_lies":
        planes = [data[i::k] for i in range(k)]
        frames = [zstd.ZstdCompressor(level=1, write_content_size=True).compress(p) for p in planes]
        frames[0] = zstd.ZstdCompressor(level=1, write_content_size=True).compress(planes[0] + b"\x00" * 7)
        blob_body = b"".join(struct.pack("<B7xQ", 1, len(f)) for f in frames) + b"".join(frames)
    elif how == "plane_stored_short":
        planes = [data[i::k] for i in range(k)]
        planes[0] = planes[0][:-1]
        blob_body = b"".join(struct.pack("<B7xQ", 0, len(p)) for p in planes) + b"".join(planes)
    elif how == "planes_k_wrong":
        blob_body = planes_of(data, 2)
    elif how == "plane_frame_ratio":
        # four stored-size-honest planes except the first, a tiny frame claiming a huge plane
        huge = zstd.ZstdCompressor(level=19, write_content_size=True).compress(bytes(1 << 20))
        blob_body = struct.pack("<B7xQ", 1, len(huge)) + good[16:16 * k] + huge + body
    else:
        blob_body = bytes(table) + body
    replace_blob(root, t, head(GROUPED, 0, prefix, len(data)) + blob_body)
    refused(root, "a")


def test_grouped_plane_claiming_a_terabyte_allocates_nothing(st):
    root, a, _ = st
    prefix = b"float32[274877906944]"  # 1 TiB of float32: only claimed, never built
    frame = zstd.ZstdCompressor(level=1, write_content_size=True).compress(b"\x00" * 4096)
    frame = bytearray(frame)
    table = struct.pack("<B7xQ", 1, len(frame)) * 4
    blob = head(GROUPED, 0, prefix, 1 << 40) + table + bytes(frame) * 4
    replace_blob(root, a["w"], blob)
    tracemalloc.start()
    try:
        for call in (lambda: tc.Store(root).load("a"), lambda: tc.Store(root).verify()):
            errors_are_ours(call)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, peak


# ------------------------------------------------------------------ deltas that lie

def delta_blob(root, b_w, a_w, *, depth=1, base_digest=None, base_prefix=None):
    """b_w stored as a delta on a_w's blob."""
    prefix = prefix_of(b_w)
    x = bytes(p ^ q for p, q in zip(raw_bytes(b_w), raw_bytes(a_w), strict=True))
    base = base_digest or digest_of(base_prefix or prefix_of(a_w), raw_bytes(a_w))
    return head(DELTA, depth, prefix, len(x), base) + planes_of(x, b_w.element_size())


@pytest.mark.parametrize("how", ["base_missing", "depth_2_on_depth_0", "depth_0", "depth_65", "base_self",
                                 "base_other_shape", "base_is_the_record"])
def test_delta_lies(st, how):
    root, a, b = st
    bw, aw = b["w"], a["w"]
    bd = digest_of(prefix_of(bw), raw_bytes(bw))
    if how == "base_missing":
        blob = delta_blob(root, bw, aw, base_digest=b"\x42" * 16)
    elif how == "depth_2_on_depth_0":
        blob = delta_blob(root, bw, aw, depth=2)
    elif how == "depth_0":
        blob = delta_blob(root, bw, aw, depth=0)
    elif how == "depth_65":
        blob = delta_blob(root, bw, aw, depth=65)
    elif how == "base_self":
        blob = delta_blob(root, bw, aw, base_digest=bd)
    elif how == "base_other_shape":
        blob = delta_blob(root, bw, aw, base_digest=digest_of(prefix_of(a["i"]), raw_bytes(a["i"])))
    else:
        blob = delta_blob(root, bw, aw, base_digest=b"../../tags/a.sa"[:16].ljust(16, b"x"))
    blob_path(root, bd).write_bytes(blob)
    refused(root, "b")
    assert torch.equal(tc.Store(root).load("a")["w"], aw)  # the base's own tag is untouched


def test_an_honest_handmade_delta_loads(st):
    """The control for test_delta_lies: the independent encoder writes a delta the store accepts."""
    root, a, b = st
    bw, aw = b["w"], a["w"]
    bd = digest_of(prefix_of(bw), raw_bytes(bw))
    blob_path(root, bd).write_bytes(delta_blob(root, bw, aw))
    assert torch.equal(tc.Store(root).load("b")["w"], bw)
    assert cli.main(["store", "verify", str(root)]) == 0


def test_a_chain_of_64_handmade_deltas_loads_and_65_is_refused(tmp_path):
    """Depth over 64 is refused; 64 links are read (docs: readers accept up to 64)."""
    root = tmp_path / "chain"
    g = torch.Generator().manual_seed(1)
    ws = [torch.randn(256, generator=g)]
    for _ in range(66):
        ws.append(ws[-1] + 1e-6 * torch.randn(256, generator=g))
    tc.Store(root).save("base", {"w": ws[0]})
    prev = ws[0]
    for n in range(1, 66):
        d = digest_of(prefix_of(ws[n]), raw_bytes(ws[n]))
        path = blob_path(root, d)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(delta_blob(root, ws[n], prev, depth=n))
        prev = ws[n]
    # records for the 64th and 65th tensors: save them in a scratch store, copy the records only
    scratch = tmp_path / "scratch"
    for n in (64, 65):
        tc.Store(scratch).save(f"d{n}", {"w": ws[n]})
        (root / "tags" / f"d{n}.safetensors").write_bytes((scratch / "tags" / f"d{n}.safetensors").read_bytes())
    assert torch.equal(tc.Store(root).load("d64")["w"], ws[64])
    errors_are_ours(lambda: tc.Store(root).load("d65"))
    assert cli.main(["store", "verify", str(root), "d65"]) == 1
    errors_are_ours(lambda: tc.Store(root).stats())  # the depth-65 blob is refused there too


# ------------------------------------------------------------------ records

def scratch_record(tmp_path, obj, tag="x"):
    s = tmp_path / f"scratch-{tag}"
    tc.Store(s).save(tag, obj)
    return (s / "tags" / f"{tag}.safetensors").read_bytes()


def test_a_record_naming_blobs_that_do_not_exist(st, tmp_path):
    root, _, _ = st
    (root / "tags" / "ghost.safetensors").write_bytes(scratch_record(tmp_path, {"q": torch.randn(99)}, "ghost"))
    text = errors_are_ours(lambda: tc.Store(root).load("ghost"))
    assert "ghost" in text or "blobs" in text
    refused(root, "ghost")


def test_every_flipped_byte_of_a_record_is_found(st):
    root, _, _ = st
    path = root / "tags" / "b.safetensors"
    good = path.read_bytes()
    for off in range(0, len(good), max(1, len(good) // 61)):
        bad = bytearray(good)
        bad[off] ^= 0x20
        path.write_bytes(bytes(bad))
        for call in (lambda: tc.Store(root).load("b"), lambda: tc.Store(root).verify("b")):
            errors_are_ours(call)
        assert cli.main(["store", "verify", str(root)]) == 1, off
    path.write_bytes(good)
    assert cli.main(["store", "verify", str(root)]) == 0


def test_every_flipped_byte_of_every_blob_is_found(st, capsys):
    root, _, _ = st
    for path in sorted((root / "blobs").rglob("*")):
        if not path.is_file():
            continue
        good = path.read_bytes()
        for off in sorted({*range(0, min(len(good), 96)), *range(96, len(good), max(1, len(good) // 13)),
                           len(good) - 1}):
            bad = bytearray(good)
            bad[off] ^= 0x01
            path.write_bytes(bytes(bad))
            code, out, err = run_cli(capsys, "verify", root)
            assert code == 1, (path.name, off, out, err)
            for tag in ("a", "b"):
                try:
                    tc.Store(root).load(tag)
                except tc.TensorCanonError:
                    pass
                except Exception as e:  # noqa: BLE001
                    pytest.fail(f"{path.name}@{off}: foreign {type(e).__name__}: {e}")
        path.write_bytes(good)
    assert cli.main(["store", "verify", str(root)]) == 0


def hostile_record(tag, header, *, fmt="tensorcanon-store-tag", layout=1, extra=None, name=None):
    obj = {"format": fmt, "header": header, "layout": layout, "tag": name if name is not None else tag}
    if extra:
        obj.update(extra)
    return obj


@pytest.mark.parametrize("how", ["layout_2", "format", "extra_key", "header_trailing", "header_short",
                                 "header_garbage", "header_str", "header_of_pickle", "tag_int",
                                 "not_a_dict", "empty_header", "header_length_huge"])
def test_records_that_lie(st, tmp_path, how):
    root, a, _ = st
    good = tc.load(root / "tags" / "a.safetensors")
    h = good["header"]
    obj = {
        "layout_2": hostile_record("a", h, layout=2),
        "format": hostile_record("a", h, fmt="tensorcanon-store-tag2"),
        "extra_key": hostile_record("a", h, extra={"x": 1}),
        "header_trailing": hostile_record("a", h + b"\x00" * 8),
        "header_short": hostile_record("a", h[:-1]),
        "header_garbage": hostile_record("a", b"\x10\x00\x00\x00\x00\x00\x00\x00" + b"\xff" * 16),
        "header_str": hostile_record("a", h.decode("latin-1")),
        "header_of_pickle": hostile_record("a", b"\x80\x04\x95" + b"\x00" * 30),
        "tag_int": hostile_record("a", h, name=1),
        "not_a_dict": [h],
        "empty_header": hostile_record("a", b""),
        "header_length_huge": hostile_record("a", struct.pack("<Q", 1 << 62) + h[8:]),
    }[how]
    tc.save(obj, root / "tags" / "a.safetensors")
    refused(root, "a")
    assert torch.equal(tc.Store(root).load("b")["z"], a["z"])


def test_a_duplicated_record_under_two_names_refuses_the_copy(st):
    root, _, _ = st
    (root / "tags" / "copy.safetensors").write_bytes((root / "tags" / "a.safetensors").read_bytes())
    errors_are_ours(lambda: tc.Store(root).load("copy"), match="copy")
    assert cli.main(["store", "verify", str(root)]) == 1


def test_a_record_claiming_a_digest_with_control_characters(st, tmp_path, capsys):
    """The inner header's metadata carries a digest string with terminal escapes; ls must not print it raw."""
    root, _, _ = st
    h = tc.load(root / "tags" / "a.safetensors")["header"]
    n = struct.unpack("<Q", h[:8])[0]
    text = h[8:8 + n].decode()
    start = text.index("xxh3-128:") + len("xxh3-128:")
    evil = (text[:start] + "\\u001b]0;x\\u0007" + text[start + 19:]).ljust(n)  # JSON escapes of ESC, BEL
    hdr = struct.pack("<Q", len(evil.encode())) + evil.encode()
    tc.save(hostile_record("a", hdr), root / "tags" / "a.safetensors")
    for argv in (("ls", root), ("ls", "--json", root), ("verify", root), ("stats", root)):
        code, out, err = run_cli(capsys, *argv)
        assert code != 0 or argv[0] == "stats", (argv, code, out, err)
        assert "\x1b" not in out + err and "\x07" not in out + err, (argv, out, err)


# ------------------------------------------------------------------ names and paths

@pytest.mark.parametrize("tag", ["", ".", "..", "../x", "a/b", "a\\b", "/abs", ".hidden", "a\x00b", "a\nb",
                                 "\x1b[31m", "ä", "a" * 201, "a b", "a:b", "C:x"])
def test_hostile_tag_names_are_usage_errors(tmp_path, tag):
    root = tmp_path / "s"
    s = tc.Store(root)
    s.save("ok", {"w": torch.ones(3)})
    for call in (lambda: s.save(tag, {"w": torch.ones(3)}), lambda: s.load(tag), lambda: s.verify(tag),
                 lambda: s.delete(tag), lambda: s.export(tag, tmp_path / "o.st")):
        with pytest.raises(tc.UsageError):
            call()
    assert s.tags() == ["ok"]
    assert sorted(os.listdir(tmp_path)) == ["s"]


@pytest.mark.parametrize("tag", [None, 3, b"ok", ["ok"]])
def test_tags_that_are_not_strings_are_usage_errors(tmp_path, tag):
    s = tc.Store(tmp_path / "s")
    s.save("ok", {"w": torch.ones(3)})
    calls = [lambda: s.save(tag, {"w": torch.ones(3)}), lambda: s.load(tag), lambda: s.delete(tag)]
    if tag is not None:  # verify(None) is documented: the whole store
        calls.append(lambda: s.verify(tag))
    for call in calls:
        with pytest.raises(tc.UsageError):
            call()


def test_hostile_names_under_tags_are_ignored(st, capsys):
    root, _, _ = st
    rec = (root / "tags" / "a.safetensors").read_bytes()
    for name in (".a.safetensors", "..safetensors", "\x1b[2Jx.safetensors", "a b.safetensors", "x.safetensors.tmp",
                 "A" * 201 + ".safetensors", "é.safetensors", "y.SAFETENSORS"):
        (root / "tags" / name).write_bytes(rec)
    (root / "tags" / "dir.safetensors").mkdir()
    assert tc.Store(root).tags() in (["a", "b"], ["a", "b", "dir"])
    code, out, err = run_cli(capsys, "ls", root)
    assert "\x1b" not in out + err
    code, out, err = run_cli(capsys, "verify", root)
    assert "\x1b" not in out + err


def test_a_tag_that_is_a_directory(st, capsys):
    root, _, _ = st
    (root / "tags" / "dir.safetensors").mkdir()
    errors_are_ours(lambda: tc.Store(root).load("dir"))
    for call in (lambda: tc.Store(root).stats(), tc.Store(root).tags):
        try:
            call()
        except tc.TensorCanonError:
            pass
    code, out, err = run_cli(capsys, "ls", root)
    assert code in (0, 1, 2) and "Traceback" not in err


def test_a_blob_that_is_a_directory(st, capsys):
    root, a, _ = st
    t = a["i"]
    path = blob_path(root, digest_of(prefix_of(t), raw_bytes(t)))
    path.unlink()
    path.mkdir()
    errors_are_ours(lambda: tc.Store(root).load("a"))
    code, out, err = run_cli(capsys, "verify", root)
    assert code == 1, (out, err)
    for act in ("stats", "ls"):
        code, out, err = run_cli(capsys, act, root)
        assert code in (0, 1, 2) and "Traceback" not in err


def test_a_symlinked_record_is_not_followed(st, tmp_path):
    root, a, _ = st
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "r.safetensors").write_bytes((root / "tags" / "a.safetensors").read_bytes())
    (root / "tags" / "a.safetensors").unlink()
    os.symlink(outside / "r.safetensors", root / "tags" / "a.safetensors")
    errors_are_ours(lambda: tc.Store(root).load("a"))
    errors_are_ours(lambda: tc.Store(root).verify("a"))


def test_a_symlinked_blob_fanout_folder_is_not_followed(st, tmp_path):
    root, a, b = st
    t = a["z"]  # used by both tags
    path = blob_path(root, digest_of(prefix_of(t), raw_bytes(t)))
    moved = tmp_path / "fan"
    os.rename(path.parent, moved)
    os.symlink(moved, path.parent)
    errors_are_ours(lambda: tc.Store(root).load("b"), match="symbolic link")
    assert cli.main(["store", "verify", str(root)]) in (1, 2)  # (a link is an access error, as for a linked blob)


@pytest.mark.parametrize("folder", ["tags", "blobs"])
def test_a_symlinked_top_folder_is_not_followed(st, tmp_path, folder):
    root, _, _ = st
    os.rename(root / folder, tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", root / folder)
    for call in (lambda: tc.Store(root).load("a"), lambda: tc.Store(root).verify("a")):
        errors_are_ours(call)
    got = None
    try:
        got = tc.Store(root).tags()
    except tc.TensorCanonError:
        pass
    assert not got or folder == "blobs"
    assert cli.main(["store", "verify", str(root)]) in (1, 2)


@pytest.mark.parametrize("folder", ["tmp", "blobs", "pending", "tags", "packs"])
def test_gc_never_deletes_through_a_symlinked_folder(st, tmp_path, folder):
    """A store's folder replaced by a link to someone else's folder: gc must not delete what is there."""
    root, _, _ = st
    victim = tmp_path / "victim"
    victim.mkdir()
    sub = victim / "xxh3-128" / "ab"
    sub.mkdir(parents=True)
    from tensorcanon.store.backend import host

    dead = f"{host()}.{2 ** 22 + 12345}.0123456789abcdef"  # a marker name of this host, no such pid
    precious = [victim / "file", victim / ("cd" * 16), sub / ("ab" * 16), victim / dead, victim / "x.safetensors"]
    for p in precious:
        p.write_bytes(b"precious")
    import shutil

    shutil.rmtree(root / folder, ignore_errors=True)
    os.symlink(victim, root / folder)
    try:
        tc.Store(root).gc()
    except tc.TensorCanonError:
        pass
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"foreign {type(e).__name__}: {e}")
    assert [p for p in precious if not p.exists()] == []
    assert sorted(os.listdir(victim)) == sorted(["file", "cd" * 16, "xxh3-128", dead, "x.safetensors"])


# ------------------------------------------------------------------ marker, lock and epoch files

@pytest.mark.parametrize("content", [b"", b"tensorcanon-store layout 3\n", b"tensorcanon-store layout 1\n\n",
                                     b"tensorcanon-store layout 1", b"\x00" * 27, b"dir", b"huge"])
def test_garbage_store_marker(st, content, capsys):
    root, _, _ = st
    m = root / "tensorcanon-store"
    m.unlink()
    if content == b"dir":
        m.mkdir()
    elif content == b"huge":
        with open(m, "wb") as f:
            f.truncate(8 << 30)  # sparse: reading it whole would be 8 GiB
    else:
        m.write_bytes(content)
    tracemalloc.start()
    try:
        for call in (lambda: tc.Store(root).load("a"), lambda: tc.Store(root).tags(),
                     lambda: tc.Store(root).save("c", {"w": torch.ones(2)}), lambda: tc.Store(root).gc(),
                     lambda: tc.Store(root).stats()):
            errors_are_ours(call)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20
    for act in ("ls", "verify", "gc", "stats"):
        code, out, err = run_cli(capsys, act, root)
        assert code == 2, (act, code, out, err)
    assert len(list((root / "blobs").rglob("*"))) > 4  # gc deleted nothing


def test_gc_on_a_folder_that_is_not_a_store_deletes_nothing(tmp_path, capsys):
    root = tmp_path / "notastore"
    (root / "blobs" / "xxh3-128" / "00").mkdir(parents=True)
    (root / "blobs" / "xxh3-128" / "00" / ("00" * 16)).write_bytes(b"precious")
    (root / "tmp").mkdir()
    (root / "tmp" / "precious").write_bytes(b"precious")
    errors_are_ours(lambda: tc.Store(root).gc())
    code, out, err = run_cli(capsys, "gc", root)
    assert code == 2
    assert (root / "tmp" / "precious").exists() and (root / "blobs" / "xxh3-128" / "00" / ("00" * 16)).exists()
    assert not (root / "tensorcanon-store").exists()


@pytest.mark.parametrize("where", ["nonexistent", "file"])
def test_roots_that_are_not_stores_exit_2(tmp_path, capsys, where):
    root = tmp_path / "r"
    if where == "file":
        root.write_bytes(b"x")
    for act in (("ls", root), ("verify", root), ("stats", root), ("gc", root), ("export", root, "a", tmp_path / "o")):
        code, out, err = run_cli(capsys, *act)
        assert code == 2, (act, code, err)
    errors_are_ours(lambda: tc.Store(root).load("a"))
    if where == "file":
        errors_are_ours(lambda: tc.Store(root).save("a", {"w": torch.ones(2)}))


def test_a_huge_gc_epoch_is_refused_unread(st):
    root, a, b = st
    (root / "gc-epoch").unlink(missing_ok=True)
    with open(root / "gc-epoch", "wb") as f:
        f.truncate(4 << 30)  # sparse 4 GiB
    tracemalloc.start()
    try:
        try:
            tc.Store(root).save("c", {"w": torch.ones(5)})
        except tc.TensorCanonError as e:
            assert "gc-epoch" in str(e)
        assert torch.equal(tc.Store(root).load("a")["w"], a["w"])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20


def test_garbage_markers_are_ignored(st, capsys):
    root, a, b = st
    (root / "pending").mkdir(exist_ok=True)
    (root / "gc").mkdir(exist_ok=True)
    for name in ("garbage", "host.notapid.zz", "h.-1.0000000000000000", "h.99999999999999999999999.0123456789abcdef",
                 "\x1b[2J.1.0123456789abcdef"):
        (root / "pending" / name).write_bytes(b"\xff" * 100)
        (root / "gc" / name).write_bytes(b"\xff" * 100)
    (root / "pending" / "adir").mkdir()
    (root / "gc" / "adir").mkdir()
    s = tc.Store(root)
    s.save("c", {"w": torch.ones(5)})
    assert torch.equal(s.load("a")["w"], a["w"])
    s.gc()
    code, out, err = run_cli(capsys, "verify", root)
    assert code == 0, (out, err)
    assert "\x1b" not in out + err


def test_garbage_in_tmp_is_removed_by_gc_without_following_links(st, tmp_path):
    root, _, _ = st
    outside = tmp_path / "victim"
    outside.mkdir()
    (outside / "keep").write_bytes(b"keep")
    (root / "tmp").mkdir(exist_ok=True)
    os.symlink(outside, root / "tmp" / "link")
    (root / "tmp" / "sub").mkdir()
    (root / "tmp" / "sub" / "f").write_bytes(b"x")
    tc.Store(root).gc()
    assert (outside / "keep").exists()
    assert cli.main(["store", "verify", str(root)]) == 0


# ------------------------------------------------------------------ gc on a damaged store

def test_gc_does_not_delete_the_blobs_of_a_damaged_record(st):
    """A record gc cannot read may still name blobs; deleting them would destroy what a repair needs."""
    root, a, b = st
    path = root / "tags" / "a.safetensors"
    good = path.read_bytes()
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0x01
    path.write_bytes(bytes(bad))
    blobs_before = sorted(p.name for p in (root / "blobs").rglob("*") if p.is_file())
    try:
        tc.Store(root).gc()
    except tc.TensorCanonError:
        pass
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"foreign {type(e).__name__}: {e}")
    path.write_bytes(good)
    assert sorted(p.name for p in (root / "blobs").rglob("*") if p.is_file()) == blobs_before
    assert torch.equal(tc.Store(root).load("a")["i"], a["i"])


def test_gc_does_not_delete_the_base_of_a_damaged_delta(st):
    root, a, b = st
    bw = b["w"]
    path = blob_path(root, digest_of(prefix_of(bw), raw_bytes(bw)))
    good = path.read_bytes()
    assert good[8] in (DELTA, DELTA_SUB), "the fixture's drifted floats are a delta"
    tc.Store(root).delete("a")
    bad = bytearray(good)
    bad[12] ^= 0x01  # the decoded size: the header no longer parses
    path.write_bytes(bytes(bad))
    try:
        tc.Store(root).gc()
    except tc.TensorCanonError:
        pass
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"foreign {type(e).__name__}: {e}")
    path.write_bytes(good)
    assert torch.equal(tc.Store(root).load("b")["w"], bw)


def test_gc_stats_ls_on_hostile_blobs_raise_only_ours(st, capsys):
    root, a, _ = st
    t = a["i"]
    replace_blob(root, t, b"tcstore\x01\xff\xff\xff\xff" + b"\xff" * 8)
    (root / "blobs" / "xxh3-128" / "zz").mkdir()
    (root / "blobs" / "xxh3-128" / "zz" / "notahexname").write_bytes(b"junk")
    (root / "blobs" / "xxh3-128" / "00" ).mkdir(exist_ok=True)
    misplaced = root / "blobs" / "xxh3-128" / "00" / ("ab" * 16)
    misplaced.write_bytes(b"junk")
    for call in (lambda: tc.Store(root).stats(), lambda: tc.Store(root).verify(), lambda: tc.Store(root).tags()):
        try:
            call()
        except tc.TensorCanonError:
            pass
        except Exception as e:  # noqa: BLE001
            pytest.fail(f"foreign {type(e).__name__}: {e}")
    for act in ("stats", "ls", "verify", "gc"):
        code, out, err = run_cli(capsys, act, root)
        assert "Traceback" not in err and code in (0, 1, 2), (act, code, err)
    code, _, _ = run_cli(capsys, "verify", root)
    assert code == 1


# ------------------------------------------------------------------ export and CLI exit codes

def test_export_of_a_damaged_tag_leaves_no_file_and_exits_1_or_2(st, capsys):
    root, a, _ = st
    t = a["z"]
    path, _ = replace_blob(root, t, b"")
    out_file = root.parent / "o.safetensors"
    code, out, err = run_cli(capsys, "export", root, "a", out_file)
    assert code in (1, 2) and not out_file.exists(), (code, err)
    code, out, err = run_cli(capsys, "export", root, "nope", out_file)
    assert code == 2 and not out_file.exists()
    code, out, err = run_cli(capsys, "export", root, "../a", out_file)
    assert code == 2 and not out_file.exists()


def test_cli_exit_codes_and_json_on_a_healthy_store(st, capsys):
    root, _, _ = st
    import json

    for act in ("ls", "verify", "stats"):
        code, out, err = run_cli(capsys, act, "--json", root)
        assert code == 0, (act, err)
        json.loads(out)
    code, out, err = run_cli(capsys, "verify", root, "nope")
    assert code == 2, (out, err)


# ------------------------------------------------------------------ memory:// roots

def test_memory_store_hostile_objects(tmp_path):
    import fsspec

    url = "memory://redstore-hostile"
    s = tc.Store(url)
    g = torch.Generator().manual_seed(3)
    w = torch.randn(300, generator=g)
    s.save("a", {"w": w})
    fs = fsspec.filesystem("memory")
    blobs = [p for p in fs.find("/redstore-hostile/blobs")]
    assert blobs
    good = fs.cat_file(blobs[0])
    for bad in (b"", good[:-1], good + b"\x00", good[:12] + struct.pack("<Q", 1 << 62) + good[20:]):
        fs.pipe_file(blobs[0], bad)
        for call in (lambda: tc.Store(url).load("a"), lambda: tc.Store(url).verify()):
            errors_are_ours(call)
        assert cli.main(["store", "verify", url]) == 1
    fs.pipe_file(blobs[0], good)
    fs.pipe_file("/redstore-hostile/tags/../evil.safetensors", good)
    fs.pipe_file("/redstore-hostile/tags/x\x1b.safetensors", good)
    assert tc.Store(url).tags() == ["a"]
    fs.pipe_file("/redstore-hostile/tensorcanon-store", b"junk")
    errors_are_ours(lambda: tc.Store(url).load("a"))
    assert cli.main(["store", "ls", url]) == 2
    fs.rm("/redstore-hostile", recursive=True)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_fifos_in_place_of_a_record_or_a_blob_never_block(st, capsys):
    """A FIFO opened for reading blocks until a writer comes; a store must refuse it unopened."""
    root, a, _ = st
    t = a["i"]
    path = blob_path(root, digest_of(prefix_of(t), raw_bytes(t)))
    path.unlink()
    os.mkfifo(path)
    errors_are_ours(lambda: tc.Store(root).load("a"), match="regular file")
    code, out, err = run_cli(capsys, "verify", root)
    assert code == 1, (out, err)
    rec = root / "tags" / "b.safetensors"
    rec.unlink()
    os.mkfifo(rec)
    errors_are_ours(lambda: tc.Store(root).load("b"))
    code, out, err = run_cli(capsys, "verify", root)
    assert code in (1, 2) and "Traceback" not in err, (out, err)


def test_gc_refuses_rather_than_drop_the_blobs_of_a_renamed_record(st):
    root, a, _ = st
    (root / "tags" / "a.safetensors").replace(root / "tags" / "c.safetensors")
    before = sorted(p.name for p in (root / "blobs").rglob("*") if p.is_file())
    errors_are_ours(lambda: tc.Store(root).gc(), match="'c'")
    assert sorted(p.name for p in (root / "blobs").rglob("*") if p.is_file()) == before


def test_a_store_object_outlived_by_anothers_gc_still_writes_what_it_needs(st):
    """STORE.md: after a collection, a Store object forgets which blobs it believed present."""
    root, a, b = st
    s1 = tc.Store(root)
    x = torch.randn(333, generator=torch.Generator().manual_seed(11))
    s1.save("x1", {"x": x})
    s2 = tc.Store(root)
    s2.delete("x1")
    s2.gc()  # x's blob is gone
    s1.save("x2", {"x": x})  # s1 saw x's blob at its last save
    assert torch.equal(tc.Store(root).load("x2")["x"], x)
    assert cli.main(["store", "verify", str(root)]) == 0
