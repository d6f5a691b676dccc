"""Conformance: every MUST of docs/FORMAT.md has a test, and the rules no other file tests.

tests/golden/conformance.json maps each MUST of the spec (by a quote of its
text) to the tests that would fail if it broke and the golden vectors that show
it. The first tests here keep that map complete and honest: every requirement
unit of FORMAT.md (paragraph, list item or table row) holding MUST is quoted,
every quote is in the spec, every named test exists and every named vector is
committed. The rest test rules that no other file targets, mostly readers
rejecting files a conforming writer could not produce (each crafted from a
valid file, with its manifest digest recomputed so the check under test is the
one that fires).
"""

from __future__ import annotations

import argparse
import ast
import base64
import collections
import dataclasses
import enum
import io
import json
import pathlib
import random
import re
import struct
import sys

import msgpack
import numpy as np
import pytest
import torch

import tensorcanon
from tensorcanon import FormatError
from tensorcanon.format import devices, tree

ROOT = pathlib.Path(__file__).parent.parent
FORMAT = (ROOT / "docs" / "FORMAT.md").read_text(encoding="utf-8")
CONFORMANCE = json.loads((ROOT / "tests" / "golden" / "conformance.json").read_text(encoding="utf-8"))

import hostile_lib as h
import vectors

_KEYWORD = re.compile(r"\bMUST\b|\bREQUIRED\b|\bSHALL\b")


def _norm(text: str) -> str:
    return " ".join(text.split())


def requirement_units(text: str) -> list[str]:
    """Paragraphs, list items and table rows of ``text`` (outside code blocks), whitespace-normalized."""
    out, block, in_code = [], [], False

    def flush():
        if block:
            out.append(_norm(" ".join(block)))
            block.clear()

    for line in text.split("\n"):
        if line.startswith("```"):
            flush()
            in_code = not in_code
            continue
        if in_code:
            continue
        if line.startswith("#") or not line.strip():
            flush()
            continue
        if line.startswith("|"):
            flush()
            out.append(_norm(line))
            continue
        if re.match(r"^\s*(- |\d+\. )", line):
            flush()
        block.append(line)
    flush()
    return out


# ------------------------------------------------------------------ the map is complete


def _musts():
    return [u for u in requirement_units(FORMAT)
            if _KEYWORD.search(u) and not u.startswith("The key words MUST")]


def test_every_must_of_the_spec_is_mapped():
    quotes = [_norm(e["quote"]) for e in CONFORMANCE["requirements"]]
    missing = []
    for unit in _musts():
        found = {q for q in quotes if q in unit}
        if len(found) < len(_KEYWORD.findall(unit)):
            missing.append(f"{len(_KEYWORD.findall(unit))} MUST, {len(found)} mapped: {unit[:160]}")
    assert not missing, "requirements without an entry in conformance.json:\n" + "\n".join(missing)


def test_every_entry_quotes_the_spec_and_names_real_tests_and_vectors():
    units = requirement_units(FORMAT)
    ids = [e["id"] for e in CONFORMANCE["requirements"]]
    assert len(ids) == len(set(ids)), "duplicate ids"
    defined: dict[str, set] = {}
    for entry in CONFORMANCE["requirements"]:
        quote = _norm(entry["quote"])
        assert _KEYWORD.search(quote), f"{entry['id']}: the quote must hold the MUST it maps"
        assert any(quote in u for u in units), f"{entry['id']}: quote not in FORMAT.md: {quote}"
        sec = entry["section"]
        assert re.search(rf"^#+ {re.escape(sec)}\.? ", FORMAT, flags=re.M), f"{entry['id']}: no section {sec}"
        assert entry["tests"], f"{entry['id']}: no test"
        for node in entry["tests"]:
            file, _, func = node.partition("::")
            path = ROOT / file
            assert path.is_file(), f"{entry['id']}: {file} does not exist"
            if file not in defined:
                mod = ast.parse(path.read_text(encoding="utf-8"))
                defined[file] = {n.name for n in mod.body if isinstance(n, ast.FunctionDef)}
            assert func in defined[file] and func.startswith("test_"), f"{entry['id']}: no test {node}"
        for name in entry.get("vectors", []):
            older = name[:3] if name[:3] in ("v1/", "v2/") else ""
            assert name in vectors.VECTORS or older, f"{entry['id']}: no vector {name}"
            stem = name[len(older):]
            folder = ROOT / "tests" / "golden" / older.rstrip("/")
            assert (folder / f"{stem}.safetensors").is_file(), name


def test_every_golden_vector_is_listed_with_what_it_covers():
    listed = CONFORMANCE["vectors"]
    assert set(listed) == set(vectors.VECTORS), "conformance.json 'vectors' must describe every vector"
    for name in vectors.VECTORS:
        assert f"`{name}`" in FORMAT, f"docs/FORMAT.md §13.1 does not list the vector {name}"


# ------------------------------------------------------------------ §10: the worked example


def _hexdump_bytes(block: str) -> bytes:
    out = bytearray()
    for line in block.strip().split("\n"):
        hexpart = line.split(":", 1)[1][:41]
        out += bytes.fromhex(hexpart.replace(" ", ""))
    return bytes(out)


def test_the_worked_example_is_what_the_writer_writes():
    section = FORMAT.split("## 10. Worked example", 1)[1]
    dump = re.search(r"```(?:text)?\n(00000000:.*?)```", section, flags=re.S).group(1)
    data = tensorcanon.dumps({"w": torch.arange(4, dtype=torch.float32)})
    assert _hexdump_bytes(dump) == data
    digest = tensorcanon.fingerprint({"w": torch.arange(4, dtype=torch.float32)})
    assert f"file\ndigest `{digest}`" in section or f"digest `{digest}`" in _norm(section)
    smallest = tensorcanon.dumps({})
    header = smallest[8:].rstrip(b" ").decode()
    assert f"`{header}`" in section and len(smallest) == 208


# ------------------------------------------------------------------ §1.3 versions


@pytest.mark.parametrize("version", [0, 4, 255, True, 3.0, "3", None])
def test_versions_other_than_1_2_and_3_are_rejected(version):
    data = tensorcanon.dumps({"w": torch.ones(2)})
    bad = h.with_manifest(data, lambda m: m.__setitem__("version", version))
    with pytest.raises(FormatError, match="format version"):
        tensorcanon.loads(bad)
    for older in (1, 2):
        ok = h.with_manifest(data, lambda m, v=older: m.__setitem__("version", v))
        assert torch.equal(tensorcanon.loads(ok)["w"], torch.ones(2))


# ------------------------------------------------------------------ §2.2 header JSON


def test_header_json_escapes_and_raw_utf8():
    key = 'q"b\\s/\x01\x1b\x7fé\u2028\U0001f600\t\n\r\x08\x0c'
    data = tensorcanon.dumps({key: torch.ones(1)})
    (n,) = struct.unpack("<Q", data[:8])
    raw = data[8:8 + n]
    want = '"q\\"b\\\\s/\\u0001\\u001b\x7fé\u2028\U0001f600\\t\\n\\r\\b\\f"'.encode()
    assert want in raw
    assert b"\\/" not in raw and b"\\u00e9" not in raw and b"\\u001B" not in raw


@pytest.mark.parametrize("old, new", [
    (b"\\u001b", b"\\u001B"),           # uppercase hex
    ("é".encode(), b"\\u00e9"),         # non-ASCII escaped
    (b"/", b"\\/"),                      # an escaped solidus
    (b'"dtype":"F32"', b'"dtype": "F32"'),  # a space
])
def test_header_json_written_another_way_is_rejected(old, new):
    data = tensorcanon.dumps({"a/é\x1b": torch.ones(1)})
    (n,) = struct.unpack("<Q", data[:8])
    text = data[8:8 + n].rstrip(b" ")
    assert old in text
    changed = text.replace(old, new, 1)
    bad = h.with_header_text(changed + b" " * (-len(changed) % 8), data[8 + n:])
    with pytest.raises(FormatError, match="not in canonical form"):
        tensorcanon.loads(bad)


# ------------------------------------------------------------------ §2.4 __metadata__


@pytest.mark.parametrize("change", ["extra_tensorcanon_key", "user_key", "no_digest", "format_np"])
def test_metadata_holds_exactly_the_listed_keys(change):
    data = tensorcanon.dumps({"w": torch.ones(2)})
    header, body = h.split(data)
    meta = dict(header["__metadata__"])
    if change == "extra_tensorcanon_key":
        meta["tensorcanon.note"] = "x"
    elif change == "user_key":
        meta["author"] = "me"
    elif change == "no_digest":
        del meta["tensorcanon.digest"]
    else:
        meta["format"] = "np"
    header = dict(header, __metadata__=meta)
    with pytest.raises(FormatError, match="__metadata__ must hold"):
        tensorcanon.loads(h.with_header(header, body))


def test_any_tensorcanon_key_makes_a_tensorcanon_file():
    """A plain safetensors file loads as a dict, but the same file with one tensorcanon.* key is a
    (broken) tensorcanon file: no fallback to plain reading."""
    from safetensors.torch import save

    plain = save({"w": torch.ones(2)}, metadata={"format": "pt"})
    assert torch.equal(tensorcanon.loads(plain)["w"], torch.ones(2))
    claimed = save({"w": torch.ones(2)}, metadata={"format": "pt", "tensorcanon.manifesto": "x"})
    with pytest.raises(FormatError, match="__metadata__ must hold"):
        tensorcanon.loads(claimed)


def test_verifying_a_plain_file_says_it_records_no_digests():
    from safetensors.torch import save

    with pytest.raises(FormatError, match="records no digests"):
        tensorcanon.verify(save({"w": torch.ones(2)}))


# ------------------------------------------------------------------ §3 names


def test_names_are_not_paths():
    """Readers take structure from the tree, never from names: "a.b" and ["a"]["b"] stay apart."""
    t1, t2 = torch.ones(1), torch.zeros(1)
    back = tensorcanon.loads(tensorcanon.dumps({"a.b": t1, "a": {"b": t2}}))
    assert torch.equal(back["a.b"], t1) and torch.equal(back["a"]["b"], t2)


# ------------------------------------------------------------------ §4, §5.3 rows


def test_ndarray_rows_need_a_numpy_dtype_and_no_grad():
    data = tensorcanon.dumps({"a": np.zeros(2, dtype=np.float32), "t": torch.zeros(2, dtype=torch.bfloat16)})
    with pytest.raises(FormatError, match="invalid requires_grad"):
        tensorcanon.loads(h.with_manifest(data, lambda m: m["tensors"][0].__setitem__("requires_grad", True)))

    def bf16_array(m):
        m["tensors"][1]["kind"] = "ndarray"
    with pytest.raises(FormatError, match="numpy lacks"):
        tensorcanon.loads(h.with_manifest(data, bf16_array))
    with pytest.raises(tensorcanon.UnsupportedTypeError, match="numpy arrays of dtype object"):
        tensorcanon.dumps({"o": np.array([object()])})


def test_writer_refuses_tensors_outside_the_dtype_table():
    with pytest.raises(tensorcanon.UnsupportedTypeError, match="quantized"):
        tensorcanon.dumps({"q": torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)})


@pytest.mark.parametrize("change, match", [
    ("dtype", "here but the header says"),
    ("shape", "here but the header says"),
    ("extra_member", "not in canonical form|does not list|the manifest does not list"),
    ("missing_member", "is not in the header"),
])
def test_rows_and_header_members_match(change, match):
    data = tensorcanon.dumps({"a": torch.zeros(2), "b": torch.ones(3)})
    m, header, body = h.manifest_of(data)
    header = {k: dict(v) if k != "__metadata__" else v for k, v in header.items()}
    if change == "dtype":
        header["a"]["dtype"] = "I32"
    elif change == "shape":
        header["a"]["shape"] = [1, 2]
    elif change == "extra_member":
        header["c"] = {"data_offsets": [len(body), len(body) + 4], "dtype": "F32", "shape": [1]}
        body = body + bytes(4)
    else:
        m["tensors"][0]["name"] = "zz"
    bad = h.rebuild(data, h.repack(m), header, body)
    with pytest.raises(FormatError, match=match):
        tensorcanon.loads(bad)


# ------------------------------------------------------------------ §5.1 msgpack profile


def _raw_edit(data: bytes, old: bytes, new: bytes) -> bytes:
    m, header, body = h.manifest_of(data)
    raw = h.repack(m)
    assert old in raw, old
    return h.rebuild(data, raw.replace(old, new, 1), header, body)


@pytest.mark.parametrize("old, new, why", [
    (b"\xa7version\x03", b"\xa7version\xcc\x03", "uint 8 for a fixint"),
    (b"\xa4dict", b"\xd9\x04dict", "str 8 for a fixstr"),
    (b"\xa4dict", b"\xc4\x04dict", "bin for a str"),
    (b"\xcb\x3f\xf8\x00\x00\x00\x00\x00\x00", b"\xca\x3f\xc0\x00\x00", "float 32"),
    (b"\x85\xa9algorithm", b"\xde\x00\x05\xa9algorithm", "map 16 for a fixmap"),
    (b"\x93\xa4list", b"\xdc\x00\x03\xa4list", "array 16 for a fixarray"),
    (b"\xa4meta\xc0\xa4root", b"\xa4root\xc0\xa4meta", "keys in another order"),
    (b"\xa1b", b"\xa1\xff", "invalid UTF-8"),
])
def test_non_canonical_msgpack_is_rejected(old, new, why):
    data = tensorcanon.dumps({"a": 1.5, "b": torch.ones(1), "c": [1, 2]})
    refusals = "not in canonical form|not valid msgpack|exactly the keys|must start with a str tag"
    with pytest.raises(FormatError, match=refusals):
        tensorcanon.loads(_raw_edit(data, old, new))


BIGINT_EXAMPLES = [
    (2**64 - 1, "cf ff ff ff ff ff ff ff ff"),
    (2**64, "c7 09 01 01 00 00 00 00 00 00 00 00"),
    (-(2**63) - 1, "c7 09 01 ff 7f ff ff ff ff ff ff ff"),
    (-(2**127), "d8 01 80 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00"),
    (2**128 - 1, "c7 11 01 00 ff ff ff ff ff ff ff ff ff ff ff ff ff ff ff ff"),
]


@pytest.mark.parametrize("n, encoding", BIGINT_EXAMPLES, ids=[e for _, e in BIGINT_EXAMPLES])
def test_big_int_encodings_are_the_specs_examples(n, encoding):
    assert f"`{encoding}`" in FORMAT
    from tensorcanon.io import writer

    node = writer.plan(n).root
    assert msgpack.packb(node, use_bin_type=True) == bytes.fromhex(encoding.replace(" ", ""))
    assert tensorcanon.loads(tensorcanon.dumps(n)) == n


@pytest.mark.parametrize("node, match", [
    (msgpack.ExtType(1, (5).to_bytes(1, "big")), "big int is not in canonical form"),       # in range
    (msgpack.ExtType(1, b"\x00" + (2**64).to_bytes(9, "big")), "big int is not in canonical form"),  # not minimal
    (msgpack.ExtType(1, b""), "big int is not in canonical form"),                          # empty
    (msgpack.ExtType(2, b"\x01"), "unknown ext type 2"),
])
def test_ext_type_rules(node, match):
    data = tensorcanon.dumps({"v": 0})
    bad = h.with_manifest(data, lambda m: m.__setitem__("root", ["dict", "v", node]))
    with pytest.raises(FormatError, match=match):
        tensorcanon.loads(bad)


# ------------------------------------------------------------------ §6.2, §6.3 tags and keys


BAD_NODES = [
    (["nope"], "unknown tag"),
    ([], "must start with a str tag"),
    ([1, 2], "must start with a str tag"),
    (["dict", "b", 1, "a", 2], "not in canonical order"),
    (["dict", "a", 1, "a", 2], "not in canonical order"),
    (["dict", "a"], "odd number"),
    (["odict"], "needs its metadata slot"),
    (["odict", None, "a", 1, "a", 2], "repeats"),
    (["set", 2, 1], "not in canonical order"),
    (["frozenset", 1, 1], "not in canonical order"),
    (["complex", 1.0], "takes 2 values"),
    (["complex", 1, 2.0], "takes two floats"),
    (["size", True], "'size' takes ints"),
    (["size", 2**63], "'size' takes ints"),
    (["dtype"], "takes 1 values"),
    (["device", "cuda:01"], "not canonical device text"),
    (["np.scalar", "bfloat16", b"\x00\x00"], "invalid numpy scalar"),
    (["np.scalar", "int32", b"\x00"], "invalid numpy scalar"),
    (["np.scalar", "bool", b"\x02"], "byte other than 0 or 1"),
    (["tensor", -1], "out of range"),
    (["tensor", True], "out of range"),
    (["obj", 3, 1], "needs a str type name"),
    (["obj", "x"], "takes 2 values"),
]


@pytest.mark.parametrize("node, match", BAD_NODES, ids=[repr(n)[:40] for n, _ in BAD_NODES])
def test_tags_arity_and_arguments(node, match):
    data = tensorcanon.dumps({"v": 0})
    bad = h.with_manifest(data, lambda m: m.__setitem__("root", ["dict", "v", node]))
    with pytest.raises(FormatError, match=match):
        tensorcanon.loads(bad)
    with pytest.raises(FormatError, match=match):
        tensorcanon.verify(bad)


@pytest.mark.parametrize("key", [1 + 2j, np.float32(1), torch.ones(1), torch.device("cpu")])
def test_writer_refuses_keys_that_are_not_key_values(key):
    with pytest.raises(tensorcanon.UnsupportedTypeError, match="no canonical order"):
        tensorcanon.dumps({key: 1})
    with pytest.raises(tensorcanon.UnsupportedTypeError):
        tensorcanon.dumps(collections.OrderedDict([(key, 1)]))


@pytest.mark.parametrize("tag", ["dict", "set", "odict"])
def test_reader_rejects_keys_that_are_not_key_values(tag):
    data = tensorcanon.dumps({"v": 0})
    key = ["complex", 1.0, 2.0]
    node = {"dict": ["dict", key, 1], "set": ["set", key], "odict": ["odict", None, key, 1]}[tag]
    bad = h.with_manifest(data, lambda m: m.__setitem__("root", ["dict", "v", node]))
    with pytest.raises(FormatError, match="is not allowed"):
        tensorcanon.loads(bad)


def test_keys_that_tie_are_refused():
    a = struct.unpack(">d", bytes.fromhex("7ff8000000000001"))[0]
    b = struct.unpack(">d", bytes.fromhex("7ff8000000000001"))[0]
    assert a is not b
    with pytest.raises(tensorcanon.UnsupportedTypeError, match="same canonical position"):
        tensorcanon.dumps({a: 1, b: 2})


def test_a_str_that_is_not_valid_unicode_is_refused():
    with pytest.raises(tensorcanon.UnsupportedTypeError, match="lone surrogate"):
        tensorcanon.dumps({"s": "a\udc80"})


def test_metadata_with_tensor_nodes_is_rejected():
    data = tensorcanon.dumps({"w": torch.ones(1)}, metadata={"a": 1})
    bad = h.with_manifest(data, lambda m: m.__setitem__("meta", ["dict", "a", ["tensor", 0]]))
    with pytest.raises(FormatError, match="out of range"):
        tensorcanon.read_metadata(bad)
    with pytest.raises(FormatError, match="out of range"):
        tensorcanon.verify(bad)


def _spec_tags() -> set[str]:
    """The tags of the first table under §6.2, §6.7 and §6.12 (each a table whose first column is "Tag")."""
    tags = set()
    for heading in ("### 6.2 Tagged nodes", "### 6.7 Random state values", "### 6.12 Tensors made of several"):
        part = FORMAT.split(heading, 1)[1]
        table = part[part.index("| Tag |"):].split("\n\n", 1)[0]
        tags |= set(re.findall(r"^\| `([a-z.]+)` \|", table, flags=re.M))
    return tags


def test_the_writer_emits_only_the_tags_the_spec_defines():
    assert _spec_tags() == {kind.tag for kind in tree.node_kinds()}
    seen = set()

    def walk(node):
        if isinstance(node, list) and node and isinstance(node[0], str):
            seen.add(node[0])
            for child in node[1:]:
                walk(child)

    from tensorcanon.io import writer

    for name in filter(vectors.buildable, vectors.VECTORS):  # (torch 2.4 lacks some dtypes of dtypes_u8)
        obj, meta = vectors.build(name)
        p = writer.plan(obj, meta)
        walk(p.root)
        walk(p.meta)
    tags = {kind.tag for kind in tree.node_kinds()}
    assert seen <= tags
    assert seen == tags, f"golden vectors never use {tags - seen}"


# ------------------------------------------------------------------ §4.3 devices, §7.3 digests, §8


def test_devices_a_writer_cannot_record():
    for text in ("npu:0", "cuda", "cuda:128", "cpu", "meta:0"):
        assert devices.of_tensor(text) is not None, text
    for text in ("cuda:0", "cuda:127", "mps:0", "xla:3", "privateuseone:1"):
        assert devices.of_tensor(text) is None, text
    with pytest.raises(tensorcanon.UnsupportedTypeError, match="cannot be saved"):
        tensorcanon.dumps(torch.device("cuda:128"))  # torch prints it cuda:-128


@pytest.mark.parametrize("text", [
    "XXH3-128:" + "0" * 32, "xxh3-128:" + "A" * 32, "xxh3-128:" + "0" * 31, "0" * 32, "sha256:" + "0" * 32,
])
def test_malformed_digest_text_is_rejected(text):
    data = tensorcanon.dumps({"w": torch.ones(1)})
    header, body = h.split(data)
    header = dict(header, __metadata__=dict(header["__metadata__"], **{"tensorcanon.digest": text}))
    with pytest.raises(FormatError, match="tensorcanon.digest"):
        tensorcanon.loads(h.with_header(header, body))


class _MutatingPipe(io.RawIOBase):
    """A non-seekable target whose first write changes the tensor being saved."""

    def __init__(self, tensor):
        self.tensor, self.out = tensor, bytearray()

    def writable(self):
        return True

    def write(self, b):
        if not self.out:
            self.tensor.add_(1)
        self.out += bytes(b)
        return len(b)


def test_a_tensor_that_changes_between_the_two_passes_is_an_error():
    t = torch.zeros(4)
    with pytest.raises(tensorcanon.TensorCanonError, match="changed while it was being saved"):
        tensorcanon.save({"t": t}, _MutatingPipe(t))


def test_manifest_base64_must_be_canonical():
    data = tensorcanon.dumps({})
    header, body = h.split(data)
    text = header["__metadata__"]["tensorcanon.manifest"]
    assert text.endswith("w==")  # the last byte, 0x03 (the version), leaves 4 padding bits
    bumped = text[:-3] + "x=="   # same decoded bytes, non-zero padding bits
    assert base64.b64decode(bumped) == base64.b64decode(text)
    header = dict(header, __metadata__=dict(header["__metadata__"], **{"tensorcanon.manifest": bumped}))
    with pytest.raises(FormatError, match="base64 is not in canonical form"):
        tensorcanon.loads(h.with_header(header, body))


# ------------------------------------------------------------------ issue 20: writers refuse what readers reject
# (§8), and the rules that left two readings open. Crafted files come from the conformance corpus's builders
# (tests/conformance/build_corpus.py), which also puts each of them in the corpus.

import build_corpus as corpus


def _new_invalid(name: str) -> bytes:
    return corpus.NEW_INVALID[name][0]()


def _nan_object(bits: int = 0x7FF8000000000000) -> float:
    return struct.unpack(">d", struct.pack(">Q", bits))[0]  # a new float object each time


def test_ordered_dict_keys_that_tie_are_refused_and_rejected():
    a, b = _nan_object(), _nan_object()
    assert a is not b and len(collections.OrderedDict([(a, 1), (b, 2)])) == 2  # two keys for Python
    for od in (collections.OrderedDict([(a, 1), (b, 2)]), collections.OrderedDict([((a,), 1), ((b,), 2)])):
        with pytest.raises(tensorcanon.UnsupportedTypeError, match="same canonical position"):
            tensorcanon.dumps(od)
    with pytest.raises(FormatError, match="repeats"):
        tensorcanon.loads(_new_invalid("odict_tied_nan_keys"))


def test_memory_formats_of_tensors_without_elements():
    t = torch.zeros(0, 3, 2, 2).contiguous(memory_format=torch.channels_last)
    header, _ = h.split(tensorcanon.dumps({"t": t}))
    assert "tensorcanon.memory_formats" not in header["__metadata__"]  # never recorded
    with pytest.raises(FormatError, match="cannot be channels_last"):
        tensorcanon.loads(_new_invalid("memory_format_no_elements"))


def test_the_consolidated_file_records_no_memory_format(tmp_path):
    sys.path.insert(0, str(ROOT / "tests" / "dcp"))
    import tensorcanon.dcp as tcd

    from threaded import run_ranks

    w = torch.arange(24.0).reshape(2, 3, 2, 2).contiguous(memory_format=torch.channels_last)
    folder, out = str(tmp_path / "ckpt"), tmp_path / "one.safetensors"
    run_ranks(1, lambda rank: tcd.save({"w": w, "step": 1}, folder))
    tcd.consolidate(folder, out)
    header, _ = h.split(out.read_bytes())
    assert set(header["__metadata__"]) == {"format", "tensorcanon.digest", "tensorcanon.manifest"}
    assert out.read_bytes() == tensorcanon.dumps({"w": w.contiguous(), "step": 1})
    assert "tensorcanon.memory_formats" in h.split(tensorcanon.dumps({"w": w, "step": 1}))[0]["__metadata__"]


class _Odd(enum.Enum):
    NAN = float("nan")
    PAIR = (float("nan"), 1)
    NEG_ZERO = -0.0
    ONE = 1


class _TwoNans(enum.Enum):
    A = float("nan")
    B = float("nan")  # another NaN object with the same bits: no file can tell A from B


def test_enum_members_are_found_by_their_value_as_the_file_holds_it():
    tensorcanon.register(_Odd)
    tensorcanon.register(_TwoNans)
    try:
        for member in _Odd:
            assert tensorcanon.loads(tensorcanon.dumps(member)) is member
        for member in _TwoNans:
            with pytest.raises(tensorcanon.UnsupportedTypeError, match="2 members of _TwoNans"):
                tensorcanon.dumps(member)
        data = tensorcanon.dumps({"v": _Odd.ONE})
        bad = h.with_manifest(data, lambda m: m["root"][2].__setitem__(2, True))  # True == 1, but not 1
        with pytest.raises(FormatError, match="not the value of a _Odd member"):
            tensorcanon.loads(bad)
    finally:
        tensorcanon.unregister(_Odd)
        tensorcanon.unregister(_TwoNans)


def _set_state(obj, **change):
    state = obj.state if isinstance(obj, np.random.BitGenerator) else obj.get_state(legacy=False)
    for k, v in change.items():
        state[k] = v
    if isinstance(obj, np.random.BitGenerator):
        obj.state = state
    else:
        obj.set_state(state)
    return obj


def _random_with_gauss(gauss):
    r = random.Random(3)
    version, internal, _ = r.getstate()
    r.setstate((version, internal, gauss))
    return r


HAND_SET_STATES = {  # states numpy, random and torch accept that §6.7 does not: the writer refuses them
    "pcg64_has_uint32_7": (lambda: _set_state(np.random.PCG64(1), has_uint32=7), "has_uint32"),
    "philox_buffer_pos_9": (lambda: _set_state(np.random.Philox(1), buffer_pos=9), "buffer_pos"),
    "legacy_gauss_without_flag": (lambda: _set_state(np.random.RandomState(1), has_gauss=0, gauss=0.5), "gauss 0.0"),
    "legacy_has_gauss_5": (lambda: _set_state(np.random.RandomState(1), has_gauss=5, gauss=0.5), "has_gauss"),
    "random_gauss_next_int": (lambda: _random_with_gauss(5), "gauss_next"),
    "seed_seq_pool_2000": (lambda: np.random.PCG64(np.random.SeedSequence(1, pool_size=2000)), "pool_size"),
    "seed_seq_empty_entropy": (lambda: np.random.SFC64(np.random.SeedSequence([])), "entropy"),
    "rngstate_wrong_shape": (lambda: dataclasses.replace(tensorcanon.RngState.capture(), python=(3, (1, 2), None)),
                             "python must be random.getstate"),
    "rngstate_cuda_list": (lambda: dataclasses.replace(tensorcanon.RngState.capture(), cuda=[bytes(16)]), "tuples"),
}


@pytest.mark.parametrize("name", sorted(HAND_SET_STATES))
def test_writers_refuse_random_states_that_readers_reject(name):
    build, match = HAND_SET_STATES[name]
    with pytest.raises(tensorcanon.UnsupportedTypeError, match=match):
        tensorcanon.dumps({"v": build()})


@pytest.mark.parametrize("name", ["seed_seq_children_2_32", "seed_seq_pool_1025", "seed_seq_empty_entropy",
                                  "bitgen_has_uint32_7", "legacy_gauss_without_flag", "random_gauss_next_int"])
def test_random_state_files_that_break_a_rule_are_a_format_error(name):
    """Including a seed sequence with counters numpy cannot hold (an OverflowError before)."""
    match = corpus.NEW_INVALID[name][4]
    for read in (tensorcanon.loads, tensorcanon.verify):
        with pytest.raises(FormatError, match=match):
            read(_new_invalid(name))


def test_generator_device_text():
    for name in ("generator_cpu_with_index", "generator_mps_index_1"):
        with pytest.raises(FormatError, match="not canonical"):
            tensorcanon.verify(_new_invalid(name))
    for name in ("mps_generator", "mps0_generator"):  # valid: which one torch prints depends on its version
        data = corpus.NEW_VALID[name][0]()
        assert tensorcanon.verify(data).startswith("xxh3-128:")
    assert h.manifest_of(tensorcanon.dumps(torch.Generator(device="cpu:0")))[0]["root"][1] == "cpu"


def test_negative_philox_offsets_are_valid():
    state = corpus._rngstate_cuda(-4)  # offset 2**64 - 4 as torch counts it
    back = tensorcanon.loads(tensorcanon.dumps({"v": state}))["v"]
    assert back == state and struct.unpack("<q", back.cuda[0][8:])[0] == -4
    with pytest.raises(tensorcanon.UnsupportedTypeError, match="multiple of 4"):
        tensorcanon.dumps(corpus._rngstate_cuda(-2))
    with pytest.raises(FormatError, match="multiple of 4"):
        tensorcanon.loads(_new_invalid("philox_offset_not_multiple_of_4"))


@pytest.mark.parametrize("name", ["settings_precision_ieee", "settings_num_threads_str", "settings_sm_counts_length"])
def test_determinism_settings_reader_rejects_bad_fields(name):
    with pytest.raises(FormatError, match=corpus.NEW_INVALID[name][4]):
        tensorcanon.loads(_new_invalid(name))
    # the format specifies this state (§6.7.2): a verifying reader checks it too (§6.6), so that a file
    # that verifies loads
    with pytest.raises(FormatError, match=corpus.NEW_INVALID[name][4]):
        tensorcanon.verify(_new_invalid(name))


def test_builtin_codec_states_a_reader_rejects_are_refused_by_the_writer():
    tensorcanon.register_builtin_codecs()
    odd = argparse.Namespace(a=1)
    odd.__dict__[0] = 2  # a key setattr cannot make
    for value, match in [(pathlib.PurePosixPath("a\x00b"), "U\\+0000"), (pathlib.PureWindowsPath("a\x00b"), "U\\+0000"),
                         (odd, "str keys")]:
        with pytest.raises(tensorcanon.UnsupportedTypeError, match=match):
            tensorcanon.dumps({"v": value})
    for name in ("path_with_nul", "namespace_int_key"):
        with pytest.raises(FormatError, match=corpus.NEW_INVALID[name][4].replace("+", "\\+")):
            tensorcanon.loads(_new_invalid(name))
