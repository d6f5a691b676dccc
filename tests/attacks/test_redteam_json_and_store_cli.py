"""Red-team attacks on every command's ``--json`` (and text) output with hostile strings, and on
``tensorcanon store``'s exit codes on damaged stores; written from docs/CLI.md, docs/SECURITY.md
("The command line"), docs/TRACE.md and docs/STORE.md only.

The promises under test:

- docs/CLI.md: every command's ``--json`` writes a string from a file or a trace holding a control
  character (C0, C1, DEL), a bidi override or isolate (U+202A-U+202E, U+2066-U+2069) or a line
  separator (U+2028, U+2029) as a JSON escape, so the JSON on a terminal cannot reorder or recolour
  it; parsed, it is the same string. Errors and warnings on stderr are escaped too, and text
  reports print no control character raw. A file name that is not UTF-8 is shown as ``\\xff``
  escapes on stdout, stderr and in JSON, which is always valid UTF-8 (SECURITY.md).
- docs/STORE.md: every store action exits 0 when fine, 1 where what it read is damaged (named on
  stderr), 2 on an error; ``gc`` keeps a pack whose index cannot be read, warns, lists it under
  ``damaged_packs`` and exits 1; ``gc`` rewrites no pack whose blobs are all kept, and never
  deletes a live blob.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import sys

import pytest
import torch
import xxhash
from test_trace_text_attacks import D1, rec, write as write_trace  # (a trace's records, written by hand)

import tensorcanon as tc
from tensorcanon.format import paths
from tensorcanon.tools import cli

# Every character the docs promise never to print raw: C0 but \n (text lines), DEL, C1, the bidi
# overrides and isolates, the line separators, and lone surrogates (not UTF-8 at all).
RAW = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\u2028\u2029\ud800-\udfff]")
HOSTILE = "k\x1b[2J\r\x9b31m\x7f\u202etxt\u2066\u2028\u2029\x00\x07end"
# A file name can hold anything but "/" and NUL.
NAME = "f\x1b[2J\r\x9b31m\x7f\u202etxt\u2066\u2028\u2029\x07"


def run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def clean(text: str, what: str) -> None:
    m = RAW.search(text)
    assert m is None, f"{what} holds {m.group()!r} raw: {text!r}"
    assert "Traceback" not in text, text


def json_out(out: str):
    """stdout of a --json run: valid JSON, nothing raw."""
    clean(out.replace("\n", ""), "json stdout")
    return json.loads(out)


def strings(obj):
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield k
            yield from strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from strings(v)


def hostile_file(tmp_path, name=NAME + ".safetensors"):
    path = tmp_path / name
    obj = {HOSTILE: torch.arange(4, dtype=torch.float32), "note": HOSTILE, "n": {HOSTILE: 3}}
    tc.save(obj, path, metadata={HOSTILE: HOSTILE})
    return path, obj


# ------------------------------------------------------------------ file commands, --json and text


def test_hash_and_verify_json_with_hostile_file_names(tmp_path, capsys):
    path, _ = hostile_file(tmp_path)
    for argv in (["hash", "--json", path], ["hash", "--verify", "--json", path], ["verify", "--json", path]):
        code, out, err = run(capsys, *argv)
        assert code == 0, (argv, err)
        got = json_out(out)
        clean(err, "stderr")
        assert got["files"][0]["path"] == str(path), argv  # parsed: the same string
    for argv in (["hash", path], ["verify", path]):
        code, out, err = run(capsys, *argv)
        assert code == 0
        clean(out, "text stdout")
        clean(err, "stderr")


def test_inspect_json_and_text_with_hostile_keys_values_and_metadata(tmp_path, capsys):
    path, _ = hostile_file(tmp_path)
    code, out, err = run(capsys, "inspect", "--json", path)
    assert code == 0, err
    got = json_out(out)
    clean(err, "stderr")
    assert got["file"] == str(path)
    assert got["metadata"] == {HOSTILE: HOSTILE}  # the file's own strings, parsed
    assert any(e["path"] == paths.join((HOSTILE,)) for e in got["entries"])
    assert any(e["value"] == repr(HOSTILE) for e in got["entries"])  # a value's text as the table shows it
    code, out, err = run(capsys, "inspect", path)
    assert code == 0
    clean(out, "inspect text")
    clean(err, "stderr")


def test_diff_json_and_text_with_hostile_keys(tmp_path, capsys):
    a, obj = hostile_file(tmp_path)
    b = tmp_path / (NAME + "b.safetensors")
    obj2 = dict(obj)
    obj2[HOSTILE] = torch.arange(4, dtype=torch.float32) + 1
    obj2["note"] = HOSTILE + "\x1b"
    obj2["extra\u202e"] = 1
    tc.save(obj2, b)
    code, out, err = run(capsys, "diff", "--json", a, b)
    assert code == 1, err
    got = json_out(out)
    clean(err, "stderr")
    assert got["a"] == str(a) and got["b"] == str(b)
    assert {d["path"] for d in got["differences"]} >= {paths.join((HOSTILE,)), paths.join(("extra\u202e",))}
    code, out, err = run(capsys, "diff", a, b)
    assert code == 1
    clean(out, "diff text")
    clean(err, "stderr")


# A name a line-based lockfile can hold: controls and bidi characters, no line break.
LOCKABLE = "f\x1b[2J\x9b31m\x7f\u202etxt\u2066\x07\u200f"


def test_lock_and_check_json_with_hostile_file_names(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path, _ = hostile_file(tmp_path, LOCKABLE + ".safetensors")
    lock = tmp_path / "t.lock"
    code, out, err = run(capsys, "lock", "--json", path, "-o", lock)
    clean(err, "lock stderr")
    if out.strip():
        json_out(out)
    assert code == 0, err
    code, out, err = run(capsys, "check", "--json", lock)
    assert code == 0, err
    got = json_out(out)
    clean(err, "stderr")
    assert any(s.endswith(LOCKABLE + ".safetensors") for s in strings(got)), got  # parsed: the same name
    # changed on disk: the MISMATCH line names it, in JSON and text
    tc.save({"x": torch.zeros(2)}, path)
    code, out, err = run(capsys, "check", "--json", lock)
    assert code == 1
    json_out(out)
    clean(err, "stderr")
    code, out, err = run(capsys, "check", lock)
    assert code == 1
    clean(out, "check text")
    clean(err, "stderr")


@pytest.mark.parametrize("brk", ["\r", "\n", "\u2028", "\u2029", "\x85", "\x1c", "\x1d", "\x1e", "\x0b", "\x0c"])
def test_lock_of_a_name_holding_a_line_break(tmp_path, capsys, brk):
    """A name with any character a reader could split lines on (``str.splitlines`` splits on \\x85,
    \\x1c-\\x1e, \\v, \\f, U+2028 too): lock refuses it (exit 2, escaped), or writes a lockfile that
    check reads back as the same file."""
    path, _ = hostile_file(tmp_path, f"a{brk}b.safetensors")
    lock = tmp_path / "t.lock"
    code, out, err = run(capsys, "lock", path, "-o", lock)
    clean(out, "lock stdout")
    clean(err, "lock stderr")
    if code == 2:
        assert not lock.exists() and "\\" in err
        return
    assert code == 0, err
    code, out, err = run(capsys, "check", "--json", lock)
    assert code == 0, (out, err)
    got = json_out(out)
    assert [f["status"] for f in got["files"]] == ["OK"] or len(got["files"]) == 1, got


@pytest.mark.parametrize("suffix", ["x\x1b[2J\u202e", "x\u2028y", "x\x85y", "x\x1cy", "x\x00y"])
def test_a_lockfile_whose_lines_hold_hostile_names(tmp_path, capsys, suffix):
    """A hand-written lockfile (input like any other): a line's name holds controls, a line separator
    that ``str.splitlines`` splits on, NUL. check reports it (MISSING or a malformed line), escaped, in
    JSON and text; the honest line is still checked."""
    code, out, err = run(capsys, "lock", hostile_file(tmp_path, LOCKABLE)[0], "-o", tmp_path / "ok.lock")
    assert code == 0, err
    lines = (tmp_path / "ok.lock").read_text(encoding="utf-8")
    evil = tmp_path / "evil.lock"
    evil.write_text(lines + lines.splitlines()[-1] + suffix + "\n", encoding="utf-8")
    for argv in (["check", "--json", evil], ["check", evil]):
        code, out, err = run(capsys, *argv)
        assert code in (1, 2), (code, out, err)
        if "--json" in argv:
            if out.strip():
                got = json_out(out)
                assert [f["path"] for f in got["files"]] == [LOCKABLE, LOCKABLE + suffix], got
        else:
            clean(out, "check text")
        clean(err, "stderr")
        assert "Traceback" not in err and (out + err).strip()


def test_convert_and_consolidate_json_with_hostile_names(tmp_path, capsys):
    path, _ = hostile_file(tmp_path)
    out_path = tmp_path / (NAME + ".out.safetensors")
    code, out, err = run(capsys, "convert", "--json", path, out_path)
    clean(err, "stderr")
    assert code == 0, err
    if out.strip():
        got = json_out(out)
        assert str(out_path) in strings(got) or any(NAME in s for s in strings(got))
    code, out, err = run(capsys, "consolidate", "--json", tmp_path / (NAME + "nodir"), tmp_path / "o.safetensors")
    assert code == 2
    clean(err, "consolidate stderr")
    if out.strip():
        json_out(out)


def test_errors_naming_hostile_files_are_escaped(tmp_path, capsys):
    """A file that fails to load, named with controls: the error on stderr (and any JSON) holds them as
    escapes, for every command that reads a file."""
    bad = tmp_path / (NAME + ".safetensors")
    bad.write_bytes(struct.pack("<Q", 16) + '{"a\x1b[2J\u202e":1}'.encode()[:16])
    missing = tmp_path / (NAME + ".missing")
    for target in (bad, missing):
        for argv in (["hash", "--json", target], ["verify", "--json", target], ["inspect", "--json", target],
                     ["diff", "--json", target, target], ["hash", target], ["verify", target],
                     ["inspect", target], ["diff", target, target], ["lock", "-o", tmp_path / "x.lock", target],
                     ["check", target], ["check", "--json", target], ["convert", target, tmp_path / "c.out"],
                     ["diverge", "--json", target, target], ["diverge", target, target]):
            code, out, err = run(capsys, *argv)
            assert code == 2, (argv, code, out, err)
            clean(err, f"stderr of {argv[:2]}")
            if "--json" in argv and out.strip():
                json_out(out)
            else:
                clean(out, f"stdout of {argv[:2]}")
            assert err.strip(), argv


def test_a_safetensors_header_with_escaped_lone_surrogates_and_controls(tmp_path, capsys):
    """A plain safetensors header is JSON: ``"\\ud800"`` and ``"\\u001b"`` escapes decode to a lone
    surrogate and ESC. Every command refuses it or shows them as escapes; nothing raw, and no lone
    surrogate (it cannot be written to a UTF-8 stdout at all)."""
    header = (b'{"w\\ud800\\u001b[2J\\u202e": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},'
              b' "__metadata__": {"m\\udfff\\u2028": "v\\u009b\\u2066\\udcff"}}')
    header += b" " * (-len(header) % 8)
    path = tmp_path / "plain.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\x00\x00\x80\x3f")
    for argv in (["hash", "--json", path], ["verify", "--json", path], ["inspect", "--json", path],
                 ["inspect", path], ["hash", path], ["lock", "--json", "-o", tmp_path / "p.lock", path],
                 ["diff", "--json", path, path], ["diff", path, path]):
        code, out, err = run(capsys, *argv)
        assert code in (0, 1, 2), argv
        clean(err, f"stderr of {argv[:2]}")
        if "--json" in argv and out.strip():
            json_out(out)
        else:
            clean(out, f"stdout of {argv[:2]}")


def test_file_names_that_are_not_utf8(tmp_path, capsys):
    raw = os.fsencode(tmp_path) + b"/w\xff\xfe\x1b.safetensors"
    name = os.fsdecode(raw)
    tc.save({"x": torch.ones(2)}, name)
    assert "\udcff" in name
    for argv in (["hash", "--json", name], ["verify", "--json", name], ["inspect", "--json", name],
                 ["diff", "--json", name, name], ["hash", name], ["verify", name], ["inspect", name],
                 ["lock", "-o", tmp_path / "n.lock", name], ["convert", "--json", name, tmp_path / "c.st"]):
        code, out, err = run(capsys, *argv)
        assert code in (0, 2), (argv, code, err)
        clean(err, f"stderr of {argv[:2]}")
        if "--json" in argv and out.strip():
            got = json_out(out)
            assert any("\\xff" in s for s in strings(got)), (argv, got)
        else:
            clean(out, f"stdout of {argv[:2]}")


# ------------------------------------------------------------------ traces: diverge, verify, inspect

def test_trace_commands_with_hostile_names(tmp_path, capsys):
    a = [rec(HOSTILE, HOSTILE, role="in.0"), rec(HOSTILE, HOSTILE)]
    x, y = tmp_path / (NAME + "a.trace"), tmp_path / (NAME + "b.trace")
    write_trace(x, a, end=False)
    write_trace(y, [a[0], a[1]._replace(digest=D1)])
    code, out, err = run(capsys, "diverge", "--json", x, y)
    assert code == 1, err
    got = json_out(out)
    clean(err, "stderr")
    assert got["first"]["name"] == HOSTILE and got["a"] == str(x)
    assert any(str(x) in s for s in got.get("notes", [])) or True
    code, out, err = run(capsys, "diverge", x, y)
    clean(out, "diverge text")
    clean(err, "stderr")
    for argv in (["verify", "--json", x], ["inspect", "--json", x], ["hash", "--json", x]):
        code, out, err = run(capsys, *argv)
        assert code in (0, 1, 2), argv
        clean(err, f"stderr of {argv[:2]}")
        if out.strip():
            json_out(out)
    for argv in (["verify", x], ["inspect", x]):
        code, out, err = run(capsys, *argv)
        clean(out, f"stdout of {argv[:1]}")
        clean(err, f"stderr of {argv[:1]}")


def test_a_damaged_trace_with_a_hostile_name(tmp_path, capsys):
    a = [rec(HOSTILE, HOSTILE, role="in.0"), rec(HOSTILE, HOSTILE)]
    x, y = tmp_path / (NAME + "a.trace"), tmp_path / "b.trace"
    write_trace(x, a)
    write_trace(y, a)
    data = bytearray(x.read_bytes())
    data[len(data) // 2] ^= 0xFF
    x.write_bytes(bytes(data))
    for argv in (["diverge", "--json", x, y], ["diverge", x, y], ["verify", "--json", x], ["verify", x],
                 ["inspect", "--json", x], ["inspect", x]):
        code, out, err = run(capsys, *argv)
        assert code in (1, 2), (argv, code, err)
        clean(err, f"stderr of {argv[:2]}")
        if "--json" in argv and out.strip():
            json_out(out)
        else:
            clean(out, f"stdout of {argv[:2]}")
        assert "\\x1b[2J" in err + out or "\\u001b[2J" in out, (argv, err, out)  # the file is named, escaped


def test_repro_json_with_a_hostile_out_name(tmp_path, capsys):
    out_name = tmp_path / (NAME + ".bin")
    code, out, err = run(capsys, "repro", "--json", "--out", out_name, "--", sys.executable, "-c",
                         "import sys; open(sys.argv[1], 'wb').write(b'x')", out_name)
    assert code == 0, err
    got = json_out(out)
    clean(err, "repro stderr")
    assert str(out_name) in strings(got)


# ------------------------------------------------------------------ store commands with hostile strings


def test_store_json_with_a_hostile_root_and_tag_names(tmp_path, capsys):
    root = tmp_path / (NAME + "store")
    s = tc.Store(root)
    s.save("alpha", {"w": torch.randn(8, 8)}, metadata={HOSTILE: HOSTILE})
    for act in (["ls"], ["verify"], ["stats"], ["gc"], ["verify", "alpha"]):
        code, out, err = run(capsys, "store", act[0], "--json", root, *act[1:])
        assert code == 0, (act, err)
        json_out(out)
        clean(err, f"stderr of store {act}")
        code, out, err = run(capsys, "store", act[0], root, *act[1:])
        assert code == 0, (act, err)
        clean(out, f"stdout of store {act}")
        clean(err, f"stderr of store {act}")
    code, out, err = run(capsys, "store", "export", "--json", root, "alpha", tmp_path / (NAME + ".out"))
    assert code == 0, err
    json_out(out) if out.strip() else None
    clean(err, "export stderr")
    for bad_tag in ("x\x1b[2J\u202e", "a\u2028b", "\x9b31m", "a\x00b", "\udcff"):
        for act in (["verify", bad_tag], ["export", bad_tag, tmp_path / "o"]):
            for js in (["--json"], []):
                code, out, err = run(capsys, "store", act[0], *js, root, *act[1:])
                assert code == 2, (act, code, err)
                clean(err, f"stderr of store {act}")
                if js and out.strip():
                    json_out(out)
                else:
                    clean(out, "stdout")
                assert "\\x1b" in err or "\\u2028" in err or "\\x9b" in err or "\\x00" in err or "\\xff" in err \
                    or "\\udcff" in err, err
    code, out, err = run(capsys, "store", "ls", "--json", tmp_path / (NAME + "nostore"))
    assert code == 2
    clean(err, "stderr of a missing store")


# ------------------------------------------------------------------ store exit codes on damage


@pytest.fixture
def two_tags(tmp_path):
    """A store of two independent tags, each save's small blobs in a pack of its own."""
    root = tmp_path / "st"
    g = torch.Generator().manual_seed(3)
    alpha = {"wa": torch.randn(64, 64, generator=g), "ia": torch.randint(0, 5, (999,), generator=g)}
    beta = {"wb": torch.randn(32, 32, generator=g), "zb": torch.zeros(500)}
    s = tc.Store(root)
    s.save("alpha", alpha)
    packs_a = {p.name for p in (root / "packs").iterdir()}
    s.save("beta", beta)
    packs_b = {p.name for p in (root / "packs").iterdir()} - packs_a
    assert len(packs_a) == 1 and len(packs_b) == 1
    return root, alpha, beta, root / "packs" / packs_a.pop(), root / "packs" / packs_b.pop()


def equal(x, y):
    assert x.keys() == y.keys()
    for k in x:
        assert x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]), k


def pack_index(pack):
    data = pack.read_bytes()
    i, n = struct.unpack_from("<QQ", data, len(data) - 32)
    return data, i, n, [struct.unpack_from("<16sQQ", data, i + 32 * e) for e in range(n)]


def damage_record(kind):
    def do(root, pack_a):
        p = root / "tags" / "alpha.safetensors"
        data = p.read_bytes()
        if kind == "truncated":
            p.write_bytes(data[: len(data) // 2])
        elif kind == "flipped":
            p.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
        elif kind == "flipped_tail":
            p.write_bytes(data[:-3] + bytes([data[-3] ^ 1]) + data[-2:])
        elif kind == "zeroed":
            p.write_bytes(bytes(len(data)))
        elif kind == "empty":
            p.write_bytes(b"")
        elif kind == "directory":
            p.unlink()
            p.mkdir()
        elif kind == "fifo":
            p.unlink()
            os.mkfifo(p)
        elif kind == "symlink":  # (to an honest copy outside the root: a store never follows a link)
            outside = root.parent / "outside.safetensors"
            outside.write_bytes(data)
            p.unlink()
            p.symlink_to(outside)
        return "alpha"
    return do


def damage_pack(kind):
    def do(root, pack_a):
        data, i, n, entries = pack_index(pack_a)
        b = bytearray(data)
        if kind == "trailer_magic":
            b[-1] ^= 0xFF
        elif kind == "trailer_count":
            struct.pack_into("<Q", b, len(b) - 24, 1 << 40)
        elif kind == "trailer_index_offset":
            struct.pack_into("<Q", b, len(b) - 32, i + 64)
        elif kind == "index_digest":
            b[i] ^= 0xFF
        elif kind == "index_offset":
            struct.pack_into("<Q", b, i + 16, entries[0][1] + 1)
        elif kind == "index_length":
            struct.pack_into("<Q", b, i + 24, 1 << 50)
        elif kind == "truncated":
            del b[-10:]
        elif kind == "truncated_half":
            del b[len(b) // 2:]
        elif kind == "empty":
            del b[:]
        elif kind == "blob_bytes":
            _, off, length = entries[0]
            b[off + length - 1] ^= 0x01
        elif kind == "blob_header":
            _, off, length = entries[-1]
            b[off] ^= 0x01
        elif kind == "zeroed":
            b[:] = bytes(len(b))
        if kind == "directory":
            pack_a.unlink()
            pack_a.mkdir()
        elif kind == "deleted":
            pack_a.unlink()
        else:
            pack_a.write_bytes(bytes(b))
        return pack_a.stem
    return do


# (not "symlink": a link under tags/ is not a tag, tests/attacks/test_store_attacks.py pins that; see below)
RECORD_DAMAGE = ["truncated", "flipped", "flipped_tail", "zeroed", "empty", "directory", "fifo"]
PACK_DAMAGE = ["trailer_magic", "trailer_count", "trailer_index_offset", "index_digest", "index_offset",
               "index_length", "truncated", "truncated_half", "empty", "blob_bytes", "blob_header", "zeroed",
               "directory", "deleted"]
# A pack whose index (or trailer) cannot be read: gc must keep it and list it under damaged_packs.
UNREADABLE_INDEX = {"trailer_magic", "trailer_count", "trailer_index_offset", "index_offset", "index_length",
                    "truncated", "truncated_half", "empty", "zeroed", "index_digest"}


def check_after(root, beta, capsys):
    """The intact tag still loads bit-exact and verifies: nothing it needs was deleted."""
    equal(tc.Store(root).load("beta"), beta)
    code, out, err = run(capsys, "store", "verify", root, "beta")
    assert code == 0, err


def store_actions(root, tmp_path):
    return {"ls": ["ls", root], "verify": ["verify", root], "verify_tag": ["verify", root, "alpha"],
            "export": ["export", root, "alpha", tmp_path / "out.safetensors"], "stats": ["stats", root],
            "gc": ["gc", root]}


def assert_damage_reported(code, out, err, name, json_mode, act, link=False):
    assert code == (2 if link else 1), (code, out, err)  # (a link is an access error, as for a linked folder)
    assert "Traceback" not in err and "report" not in err.lower().replace("reports", ""), err
    # verify's report (stdout) names what is damaged; every other action names it on stderr
    assert name in (err + out if act.startswith("verify") else err), (name, out, err)
    if json_mode and out.strip():
        json.loads(out)


@pytest.mark.parametrize("kind", RECORD_DAMAGE)
@pytest.mark.parametrize("json_mode", [False, True])
def test_store_actions_on_a_damaged_record(two_tags, tmp_path, capsys, kind, json_mode):
    root, alpha, beta, pack_a, _ = two_tags
    name = damage_record(kind)(root, pack_a)
    js = ["--json"] if json_mode else []
    for act, argv in store_actions(root, tmp_path).items():
        code, out, err = run(capsys, "store", argv[0], *js, *argv[1:])
        assert_damage_reported(code, out, err, name, json_mode, act, link=kind == "symlink")
        assert not (tmp_path / "out.safetensors").exists()
        check_after(root, beta, capsys)
    # the damaged tag's blobs were kept: restoring... they are still in their pack
    assert pack_a.exists()


@pytest.mark.parametrize("kind", PACK_DAMAGE)
def test_store_actions_on_a_damaged_pack(two_tags, tmp_path, capsys, kind):
    root, alpha, beta, pack_a, _ = two_tags
    name = damage_pack(kind)(root, pack_a)
    acts = store_actions(root, tmp_path)
    # verify (the whole store, and the tag whose blobs it held) and export read what is damaged
    for act in ("verify", "verify_tag", "export"):
        code, out, err = run(capsys, "store", *acts[act][:1], *acts[act][1:])
        assert code == 1, (act, code, err)
        assert "Traceback" not in err
        assert name in err + out or "alpha" in err + out, (act, err)
        assert not (tmp_path / "out.safetensors").exists()
    # ls reads records only; stats may read packs' indexes: 0, or 1 naming the pack
    for act in ("ls", "stats"):
        code, out, err = run(capsys, "store", acts[act][0], "--json", *acts[act][1:])
        assert code in (0, 1), (act, code, err)
        if code == 0:
            json.loads(out)
        else:
            assert name in err, (act, err)
    # gc, twice: never deletes a pack whose index it cannot read, and never a live blob
    for _ in range(2):
        code, out, err = run(capsys, "store", "gc", "--json", root)
        got = json.loads(out) if out.strip() else {}
        assert "Traceback" not in err
        if kind in UNREADABLE_INDEX:
            assert code == 1, (code, err)
            assert pack_a.exists() and name in err, err
            assert any(name in s for s in strings(got.get("damaged_packs"))), got
        else:
            assert code in (0, 1), (code, err)
            if code == 1:
                assert name in err or "alpha" in err, err
        check_after(root, beta, capsys)
    if kind in UNREADABLE_INDEX:
        assert pack_a.exists()


@pytest.fixture
def loose_tags(two_tags, monkeypatch):
    """The same tags, with every blob loose."""
    from tensorcanon.store import store as store_module

    root, alpha, beta, _, _ = two_tags
    shutil.rmtree(root)
    monkeypatch.setattr(store_module, "PACK_BLOB_LIMIT", 0)
    s = tc.Store(root)
    s.save("alpha", alpha)
    blobs_a = {p for p in (root / "blobs").rglob("*") if p.is_file()}
    s.save("beta", beta)
    return root, alpha, beta, sorted(blobs_a)


@pytest.mark.parametrize("kind", ["flipped", "truncated", "empty", "directory", "deleted", "appended"])
def test_store_actions_on_a_damaged_loose_blob(loose_tags, tmp_path, capsys, kind):
    root, alpha, beta, blobs_a = loose_tags
    blob = blobs_a[0]
    data = blob.read_bytes()
    if kind == "flipped":
        blob.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    elif kind == "truncated":
        blob.write_bytes(data[:-5])
    elif kind == "empty":
        blob.write_bytes(b"")
    elif kind == "appended":
        blob.write_bytes(data + b"\x00" * 64)
    elif kind == "directory":
        blob.unlink()
        blob.mkdir()
    elif kind == "deleted":
        blob.unlink()
    acts = store_actions(root, tmp_path)
    for act in ("verify", "verify_tag", "export"):
        code, out, err = run(capsys, "store", *acts[act])
        assert code == 1, (act, code, err)
        assert "Traceback" not in err and (blob.name in err + out or "alpha" in err + out), (act, err)
        assert not (tmp_path / "out.safetensors").exists()
    for act in ("ls", "stats", "gc"):
        code, out, err = run(capsys, "store", acts[act][0], "--json", *acts[act][1:])
        assert code in (0, 1), (act, code, err)
        assert "Traceback" not in err
        if code == 0:
            json.loads(out)
        else:
            assert blob.name in err or "alpha" in err, (act, err)
        check_after(root, beta, capsys)


@pytest.mark.parametrize("kind", ["truncated", "flipped", "empty", "directory", "deleted", "appended"])
def test_store_actions_on_a_damaged_marker(two_tags, tmp_path, capsys, kind):
    root, alpha, beta, _, _ = two_tags
    m = root / "tensorcanon-store"
    data = m.read_bytes()
    if kind == "truncated":
        m.write_bytes(data[:-3])
    elif kind == "flipped":
        m.write_bytes(data[:-2] + b"9\n")
    elif kind == "empty":
        m.write_bytes(b"")
    elif kind == "appended":
        m.write_bytes(data + b"x")
    elif kind == "directory":
        m.unlink()
        m.mkdir()
    elif kind == "deleted":
        m.unlink()
    before = sorted(str(p) for p in root.rglob("*"))
    for act, argv in store_actions(root, tmp_path).items():
        for js in ([], ["--json"]):
            code, out, err = run(capsys, "store", argv[0], *js, *argv[1:])
            assert code == 2, (act, code, err)
            assert "Traceback" not in err and str(root) in err, err
            if js and out.strip():
                json.loads(out)
    assert sorted(str(p) for p in root.rglob("*")) == before  # gc deleted nothing


def test_store_errors_exit_2(two_tags, tmp_path, capsys):
    root = two_tags[0]
    a_file = tmp_path / "plain.bin"
    a_file.write_bytes(b"tensorcanon-store layout 2\n")
    for argv in (["verify", root, "nosuchtag"], ["export", root, "nosuchtag", tmp_path / "o"],
                 ["verify", root, ".bad"], ["export", root, "bad/../x", tmp_path / "o"],
                 ["ls", tmp_path / "nothere"], ["stats", tmp_path / "nothere"], ["gc", tmp_path / "nothere"],
                 ["verify", tmp_path / "nothere"], ["gc", a_file], ["ls", a_file], ["verify", a_file],
                 ["stats", root / "tags"], ["gc", root / "packs"], ["export", a_file, "alpha", tmp_path / "o"]):
        for js in ([], ["--json"]):
            code, out, err = run(capsys, "store", argv[0], *js, *argv[1:])
            assert code == 2, (argv, code, err)
            assert "Traceback" not in err and err.strip()


# ------------------------------------------------------------------ gc: nothing rewritten, nothing live lost


def snapshot(root):
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns, p.read_bytes()) for p in (root / "packs").iterdir()}


def test_gc_rewrites_no_pack_whose_blobs_are_all_kept(two_tags, capsys):
    root, alpha, beta, _, _ = two_tags
    before = snapshot(root)
    for _ in range(3):
        code, out, err = run(capsys, "store", "gc", "--json", root)
        assert code == 0, err
        assert snapshot(root) == before
    equal(tc.Store(root).load("alpha"), alpha)
    equal(tc.Store(root).load("beta"), beta)


def test_gc_merges_small_packs_once_then_leaves_them(tmp_path, capsys):
    root = tmp_path / "many"
    s = tc.Store(root)
    g = torch.Generator().manual_seed(5)
    saved = {}
    for k in range(10):
        saved[f"t{k}"] = {f"w{k}": torch.randn(40, 40, generator=g)}
        s.save(f"t{k}", saved[f"t{k}"])
    assert len(list((root / "packs").iterdir())) == 10
    code, out, err = run(capsys, "store", "gc", root)
    assert code == 0, err
    merged = snapshot(root)
    assert len(merged) < 10
    for _ in range(2):
        code, out, err = run(capsys, "store", "gc", root)
        assert code == 0
        assert snapshot(root) == merged
    for tag, obj in saved.items():
        equal(tc.Store(root).load(tag), obj)
    # delete most tags: the dead blobs go, the live ones stay, bit-exact
    for k in range(8):
        tc.Store(root).delete(f"t{k}")
    code, out, err = run(capsys, "store", "gc", root)
    assert code == 0, err
    after = snapshot(root)
    for _ in range(2):
        assert run(capsys, "store", "gc", root)[0] == 0
        assert snapshot(root) == after
    assert run(capsys, "store", "verify", root)[0] == 0
    for tag in ("t8", "t9"):
        equal(tc.Store(root).load(tag), saved[tag])


# ------------------------------------------------------------------ a pack deleted mid-run; gc meeting a damaged copy


@pytest.mark.parametrize("act", ["verify", "verify_tag", "export", "stats", "gc", "ls"])
def test_a_pack_deleted_after_it_was_listed(two_tags, tmp_path, capsys, monkeypatch, act):
    """Another process (a collection) deletes alpha's pack between the listing and the read: no
    traceback; exit 1 (a tag's blob is gone: damage) or 2 naming the pack or the tag; gc deletes
    nothing that beta needs."""
    from tensorcanon.store import backend

    root, alpha, beta, pack_a, _ = two_tags
    listing = backend.Local.listing

    def racing(self, prefix):
        found = listing(self, prefix)
        if prefix.rstrip("/").endswith("packs") and pack_a.exists():
            pack_a.unlink()
        return found

    monkeypatch.setattr(backend.Local, "listing", racing)
    argv = store_actions(root, tmp_path)[act]
    code, out, err = run(capsys, "store", argv[0], *argv[1:])
    monkeypatch.undo()
    assert "Traceback" not in err and "report" not in err.lower().replace("reports", ""), err
    if act in ("verify", "verify_tag", "export"):
        assert code in (1, 2), (code, out, err)
        assert pack_a.stem in out + err or "alpha" in out + err, (out, err)
    else:
        assert code in (0, 1, 2), (code, err)
    assert not (tmp_path / "out.safetensors").exists()
    check_after(root, beta, capsys)


def test_gc_keeps_a_pack_whose_kept_copy_does_not_check(tmp_path, capsys):
    """A pack with dead blobs, to be rewritten, whose one live blob is damaged: gc copies no damaged
    blob, deletes no pack holding a live blob it could not copy, exits 1 naming it; beta is intact."""
    root = tmp_path / "st"
    g = torch.Generator().manual_seed(11)
    live, dead = torch.randn(8, 8, generator=g), torch.randn(200, 200, generator=g)
    beta = {"wb": torch.randn(16, 16, generator=g)}
    s = tc.Store(root)
    s.save("alpha", {"live": live, "dead": dead})
    pack_a = next((root / "packs").iterdir())
    s.save("keep", {"live": live})  # (its blob is in alpha's pack)
    s.save("beta", beta)
    s.delete("alpha")
    data, i, n, entries = pack_index(pack_a)
    raw_live = live.contiguous().view(torch.uint8).numpy().tobytes()
    d_live = xxhash.xxh3_128(b"float32[8,8]" + raw_live).digest()
    (off, length), = [(o, ln) for d, o, ln in entries if d == d_live]
    b = bytearray(data)
    b[off + length - 1] ^= 1
    pack_a.write_bytes(bytes(b))
    for _ in range(2):
        code, out, err = run(capsys, "store", "gc", root)
        assert "Traceback" not in err
        assert code == 1, (code, out, err)
        assert pack_a.stem in err or d_live.hex() in err or "keep" in err, err
        assert pack_a.exists()
        check_after(root, beta, capsys)
    code, out, err = run(capsys, "store", "verify", root)
    assert code == 1 and "keep" in out


def test_outputs_under_a_strict_ascii_stdout(tmp_path, monkeypatch):
    """A strict ASCII stdout and stderr (LANG=C): every command writes its JSON and text, escaped, and
    never raises UnicodeEncodeError (SECURITY.md: "under a strict or ASCII stdout")."""
    import io

    path, _ = hostile_file(tmp_path, LOCKABLE + "\u00e9.safetensors")
    odd = os.fsdecode(os.fsencode(tmp_path) + b"/o\xff.safetensors")
    tc.save({"x\u00e9": torch.ones(2)}, odd)
    root = tmp_path / ("st\u00e9" + LOCKABLE)
    tc.Store(root).save("alpha", {"w": torch.ones(3)})
    runs = [["inspect", "--json", path], ["inspect", path], ["hash", "--json", path, odd], ["verify", path, odd],
            ["diff", path, odd], ["diff", "--json", path, odd], ["store", "ls", root], ["store", "verify", root],
            ["store", "stats", "--json", root], ["store", "verify", root, "x\u00e9"], ["inspect", odd]]
    for argv in runs:
        out_b, err_b = io.BytesIO(), io.BytesIO()
        out = io.TextIOWrapper(out_b, encoding="ascii", errors="strict")
        err = io.TextIOWrapper(err_b, encoding="ascii", errors="strict")
        monkeypatch.setattr(sys, "stdout", out)
        monkeypatch.setattr(sys, "stderr", err)
        code = cli.main([str(a) for a in argv])
        out.flush()
        err.flush()
        monkeypatch.undo()
        assert code in (0, 1, 2), argv
        text = out_b.getvalue().decode("ascii") + err_b.getvalue().decode("ascii")
        assert "Traceback" not in text and "UnicodeEncodeError" not in text, (argv, text)
        if "--json" in argv:
            json.loads(out_b.getvalue())


def test_verify_note_naming_dropped_values_with_hostile_keys(tmp_path, capsys):
    """verify's ``tensorcanon: note: torch.load(...) would ... drop N values ($[...])`` quotes the paths
    of the values torch.load drops: keys from the file, escaped like every stderr line."""
    path = tmp_path / "n.safetensors"
    tc.save({"w": torch.ones(2), HOSTILE: 1, "x\u2028\u202e": "v"}, path)
    code, out, err = run(capsys, "verify", path)
    assert code == 0, err
    assert "note:" in err and "drop 2 values" in err, err
    clean(out, "verify stdout")
    clean(err, "verify stderr")


@pytest.mark.parametrize("argv", [
    ["hash", "--\x1b[2J\u202e\u2028x", "a"],             # a file named like an option, from a glob
    ["hash", "a", "--x\x9b31m"],
    ["store", "ls", "r", "extra\x1b[2J"],
    ["st\x1b[2Jore\u202e", "ls", "r"],
    ["diverge", "--tolerance", "x\x1b[2J\u202e", "a", "b"],
])
def test_usage_errors_quoting_hostile_arguments(capsys, argv):
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    assert code == 2
    clean(out, "stdout")
    clean(err, "usage error")
    assert "\\x1b" in err or "\\x9b" in err


def test_store_with_a_root_that_is_not_utf8_and_hostile_outs(tmp_path, capsys):
    root = os.fsdecode(os.fsencode(tmp_path) + b"/st\xff\x1b[2J")
    tc.Store(root).save("alpha", {"w": torch.ones(3)})
    for act in (["ls"], ["verify"], ["stats"], ["gc"]):
        code, out, err = run(capsys, "store", act[0], "--json", root)
        assert code == 0, err
        got = json_out(out)
        assert "\\xff" in got["root"], got
        code, out, err = run(capsys, "store", act[0], root)
        clean(out, f"store {act}")
        clean(err, f"store {act}")
    # export to a folder that does not exist, named with controls: an error (2), escaped
    for js in ([], ["--json"]):
        code, out, err = run(capsys, "store", "export", *js, root, "alpha", tmp_path / ("no\x1b[2J\u202e") / "o")
        assert code == 2, (code, err)
        clean(out.replace("\n", ""), "stdout")
        clean(err, "stderr")
        assert "\\x1b[2J" in err


def test_a_record_whose_fields_hold_controls(two_tags, tmp_path, capsys):
    """A record is a tensorcanon file like any other: its ``tag`` field holds ESC, U+202E, U+2028.
    Every store action names the damage with them escaped, in text and JSON."""
    root, alpha, beta, _, _ = two_tags
    header = (root / "tags" / "alpha.safetensors").read_bytes()
    good = tc.load(root / "tags" / "alpha.safetensors")
    tc.save({**good, "tag": "x\x1b[2J\u202e\u2028\x9b"}, root / "tags" / "alpha.safetensors")
    assert header != (root / "tags" / "alpha.safetensors").read_bytes()
    shown = "x\\x1b[2J\\u202e\\u2028\\x9b"  # (the message quotes the record's tag as repr does)
    for act, argv in store_actions(root, tmp_path).items():
        for js in ([], ["--json"]):
            code, out, err = run(capsys, "store", argv[0], *js, *argv[1:])
            assert code == 1, (act, code, err)
            clean(err, f"stderr of {act}")
            if js and out.strip():
                got = json_out(out)
                assert any(shown in s for s in strings(got)) or shown in err, got
            else:
                clean(out, f"stdout of {act}")
                assert shown in out + err, (out, err)


def test_check_of_several_lockfiles_one_unreadable_and_hostile(tmp_path, capsys):
    path, _ = hostile_file(tmp_path, LOCKABLE + ".safetensors")
    good = tmp_path / "good.lock"
    assert run(capsys, "lock", path, "-o", good)[0] == 0
    bad = tmp_path / ("bad\x1b[2J\u202e.lock")
    bad.write_bytes(b"tensorcanon-lock 3\nnot a line \x1b[2J\xe2\x80\xae\n")
    missing = tmp_path / ("gone\u2028.lock")
    code, out, err = run(capsys, "check", "--json", good, bad, missing)
    assert code == 2, (code, out, err)
    got = json_out(out)
    clean(err, "stderr")
    assert [lf["lockfile"] for lf in got["lockfiles"]] == [str(good), str(bad), str(missing)]
    assert "files" in got["lockfiles"][0] and "error" in got["lockfiles"][1] and "error" in got["lockfiles"][2]
    code, out, err = run(capsys, "check", good, bad, missing)
    assert code == 2
    clean(out, "check text")
    clean(err, "stderr")


def test_gc_after_deleting_the_bases_of_delta_chains(tmp_path, capsys):
    """Checkpoints of one drifting tensor (deltas on deltas): deleting the early tags and collecting,
    again and again, keeps every base a live tag needs; each later gc writes nothing."""
    root = tmp_path / "chain"
    s = tc.Store(root)
    g = torch.Generator().manual_seed(2)
    w = torch.randn(128, 64, generator=g)
    saved = {}
    for step in range(6):
        w = w + 1e-4 * torch.randn(128, 64, generator=g)
        saved[f"s{step}"] = {"w": w.clone(), "b": torch.full((16,), float(step))}
        s.save(f"s{step}", saved[f"s{step}"])
    assert tc.Store(root).stats()["max_depth"] >= 2
    for k in range(4):
        tc.Store(root).delete(f"s{k}")
        code, out, err = run(capsys, "store", "gc", "--json", root)
        assert code == 0, err
        json_out(out)
        first = snapshot(root)
        code, out, err = run(capsys, "store", "gc", "--json", root)
        assert code == 0 and json.loads(out)["written_packs"] == 0 and snapshot(root) == first
        assert run(capsys, "store", "verify", root)[0] == 0
        for tag in list(saved)[k + 1:]:
            equal(tc.Store(root).load(tag), saved[tag])


def test_a_corrupt_tensor_with_a_hostile_key(tmp_path, capsys, monkeypatch):
    """verify, hash --verify and check name the corrupt tensor by its path: a key with controls, in
    JSON (parsed: the path) and text (escaped)."""
    monkeypatch.chdir(tmp_path)
    path = tmp_path / (LOCKABLE + ".safetensors")
    tc.save({HOSTILE: torch.arange(64, dtype=torch.float32)}, path)
    lock = tmp_path / "c.lock"
    assert run(capsys, "lock", path, "-o", lock)[0] == 0
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # (a data byte of the one tensor)
    path.write_bytes(bytes(data))
    for argv in (["verify", "--json", path], ["hash", "--verify", "--json", path], ["check", "--json", lock],
                 ["verify", path], ["hash", "--verify", path], ["check", lock]):
        code, out, err = run(capsys, *argv)
        assert code == 1, (argv, code, out, err)
        clean(err, f"stderr of {argv[:2]}")
        if "--json" in argv:
            got = json_out(out)
            assert any("k\\u001b[2J" in s or "k\\x1b[2J" in s for s in strings(got)), got
        else:
            clean(out, f"stdout of {argv[:2]}")
            assert "k\\u001b[2J" in out + err or "k\\x1b[2J" in out + err, (out, err)


def test_diverge_html_into_a_missing_hostile_folder(tmp_path, capsys):
    a = [rec("m", "aten.mm.default", role="in.0"), rec("m", "aten.mm.default")]
    x, y = tmp_path / "a.trace", tmp_path / "b.trace"
    write_trace(x, a)
    write_trace(y, a)
    page = tmp_path / ("no\x1b[2J\u202e\u2028") / "p.html"
    for js in ([], ["--json"]):
        code, out, err = run(capsys, "diverge", *js, "--html", page, x, y)
        assert code == 2, (code, out, err)
        clean(err, "stderr")
        clean(out.replace("\n", ""), "stdout")
        assert "\\x1b[2J" in err


def test_repro_whose_command_writes_no_hostile_out(tmp_path, capsys):
    out_name = tmp_path / (NAME + ".never")
    code, out, err = run(capsys, "repro", "--json", "--runs", "2", "--out", out_name, "--",
                         sys.executable, "-c", "pass")
    assert code == 2, (code, out, err)
    clean(err, "repro stderr")
    if out.strip():
        json_out(out)
    assert "\\x1b[2J" in err


def test_a_progress_bar_naming_a_hostile_file(tmp_path):
    """The bar drawn on a terminal while a large file is read names the file: escaped, as every
    stderr line (a name holding ESC or U+202E would act on the terminal it is drawn on)."""
    import io

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    path = tmp_path / (NAME + "\udcff.safetensors")
    path.write_bytes(b"x")
    err = Terminal()
    out = cli._Out(io.StringIO(), err, False, True)
    wrap = out.wrap("verifying")
    assert wrap is not None
    with open(path, "rb") as fh:
        wrap(fh, 1 << 40)
        bar = out._bars[0]
        bar.done = 1 << 39
        bar._draw()
    out.close_bars()
    drawn = err.getvalue()
    assert "verifying f\\x1b[2J" in drawn
    clean(drawn.replace("\r", ""), "progress bar")
