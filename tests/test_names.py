"""Tensor names follow docs/FORMAT.md §3 exactly, independent of the Python version.

The float layout is checked against an independent implementation of the spec's
rule (shortest round-trip digits found by exact rational arithmetic), the
string and bytes escapes against the spec's character classes, and the table of
examples in FORMAT.md against the library.
"""

from __future__ import annotations

import collections
import math
import pathlib
import random
import struct
from fractions import Fraction

import msgpack
import pytest
import torch

import tensorcanon
from tensorcanon.format import names, paths
from tensorcanon.format.tree import bigint_bytes
from tensorcanon.io import reader

import hostile_lib as h

FORMAT = (pathlib.Path(__file__).parent.parent / "docs" / "FORMAT.md").read_text(encoding="utf-8")
PAYLOAD_NAN = struct.unpack(">d", bytes.fromhex("7ff800000000beef"))[0]

# (key, its text): the table of docs/FORMAT.md §3.2, checked both ways below.
EXAMPLES = [
    ("fc.weight", "fc.weight"),
    (0, "0"),
    (-3, "-3"),
    (2**64 - 1, "18446744073709551615"),
    (2**64, "0x10000000000000000"),
    (-(2**63), "-9223372036854775808"),
    (-(2**63) - 1, "-0x8000000000000001"),
    (1.5, "1.5"),
    (-0.0, "-0.0"),
    (1e16, "1e+16"),
    (1e15, "1000000000000000.0"),
    (0.0001, "0.0001"),
    (1e-05, "1e-05"),
    (5e-324, "5e-324"),
    (math.inf, "inf"),
    (-math.inf, "-inf"),
    (math.nan, "nan:7ff8000000000000"),
    (PAYLOAD_NAN, "nan:7ff800000000beef"),
    (None, "None"),
    (True, "True"),
    (b"k\x00'", "b\"k\\x00'\""),
    (b"\xff\\", "b'\\xff\\\\'"),
    (("a", 1), "('a', 1)"),
    ((1,), "(1,)"),
    ((), "()"),
    (("it's",), "(\"it's\",)"),
    (("\t\x1b\x85é\U0001fae8",), "('\\t\\x1b\\x85é\U0001fae8',)"),
    (frozenset({2, "b", (1,)}), "frozenset({2, 'b', (1,)})"),
    (frozenset(), "frozenset()"),
]


# Not in the spec's table (the characters are invisible there): U+00A0 and U+2028, which repr()
# escapes, are written as themselves.
INVISIBLE = [(("\xa0\u2028",), "('\xa0\u2028',)")]


@pytest.mark.parametrize("key, text", EXAMPLES + INVISIBLE, ids=[t for _, t in EXAMPLES + INVISIBLE])
def test_examples(key, text):
    assert names.key_text(key) == text


def test_the_spec_table_lists_the_same_examples():
    for _, text in EXAMPLES:
        cell = "`` " + text + " ``" if "`" in text else "`" + text + "`"
        assert cell in FORMAT, f"docs/FORMAT.md §3.2 lacks the example {cell}"


# ------------------------------------------------------------------ floats, by the spec's rule


def _shortest_digits(x: float) -> tuple[str, int]:
    """(digits, decpt) with |x| = 0.digits * 10**decpt: the fewest significant digits whose
    decimal rounds (to nearest, ties to even) back to x, and of those the nearest to x."""
    exact = Fraction(abs(x))
    for n in range(1, 18):
        # every n-digit decimal near x: the nearest one and its neighbours
        e = math.floor(math.log10(abs(x))) - n + 1
        scale = Fraction(10) ** e
        center = round(exact / scale)
        best = None
        for m in (center - 1, center, center + 1):
            if m <= 0:
                continue
            candidate = m * scale
            try:
                back = float(candidate)  # float(Fraction) rounds correctly
            except OverflowError:
                continue
            if back == abs(x):
                if best is None or abs(candidate - exact) < abs(best[1] - exact):
                    best = (m, candidate)
        if best is not None:
            digits = str(best[0]).rstrip("0")
            decpt = len(str(best[0])) + e
            return digits, decpt
    raise AssertionError(x)


def spec_float_text(x: float) -> str:
    """docs/FORMAT.md §3.2, "float", written from the text alone."""
    if x != x:
        return "nan:" + struct.pack(">d", x).hex()
    sign = "-" if math.copysign(1.0, x) < 0 else ""
    if math.isinf(x):
        return sign + "inf"
    if x == 0:
        return sign + "0.0"
    digits, decpt = _shortest_digits(x)
    n = len(digits)
    if -4 < decpt <= 16:
        if decpt <= 0:
            body = "0." + "0" * -decpt + digits
        elif decpt >= n:
            body = digits + "0" * (decpt - n) + ".0"
        else:
            body = digits[:decpt] + "." + digits[decpt:]
    else:
        mantissa = digits[0] + ("." + digits[1:] if n > 1 else "")
        exp = decpt - 1
        body = f"{mantissa}e{'-' if exp < 0 else '+'}{abs(exp):02d}"
    return sign + body


def _floats():
    rng = random.Random(20261122)
    special = [0.1, 0.2, 0.3, 1 / 3, 2 / 3, 100.0, 123456789.0, 1e22, 1e23, 2.0**53, 2.0**53 + 2,
               9007199254740993.0, 1.7976931348623157e308, 2.2250738585072014e-308, 5e-324,
               2.2250738585072009e-308, 0.5, 1e-4, 9.999999999999999e-5, 1e16, 9999999999999998.0,
               123e-20, 4.35, 2.0**-1074 * 3]
    powers = [10.0**k for k in range(-20, 23)] + [2.0**k for k in range(-60, 70, 7)]
    bits = [struct.unpack("<d", rng.getrandbits(64).to_bytes(8, "little"))[0] for _ in range(3000)]
    values = special + powers + bits
    return [v for v in values + [-v for v in values] if math.isfinite(v)]


def test_float_text_is_the_spec_rule():
    for x in _floats():
        assert names.float_text(x) == spec_float_text(x), x


def test_nan_text_keeps_the_payload_and_the_sign():
    neg = struct.unpack(">d", bytes.fromhex("fff8000000000001"))[0]
    assert names.float_text(neg) == "nan:fff8000000000001"
    assert names.float_text(PAYLOAD_NAN) != names.float_text(math.nan)


# ------------------------------------------------------------------ str and bytes


def test_quoted_escapes_exactly_the_fixed_set():
    """Only backslash, the quote, and C0/DEL/C1 controls are escaped, whatever Unicode says."""
    for cp in range(0x110000):
        if 0xD800 <= cp <= 0xDFFF:
            continue
        ch = chr(cp)
        text = names.quoted(ch)
        if ch == "'":
            assert text == '"\'"'
        elif ch == "\\":
            assert text == "'\\\\'"
        elif ch in "\t\n\r":
            assert text == "'\\" + "tnr"["\t\n\r".index(ch)] + "'"
        elif cp < 0x20 or 0x7F <= cp <= 0x9F:
            assert text == f"'\\x{cp:02x}'"
        else:
            assert text == f"'{ch}'", hex(cp)


def test_quote_choice():
    assert names.quoted("a'b") == '"a\'b"'
    assert names.quoted("a\"b") == "'a\"b'"
    assert names.quoted("a'\"b") == "'a\\'\"b'"


def test_the_issue_example_no_longer_depends_on_the_unicode_database():
    # U+1FAE8 is unassigned in Python 3.11's Unicode 14 and assigned in 3.12's Unicode 15:
    # repr() escapes it on one and not the other; the name grammar writes it as itself.
    obj = {("\U0001fae8",): torch.zeros(1)}
    with reader.open_file(tensorcanon.dumps(obj)) as cf:
        assert cf.rows[0].name == "('\U0001fae8',)"


def test_bytes_text_is_pythons_bytes_repr():
    """bytes repr never consults Unicode, so the grammar keeps it; checked for every byte."""
    for b in range(256):
        for s in (bytes([b]), bytes([b, 0x27]), bytes([0x22, b, 0x27])):
            assert names.bytes_text(s) == repr(s), s


# ------------------------------------------------------------------ ints of any size

HUGE = 10**5000 + 7  # more digits than Python converts to decimal


def test_int_text_switches_to_hex_outside_msgpack_ints():
    assert names.int_text(2**64 - 1) == "18446744073709551615"
    assert names.int_text(2**64) == "0x10000000000000000"
    assert names.int_text(-(2**63) - 1) == "-0x8000000000000001"
    assert names.int_text(HUGE) == "0x" + format(HUGE, "x")


def test_int_keys_and_values_of_any_size_save_and_load():
    obj = {HUGE: torch.arange(3.0), "v": -HUGE, "t": (HUGE, [HUGE])}
    data = tensorcanon.dumps(obj)
    back = tensorcanon.loads(data)
    assert back["v"] == -HUGE and back["t"] == (HUGE, [HUGE])
    assert torch.equal(back[HUGE], obj[HUGE])
    with reader.open_file(data) as cf:
        assert cf.rows[0].name == names.int_text(HUGE)
    with tensorcanon.open(data) as f:
        assert torch.equal(f[paths.join((HUGE,))], obj[HUGE])


def test_error_messages_do_not_fail_on_huge_ints():
    data = tensorcanon.dumps({"a": torch.zeros(1)})

    ext = msgpack.ExtType(1, bigint_bytes(HUGE))
    cases = [  # a huge int where a small one or a name belongs: each a FormatError saying what
        (["dict", "a", ["tensor", ext]], "tensor index"),
        (["dict", "a", ["tensor", 0], "b", ["odict", None, ext, 1, ext, 2]], "OrderedDict key 0x"),
        (["dict", "a", ["tensor", 0], "b", ["dtype", ext]], "unknown torch dtype"),
        (["dict", "a", ["tensor", 0], "b", ["np.scalar", ext, b"\x00"]], "numpy scalar of dtype"),
        (["dict", "a", ["tensor", 0], "b", ["size", ext]], "'size' takes ints"),
    ]
    for root, match in cases:
        with pytest.raises(tensorcanon.FormatError, match=match):
            tensorcanon.loads(h.rerooted(data, root))
    m, _, _ = h.manifest_of(data)
    m["version"] = ext
    with pytest.raises(tensorcanon.FormatError, match="format version"):
        tensorcanon.loads(h.rebuild(data, h.repack(m)))
    # a damaged tensor under a huge key is named by its path
    good = tensorcanon.dumps({HUGE: torch.zeros(2)})
    bad = bytearray(good)
    bad[-1] ^= 1
    with pytest.raises(tensorcanon.IntegrityError, match=r"tensor \$\[0x"):
        tensorcanon.loads(bytes(bad))


def test_paths_render_every_key_type():
    assert paths.join(("a", 3, (1, "x"), b"k", 1.5, None, HUGE)) == (
        f'$["a"][3][(1, \'x\')][b\'k\'][1.5][None][0x{HUGE:x}]')
    assert paths.show(HUGE).startswith("0x") and "bits" in paths.show(HUGE)


# ------------------------------------------------------------------ the version-1 rule


V1 = pathlib.Path(__file__).parent / "golden" / "v1"


def test_a_v1_file_is_checked_by_the_v1_rule_and_a_v2_file_by_the_v2_rule():
    v1 = (V1 / "names.safetensors").read_bytes()
    tensorcanon.verify(v1)  # its repr()-made names are canonical for version 1
    # ... and a v1 file carrying the version-2 name is not
    with pytest.raises(tensorcanon.FormatError, match="canonical name is 'nan'"):
        tensorcanon.loads(h.renamed(v1, "nan", "nan:7ff8000000000000"))
    v2 = tensorcanon.dumps(tensorcanon.loads(v1))
    with pytest.raises(tensorcanon.FormatError, match="canonical name is 'nan:7ff8000000000000'"):
        tensorcanon.loads(h.renamed(v2, "nan:7ff8000000000000", "nan"))


def test_a_v1_file_cannot_name_a_tensor_below_an_int_beyond_pythons_limit():
    v2 = tensorcanon.dumps({HUGE: torch.zeros(1)})
    m, header, body = h.manifest_of(v2)
    m["version"] = 1
    bad = h.rebuild(v2, h.repack(m), header=header, body=body)
    with pytest.raises(tensorcanon.FormatError, match="version-1 writer could not"):
        tensorcanon.loads(bad)


def test_names_of_ordinary_checkpoints_are_the_keys():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(3, 2)).sum().backward()
    opt.step()
    obj = {"model": model.state_dict(), "opt": opt.state_dict()}
    with reader.open_file(tensorcanon.dumps(obj)) as cf:
        got = {r.name for r in cf.rows}
    want = {f"model.{k}" for k in obj["model"]} | {
        f"opt.state.{i}.{k}" for i, s in obj["opt"]["state"].items() for k in s}
    assert got == want
    od = collections.OrderedDict([("w", torch.zeros(1))])
    with reader.open_file(tensorcanon.dumps(od)) as cf:
        assert [r.name for r in cf.rows] == ["w"]
