"""Fuzz the loader with mutated valid files (issue 6, part 1).

Every case goes through ``hostile_lib.check``: only tensorcanon exceptions, a
deadline per case, and any accepted file must re-save to the very same bytes
(so nothing partial or altered is ever returned), and every mutation that must be
refused is refused with the error its class calls for. CI runs > 10,000 cases,
derandomized so a failure reproduces; set TENSORCANON_FUZZ_CASES=<n> to scale
every test to about n cases in total for a longer campaign.
"""

from __future__ import annotations

import os
import struct

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import tensorcanon

import hostile_lib as h

FILES = h.sample_files()
_TOTAL = int(os.environ.get("TENSORCANON_FUZZ_CASES", "0") or 0)
_DEFAULT_TOTAL = 10_000


def cases(n: int) -> settings:
    """Hypothesis settings for a test worth ``n`` of the default 10,000-case budget."""
    if _TOTAL:
        n = max(1, n * _TOTAL // _DEFAULT_TOTAL)
    return settings(
        max_examples=n, derandomize=not _TOTAL, deadline=None, database=None,
        suppress_health_check=list(HealthCheck), print_blob=True,
    )


file_index = st.integers(0, len(FILES) - 1)

# What a damaged file may be refused with: malformed bytes, a limit hit, or bytes that do not
# hash to their digest. Never another exception, never an UnsupportedTypeError (a file with a
# flipped bit names no type), never "ok" where the mutation must be refused.
DAMAGE = {"FormatError", "LimitError", "IntegrityError"}

# ----------------------------------------------------------------- raw bytes


@cases(2500)
@given(file_index, st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 7)), min_size=1, max_size=4))
def test_bit_flips(i, flips):
    data = bytearray(FILES[i])
    for pos, bit in flips:
        data[pos % len(data)] ^= 1 << bit
    outcome = h.check(bytes(data))
    if len(flips) == 1:
        # One flipped bit is always caught. Several may, with luck, turn the file into
        # another well-formed one (both "tensorcanon.*" keys renamed: a plain safetensors
        # file); check() has then already verified that what loaded is complete.
        assert outcome in DAMAGE, outcome


def test_truncation_at_every_byte():
    """Exhaustive: every prefix of every sample file, structural boundaries included."""
    n = 0
    for data in FILES:
        assert set(h.boundaries(data)) <= set(range(len(data) + 1))
        for cut in range(len(data)):
            assert h.check(data[:cut], stream=cut in h.boundaries(data)) == "FormatError"
            n += 1
    assert n > 3000


@cases(800)
@given(file_index, st.one_of(st.integers(0, 64), st.integers(0, 2**64 - 1), st.integers(-64, 64)))
def test_lying_header_length(i, value):
    data = FILES[i]
    (n,) = struct.unpack("<Q", data[:8])
    length = value if value >= 0 else n + value
    if not 0 <= length < 2**64:
        return
    mutated = struct.pack("<Q", length) + data[8:]
    outcome = h.check(mutated)
    assert outcome == "ok" if mutated == data else outcome in {"FormatError", "LimitError"}, outcome


@cases(600)
@given(file_index, st.binary(min_size=1, max_size=64), st.integers(0, 1 << 20))
def test_inserted_and_overwritten_bytes(i, junk, pos):
    data = FILES[i]
    pos %= len(data) + 1
    for mutated in (data[:pos] + junk + data[pos:], data[:pos] + junk + data[pos + len(junk):]):
        outcome = h.check(mutated)
        assert outcome == "ok" if mutated == data else outcome in DAMAGE, outcome


@cases(400)
@given(st.binary(max_size=200))
def test_arbitrary_bytes(data):
    # no refusal to assert: a few random bytes can be a valid (empty) safetensors file; check()
    # asserts that only tensorcanon errors come out, and that whatever loads re-saves exactly
    assert h.check(data) in DAMAGE | {"ok"}


# ----------------------------------------------------------------- header JSON

entry_mutation = st.sampled_from([
    "huge_shape", "neg_dim", "float_dim", "bad_dtype", "wrong_dtype", "overlap", "gap",
    "swap_offsets", "huge_offsets", "ndim", "drop_entry", "extra_key", "str_offsets", "zero_numel_overflow",
])

# Shapes without elements whose non-zero dimensions times any element size reach 2**63 (§5.3)
OVERFLOWING_SHAPES = [[2**60, 11, 0], [2**62, 4, 0], [0, 2**63], [2**64 - 1, 0], [3, 0, 2**62], [2**32, 2**31, 0, 2]]


def _mutate_entry(header: dict, body: bytes, name: str, how: str, k: int):
    e = header[name]
    b, end = e["data_offsets"]
    if how == "huge_shape":
        e["shape"] = [2**40, 2**20]  # a 1 TB-ish claim
        e["data_offsets"] = [b, b + 2**60]
    elif how == "neg_dim":
        e["shape"] = [-1] + e["shape"]
    elif how == "float_dim":
        e["shape"] = [1.0] + e["shape"]
    elif how == "bad_dtype":
        e["dtype"] = ["F32", "obj", "", "f32", "Q8", 7][k % 6]
    elif how == "wrong_dtype":
        e["dtype"] = ["F16", "I64", "U8", "BOOL", "F64", "C64"][k % 6]
    elif how == "overlap":
        e["data_offsets"] = [max(0, b - 1 - k % 4), end - 1 - k % 4]
    elif how == "gap":
        e["data_offsets"] = [b + 1 + k % 4, end + 1 + k % 4]
    elif how == "swap_offsets":
        e["data_offsets"] = [end, b]
    elif how == "huge_offsets":
        e["data_offsets"] = [2**64 - 8, 2**64 + k]
    elif how == "ndim":
        e["shape"] = [1] * (65 + k % 100)
    elif how == "drop_entry":
        del header[name]
    elif how == "extra_key":
        e["extra"] = k
    elif how == "str_offsets":
        e["data_offsets"] = [str(b), str(end)]
    elif how == "zero_numel_overflow":  # no bytes, and no tensor either
        e["shape"] = OVERFLOWING_SHAPES[k % len(OVERFLOWING_SHAPES)]
        e["data_offsets"] = [b, b]
    return header, body


# Mutations after which a plain safetensors file (no manifest to contradict) may still be
# well-formed: a dtype of the same size, the only tensor dropped, a zero-size tensor moved.
_PLAIN_MAY_STAY_VALID = {"bad_dtype", "wrong_dtype", "drop_entry", "gap", "swap_offsets"}


@cases(1200)
@given(file_index, entry_mutation, st.integers(0, 1000), st.booleans(), st.booleans())
def test_header_entry_mutations(i, how, k, keep_meta, canonical):
    header, body = h.split(FILES[i])
    if not keep_meta:
        header.pop("__metadata__")  # exercise the plain-safetensors path too
    names = sorted(n for n in header if n != "__metadata__")
    if not names:
        return
    header, body = _mutate_entry(header, body, names[k % len(names)], how, k)
    mutated = h.with_header(header, body, canonical=canonical)
    outcome = h.check(mutated)
    refused = "LimitError" if how == "ndim" else "FormatError"
    if keep_meta:  # the header of a tensorcanon file is canonical and matches its manifest
        assert outcome == ("ok" if mutated == FILES[i] else refused), outcome
    elif how in _PLAIN_MAY_STAY_VALID:
        assert outcome in {"ok", refused}, outcome
    else:
        assert outcome == refused, outcome


@cases(500)
@given(file_index, st.integers(1, 100_000), st.sampled_from(["[", '{"a":']))
def test_deeply_nested_header_json(i, depth, opener):
    _, body = h.split(FILES[i])
    closer = "]" if opener == "[" else "}"
    text = ('{"x":' + opener * depth + "1" + closer * depth + "}").encode()
    assert h.check(h.with_header_text(text + b" " * (-len(text) % 8), body)) == "FormatError"


@cases(500)
@given(file_index, st.sampled_from(["dup_entry", "dup_meta", "dup_field", "bad_utf8", "overlong_utf8",
                                      "surrogate", "nan", "bom", "not_object", "trailing"]), st.integers(0, 99))
def test_header_text_mutations(i, how, k):
    data = FILES[i]
    (n,) = struct.unpack("<Q", data[:8])
    text, body = data[8 : 8 + n].rstrip(b" "), data[8 + n :]
    header, _ = h.split(data)
    name = sorted(x for x in header if x != "__metadata__")[0]
    key = ('"' + name + '":').encode()
    if how == "dup_entry":
        start = text.index(key)
        end = text.index(b"]}", start) + 2
        text = text[:end] + b"," + text[start:end] + text[end:]
    elif how == "dup_meta":
        text = text[:-1] + b',"__metadata__":{}}'
    elif how == "dup_field":
        text = text.replace(b'"dtype":', b'"dtype":"F32","dtype":', 1)
    elif how == "bad_utf8":
        pos = 1 + k % (len(text) - 2)
        text = text[:pos] + b"\xff" + text[pos:]
    elif how == "overlong_utf8":
        text = text.replace(key, b'"\xc0\xaf' + key[1:], 1)
    elif how == "surrogate":
        text = text.replace(key, b'"\\ud800' + key[1:], 1)
    elif how == "nan":
        text = text.replace(b'"shape":[', b'"shape":[NaN,', 1)
    elif how == "bom":
        text = b"\xef\xbb\xbf" + text
    elif how == "not_object":
        text = b"[" + text + b"]"
    elif how == "trailing":
        text = text + b"{}"
    mutated = h.with_header_text(text + b" " * (-len(text) % 8), body)
    assert h.check(mutated) == "FormatError"


# ----------------------------------------------------------------- manifest (digest kept valid)

def _deep(depth: int, tag: str):
    node = 1
    for _ in range(depth):
        node = [tag, node] if tag != "dict" else ["dict", "k", node]
    return node


manifest_mutation = st.sampled_from([
    "deep_list", "deep_dict", "obj_os_system", "obj_registered_looking", "unknown_tag", "bad_tensor_index",
    "dup_tensor_ref", "drop_tensor_ref", "wrong_dtype", "wrong_shape", "huge_shape", "dup_row_name",
    "rename_row", "drop_row", "extra_row", "bad_digest_len", "version", "algorithm", "kind", "requires_grad",
    "unsorted_dict", "odd_dict", "bad_bigint", "unknown_ext", "empty_tag", "set_repeat", "np_scalar",
    "device", "dtype_node", "complex", "size_node", "zero_numel_overflow",
])


def _deep_size(k: int) -> int:
    return 200 + k * 50


def _manifest_refusal(how: str, k: int) -> str:
    """The error a manifest mutation must be refused with (its digest is valid)."""
    if how in ("deep_list", "deep_dict"):  # deeper than max_depth, or unused tensors
        return "LimitError" if _deep_size(k) > tensorcanon.Limits().max_depth else "FormatError"
    if how in ("obj_os_system", "obj_registered_looking"):  # names a type nobody registered
        return "UnsupportedTypeError"
    if how == "bad_digest_len" and k % 40 == 16:  # right size, wrong digest
        return "IntegrityError"
    return "FormatError"


def _mutate_manifest(m: dict, how: str, k: int) -> dict:
    rows = m["tensors"]
    if how == "deep_list":
        m["root"] = _deep(_deep_size(k), "list")
    elif how == "deep_dict":
        m["root"] = _deep(_deep_size(k), "dict")
    elif how == "obj_os_system":
        m["root"] = ["obj", "os.system", ["list", "echo pwned"]]
    elif how == "obj_registered_looking":
        m["root"] = ["obj", ["builtins.eval", "subprocess.Popen", "torch.load", "__main__.Config"][k % 4], ["dict"]]
    elif how == "unknown_tag":
        m["root"] = ["__reduce__", "os", "system"]
    elif how == "bad_tensor_index":
        bad = [len(rows), -1, 2**63, "0", 1.0][k % 5]
        m["root"] = ["list"] + [["tensor", i] for i in range(len(rows))] + [["tensor", bad]]
    elif how == "dup_tensor_ref":
        m["root"] = ["list"] + [["tensor", i] for i in range(len(rows))] * 2
    elif how == "drop_tensor_ref":
        m["root"] = ["list"]
    elif rows and how == "wrong_dtype":
        rows[k % len(rows)]["dtype"] = ["float64", "int8", "bool", "nope", "complex64"][k % 5]
    elif rows and how == "wrong_shape":
        r = rows[k % len(rows)]
        r["shape"] = r["shape"][::-1] + [1] if k % 2 else [x + 1 for x in r["shape"]] or [2]
    elif rows and how == "huge_shape":
        rows[k % len(rows)]["shape"] = [2**40, 2**24]
    elif rows and how == "dup_row_name":
        rows.append(dict(rows[0]))
    elif rows and how == "rename_row":
        rows[k % len(rows)]["name"] = "other"
    elif rows and how == "drop_row":
        rows.pop(k % len(rows))
    elif how == "extra_row":
        rows.append({"digest": bytes(16), "dtype": "float32", "kind": "tensor", "name": "ghost",
                     "requires_grad": False, "shape": [2**38]})
    elif rows and how == "bad_digest_len":
        rows[k % len(rows)]["digest"] = bytes(k % 40)
    elif how == "version":
        m["version"] = [0, 4, "1", 1.0, None, True][k % 6]
    elif how == "algorithm":
        m["algorithm"] = ["md5", "XXH3-128", "", "sha1"][k % 4]
    elif rows and how == "kind":
        rows[k % len(rows)]["kind"] = ["module", "storage", "", None][k % 4]
    elif rows and how == "requires_grad":
        rows[k % len(rows)]["requires_grad"] = [1, 0, None, "yes"][k % 4]
    elif how == "unsorted_dict":
        m["root"] = ["dict", "b", 1, "a", 2]
    elif how == "odd_dict":
        m["root"] = ["dict", "a"]
    elif how == "bad_bigint":
        m["root"] = msgpack.ExtType(1, [b"", b"\x00\x01", b"\x05", b"\xff\xff"][k % 4])
    elif how == "unknown_ext":
        m["root"] = msgpack.ExtType(2 + k % 100, b"\x00")
    elif how == "empty_tag":
        m["root"] = [[], [1], ["", 1]][k % 3]
    elif how == "set_repeat":
        m["root"] = ["set", "a", "a"]
    elif how == "np_scalar":
        m["root"] = ["np.scalar", ["float32", "bool", "object", "int8"][k % 4],
                     [b"\x00", b"\x02", b"", b"\x00" * 9][k % 4]]
    elif how == "device":
        m["root"] = ["device", ["cuda:-1", "CPU", "x" * 1000, "", "cpu:0"][k % 5]]
    elif how == "dtype_node":
        m["root"] = ["dtype", ["Tensor", "float99", "__class__"][k % 3]]
    elif how == "complex":
        m["root"] = ["complex", 1, "2"]
    elif how == "size_node":
        m["root"] = ["size", 1.5]
    elif rows and how == "zero_numel_overflow":  # the row alone (its header member still disagrees)
        rows[k % len(rows)]["shape"] = OVERFLOWING_SHAPES[k % len(OVERFLOWING_SHAPES)]
    return m


@cases(2000)
@given(file_index, manifest_mutation, st.integers(0, 100))
def test_manifest_mutations_with_valid_digest(i, how, k):
    m, header, body = h.manifest_of(FILES[i])
    m = _mutate_manifest(m, how, k)
    try:
        raw = h.repack(m)
    except ValueError:
        assert how in ("deep_list", "deep_dict")  # msgpack's packer stops at 1024 levels
        return
    outcome = h.check(h.rebuild(FILES[i], raw, header, body))
    if raw == h.repack(h.manifest_of(FILES[i])[0]):  # e.g. a dtype replaced by the same one
        assert outcome == "ok"
    else:
        assert outcome == _manifest_refusal(how, k), (how, outcome)


@cases(800)
@given(file_index, st.sampled_from(["dup_map_key", "bad_utf8_str", "float32", "long_int", "trailing",
                                    "truncated", "str8_len", "array_count"]), st.integers(0, 10_000))
def test_manifest_raw_bytes(i, how, k):
    """Non-canonical or malformed msgpack, with a digest that matches it."""
    m, header, body = h.manifest_of(FILES[i])
    raw = h.repack(m)
    if how == "dup_map_key":  # {"algorithm": .., "algorithm": ..}: msgpack maps with a repeated key
        raw = b"\x85\xa9algorithm\xa8xxh3-128" + raw[1:]
    elif how == "bad_utf8_str":
        raw = raw.replace(b"\xa4list", b"\xa4l\xffst", 1).replace(b"\xa4dict", b"\xa4d\xffct", 1)
    elif how == "float32":
        raw = raw + b"\xca\x3f\x80\x00\x00"
    elif how == "long_int":
        v = tensorcanon.FORMAT_VERSION
        raw = raw.replace(b"\xa7version" + bytes([v]), b"\xa7version\xcf" + v.to_bytes(8, "big"), 1)
        assert raw.endswith(b"\xcf" + v.to_bytes(8, "big"))
    elif how == "trailing":
        raw = raw + bytes([k % 256])
    elif how == "truncated":
        raw = raw[: k % len(raw)]
    elif how == "str8_len":  # a string that claims to run past the end
        raw = raw[:-1] + b"\xdb" + (0xFFFFFFF0).to_bytes(4, "big")
    elif how == "array_count":  # an array claiming 4 billion items
        raw = b"\xdd\xff\xff\xff\xff" + raw
    assert h.check(h.rebuild(FILES[i], raw, header, body)) == "FormatError"


def _table_outcome(meta: dict, fn) -> object:
    try:
        m = fn(meta)
    except tensorcanon.TensorCanonError:
        return "refused"
    return (m.raw, m.root, m.meta, m.algorithm, m.version, m.digest,
            [(i.index, i.name, i.dtype, i.shape, i.kind, i.requires_grad, i.digest) for i in m.tensors])


def _full_table(meta: dict):
    from tensorcanon.format import manifest

    decoded = manifest.decode(meta)
    return decoded.manifest(manifest.read_table(decoded.obj["tensors"], decoded.algorithm, tensorcanon.Limits()))


@cases(1200)
@given(file_index, manifest_mutation, st.integers(0, 100),
       st.sampled_from([None, "dup_map_key", "float32", "long_int", "trailing", "truncated", "str8_len",
                        "array_count", "fixarray16", "row_map16"]))
def test_the_one_pass_manifest_read_accepts_exactly_what_the_full_checks_accept(i, how, k, raw_how):
    """manifest.read (the fast path of every load) decodes the table a batch of rows at a time and
    checks canonical form piece by piece; it must accept and refuse exactly as decode + read_table."""
    from tensorcanon.format import manifest

    m, header, _ = h.manifest_of(FILES[i])
    m = _mutate_manifest(m, how, k)
    try:
        raw = h.repack(m)
    except ValueError:
        return
    if raw_how == "dup_map_key":
        raw = b"\x85\xa9algorithm\xa8xxh3-128" + raw[1:]
    elif raw_how == "float32":
        raw = raw + b"\xca\x3f\x80\x00\x00"
    elif raw_how == "long_int":
        raw = raw[:-1] + b"\xcf" + raw[-1:].rjust(8, b"\x00")
    elif raw_how == "trailing":
        raw = raw + bytes([k % 256])
    elif raw_how == "truncated":
        raw = raw[: k * len(raw) // 101]
    elif raw_how == "str8_len":
        raw = raw[:-1] + b"\xdb" + (0xFFFFFFF0).to_bytes(4, "big")
    elif raw_how == "array_count":
        raw = b"\xdd\xff\xff\xff\xff" + raw
    elif raw_how == "fixarray16" and b"\x92\xa6tensor" in raw:  # a tensor node's array in a longer form
        raw = raw.replace(b"\x92\xa6tensor", b"\xdc\x00\x02\xa6tensor", 1)
    elif raw_how == "row_map16" and b"\x86\xa6digest" in raw:  # a table row's map in a longer form
        raw = raw.replace(b"\x86\xa6digest", b"\xde\x00\x06\xa6digest", 1)
    meta = h.split(h.rebuild(FILES[i], raw, header))[0]["__metadata__"]
    assert _table_outcome(meta, lambda d: manifest.read(d, tensorcanon.Limits())) == _table_outcome(meta, _full_table)


# ----------------------------------------------------------------- tensorcanon.open, tensor by tensor

def _by_key(data: bytes) -> dict:
    """Every tensor of a valid file by path and by stored name, as the whole-file path reads it."""
    import tensorcanon

    with h.as_file(data) as path, tensorcanon.open(path) as f:
        f.check()
        out = {k: f[k] for k in f.keys()}
        out.update({n: f[n] for n in f.names})
    return out


EXPECTED_BY_KEY = [_by_key(data) for data in FILES]


@cases(1000)
@given(file_index, st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 7)), min_size=1, max_size=3),
       st.integers(0, 1 << 20), st.booleans())
def test_lazy_reads_give_the_saved_value_or_nothing(i, flips, cut, truncate):
    """Each tensor tensorcanon.open returns (proven on its own, before the whole file is checked)
    is exactly the saved one, whatever the damage: else a tensorcanon error or a missing key."""
    import tensorcanon
    from tensorcanon.format.errors import TensorCanonError

    data = bytearray(FILES[i])
    for pos, bit in flips:
        data[pos % len(data)] ^= 1 << bit
    if truncate:
        data = data[: cut % len(data)]
    with h.deadline(), h.as_file(bytes(data)) as path:
        try:
            with tensorcanon.open(path) as f:
                if f.digest is None:
                    return  # damage made it a plain safetensors file: nothing recorded to prove values by
                for key, want in EXPECTED_BY_KEY[i].items():
                    try:
                        got = f[key]
                    except (KeyError, TensorCanonError):
                        continue
                    assert h.same(got, want), f"{key}: another value than the one saved"
        except TensorCanonError:
            pass


# ----------------------------------------------------------------- keys that share a hash, empty containers

def _colliding_key(kind: str, k: int):
    """The ``k``-th (k >= 1) key of a family whose keys all share one Python hash."""
    if kind == "int":
        return k * h.P  # hash 0
    if kind == "neg_int":
        return -k * h.P  # hash 0 as well
    if kind == "int_float":  # hash 1: floats 2.0**(61 j) and ints 1 + m P (2**61 and 2.0**61 merge)
        return 2.0 ** (61 * (k // 2 % 17)) if k % 2 else 1 + (k // 2) * h.P
    if kind == "tuple":
        return (k * h.P,)
    if kind == "str_tuple":  # a str in a tuple: still counted (its random hash is shared by all)
        return ("a", k * h.P, 0.5)
    if kind == "frozenset":
        return frozenset({k * h.P, "b"})
    raise AssertionError(kind)


def _empty(kind: str):
    import collections

    return {"list": list, "tuple": tuple, "dict": dict, "odict": collections.OrderedDict, "set": set,
            "frozenset": frozenset}[kind]()


@cases(200)
@given(st.sampled_from(["dict", "odict", "set", "frozenset"]),
       st.sampled_from(["int", "neg_int", "int_float", "tuple", "str_tuple", "frozenset"]),
       st.integers(0, 140), st.integers(0, 70), st.integers(0, 3000),
       st.sampled_from(["list", "tuple", "dict", "odict", "set", "frozenset"]), st.integers(0, 2**16))
def test_colliding_keys_and_empty_containers(tag, kind, n, others, empties, empty_kind, k):
    """A container of keys that share a hash (ints, floats equal to ints, tuples and frozensets of
    them) beside others, and many empty containers: the writer refuses it exactly when more than
    64 keys (not str or bytes) share a hash (docs/FORMAT.md §6.3), and then every reader rejects the
    file a writer without that check would write; whatever the writer accepts, every reader loads."""
    import collections
    from unittest import mock

    from tensorcanon.format import tree
    from tensorcanon.format.errors import UnsupportedTypeError
    from tensorcanon.format.ordering import MAX_SAME_HASH, NO_KEY

    keys = [_colliding_key(kind, j) for j in range(1, n + 1)]
    keys += [j for j in range(others)] + [f"s{j}" for j in range(others)] + [b"b%d" % j for j in range(others // 2)]
    rng = __import__("random").Random(k)
    rng.shuffle(keys)
    if tag in ("set", "frozenset"):
        container = (set if tag == "set" else frozenset)(keys)
    else:
        container = (dict if tag == "dict" else collections.OrderedDict)((key, j) for j, key in enumerate(keys))
    value = {"c": container, "e": [_empty(empty_kind) for _ in range(empties)]}
    counts = collections.Counter(hash(key) for key in container if type(key) not in (str, bytes))
    over = max(counts.values(), default=0) > MAX_SAME_HASH
    if not over:
        data = tensorcanon.dumps(value)
        assert tensorcanon.loads(data) == value
        assert h.check(data, stream=False) == "ok"  # every reader, and saving what loads gives the bytes again
        if empties and empty_kind == "list":  # an empty map where an empty list was: refused as it is read
            m_raw = h.split(data)[0]["__metadata__"]["tensorcanon.manifest"]
            raw = __import__("base64").b64decode(m_raw)
            at = [i for i in range(len(raw)) if raw.startswith(b"\x91\xa4list", i)]
            bad = h.rebuild(data, raw[: at[k % len(at)]] + b"\x80" + raw[at[k % len(at)] + 6 :])
            with h.deadline(), pytest.raises(tensorcanon.FormatError, match="holds a map"):
                tensorcanon.loads(bad)
        return
    with pytest.raises(UnsupportedTypeError, match="share one Python hash"):
        tensorcanon.dumps(value)
    with mock.patch.object(tree, "crowded", lambda keys: NO_KEY):  # a writer without the bound
        data = tensorcanon.dumps(value)
    with h.deadline(), pytest.raises(tensorcanon.FormatError, match="share one Python hash"):
        tensorcanon.loads(data)
    assert h.check(data, stream=False) == "FormatError"
