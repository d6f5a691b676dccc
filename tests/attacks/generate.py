"""Regenerate the hostile-file corpus in this folder: ``python tests/attacks/generate.py``.

Each attack is one file ``<name>.bin`` plus a row in ``expected.json`` giving
the exception class it must raise and a fragment of its message.
tests/test_hostile.py loads every file listed there. The files are committed
so the corpus stays fixed even if this script's helpers change; rerun it only
to add attacks (the output is deterministic), as
``python tests/attacks/generate.py --missing``: that writes the files of new
attacks only and rewrites ``expected.json``, leaving every committed file as it
is. Without ``--missing`` it rewrites every file in the current format version
(only for an attack that itself changed). Keep each file under about 1.5 MB.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "fuzz"))

import torch

import tensorcanon

import hostile_lib as h

TB = 1 << 40


def _valid() -> bytes:
    return tensorcanon.dumps({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "step": 3})


def _plain(entries: dict, body: bytes) -> bytes:
    return h.with_header(entries, body)


def _manifest_attack(root) -> bytes:
    return h.rerooted(_valid(), root)


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def attacks() -> dict[str, tuple[bytes, str, str]]:
    valid = _valid()
    (n,) = struct.unpack("<Q", valid[:8])
    out = {
        "empty": (b"", "FormatError", "file ends inside the header length"),
        "truncated_length": (valid[:5], "FormatError", "file ends inside the header length"),
        "truncated_header": (valid[: 8 + n // 2], "FormatError", "truncated"),
        "truncated_data": (valid[:-3], "FormatError", "truncated"),
        "trailing_bytes": (valid + b"\0", "FormatError", "trailing bytes"),
        "header_length_huge": (struct.pack("<Q", 2**64 - 1) + valid[8:], "LimitError", "max_header_bytes"),
        "header_length_lies": (struct.pack("<Q", n + 8) + valid[8:], "FormatError", "header"),
        "header_length_tiny": (struct.pack("<Q", 1) + valid[8:], "FormatError", "too small"),
        "header_not_json": (h.with_header_text(b"{nope}  ", b""), "FormatError", "not valid JSON"),
        "header_bad_utf8": (h.with_header_text(b'{"\xff":1}', b""), "FormatError", "not valid UTF-8"),
        "header_deep_json": (h.with_header_text(b"{\"a\":" + b"[" * 100_000 + b"]" * 100_000 + b"}" + b" " * 2, b""),
                             "FormatError", "header"),
        "header_duplicate_key": (h.with_header_text(b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
                                                    b'"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}  ', b"\0"),
                                 "FormatError", "appears twice"),
        "header_nan": (h.with_header_text(b'{"a":NaN}', b""), "FormatError", "not valid JSON"),
        "tensor_1tb": (_plain({"big": {"dtype": "U8", "shape": [TB], "data_offsets": [0, TB]}}, b"\0" * 8),
                       "FormatError", "truncated"),
        "tensor_1tb_shape_product": (_plain({"big": {"dtype": "F64", "shape": [2**31, 2**31, 2**31],
                                                     "data_offsets": [0, 8]}}, b"\0" * 8),
                                     "FormatError", "data_offsets span"),
        "offsets_overlap": (_plain({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                                    "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}}, b"\0" * 6),
                            "FormatError", "overlaps"),
        "offsets_gap": (_plain({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                                "b": {"dtype": "U8", "shape": [4], "data_offsets": [6, 10]}}, b"\0" * 10),
                        "FormatError", "gap"),
        "offsets_reversed": (_plain({"a": {"dtype": "U8", "shape": [0], "data_offsets": [4, 0]}}, b""),
                             "FormatError", "before it begins"),
        "dtype_unknown": (_plain({"a": {"dtype": "OBJ", "shape": [1], "data_offsets": [0, 1]}}, b"\0"),
                          "FormatError", "unsupported dtype"),
        "ndim_over_limit": (_plain({"a": {"dtype": "U8", "shape": [1] * 65, "data_offsets": [0, 1]}}, b"\0"),
                            "LimitError", "max_ndim"),
        "negative_dim": (_plain({"a": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 0]}}, b""),
                         "FormatError", "non-negative integer"),
        "bool_byte_2": (_plain({"a": {"dtype": "BOOL", "shape": [1], "data_offsets": [0, 1]}}, b"\2"),
                        "FormatError", "bool"),
        "manifest_deep_tree": (_manifest_attack(_deep(1000)), "LimitError", "max_depth"),
        # found by atheris: naming the damaged tensor walked a 1020-deep tree recursively
        "manifest_deep_tree_damaged_data": (_deep_damaged(), "IntegrityError", "does not match its digest"),
        "manifest_obj_os_system": (_manifest_attack(["obj", "os.system", ["list", "echo pwned"]]),
                                   "UnsupportedTypeError", "never imports"),
        "manifest_unknown_tag": (_manifest_attack(["__reduce__", "os.system", "echo pwned"]),
                                 "FormatError", "unknown tag"),
        "manifest_tensor_out_of_range": (_manifest_attack(["tensor", 99]), "FormatError", "out of range"),
        "manifest_digest_mismatch": (_wrong_digest(valid), "IntegrityError", "does not match the file digest"),
        "data_bit_flip": (valid[:-1] + bytes([valid[-1] ^ 1]), "IntegrityError", "does not match its digest"),
        "manifest_key_renamed": (valid.replace(b"tensorcanon.manifest", b"tensorcanon.manifesu", 1),
                                 "FormatError", "__metadata__ must hold"),
        "pickle_torch_save": (_torch_save_bytes(), "FormatError", "never unpickles"),
        "pickle_global_reduce": (pickle.dumps(_Evil(), protocol=2), "FormatError", "never unpickles"),
        "pickle_protocol_0": (b"cos\nsystem\n(S'echo pwned'\ntR.", "FormatError", "never unpickles"),
        # numbers of more than 4,300 digits, which Python refuses to convert (ValueError, not ours)
        "metadata_devices_huge_index": (_with_metadata(valid, "tensorcanon.devices", "0" * 5000 + "1:cuda"),
                                        "FormatError", "malformed entry"),
        "metadata_memory_formats_huge_index": (
            _with_metadata(valid, "tensorcanon.memory_formats", "0" * 5000 + "1:channels_last"),
            "FormatError", "malformed entry"),
        "offsets_huge_digits": (_huge_offset(valid), "FormatError", "not valid JSON"),
        # issue 19: decoding linear in the file, whatever the keys' hashes and however many containers.
        # 20,000 keys that all hash to 0 (big ints k * (2**61 - 1)): minutes to build before the bound
        "manifest_hash_flood": (h.colliding_keys(20_000, "dict"), "FormatError", "share one Python hash"),
        "manifest_hash_flood_set": (h.colliding_keys(20_000, "set"), "FormatError", "share one Python hash"),
        "manifest_hash_flood_odict": (h.colliding_keys(20_000, "odict"), "FormatError", "share one Python hash"),
        "manifest_hash_flood_tuple_keys": (h.colliding_keys(20_000, "tuple_keys"), "FormatError",
                                           "share one Python hash"),
        # 100,000 empty maps (a byte each) where no map may be: 80 bytes each once msgpack builds them
        "manifest_empty_maps": (h.empty_maps(100_000), "FormatError", "holds a map"),
        # no elements, but no tensor either: torch's RuntimeError ("numel overflow") came out of loads
        "shape_zero_numel_overflow": (h.with_shape([2**60, 11, 0]), "FormatError", "reach 2^63 or more"),
        # 5,000 empty tensors whose shapes share one Python hash, the last one's digest wrong: every
        # other tensor is hashed first (its (dtype, shape) prefix was cached in a dict: quadratic)
        "table_shapes_colliding": (h.colliding_shapes(5_000, damaged=True), "IntegrityError",
                                   "does not match its digest"),
    }
    return out


def _deep_damaged() -> bytes:
    data = _valid()
    m, header, body = h.manifest_of(data)
    m["root"] = "@ROOT@"  # msgpack's packer refuses this depth: splice raw bytes in
    deep = b"\x92\xa4list" * 1020 + h.repack(["tensor", 0])
    raw = h.repack(m).replace(h.repack("@ROOT@"), deep, 1)
    bad = h.rebuild(data, raw, header, body)
    return bad[:-1] + bytes([bad[-1] ^ 1])


def _wrong_digest(valid: bytes) -> bytes:
    at = valid.index(b"xxh3-128:") + len(b"xxh3-128:")
    digit = b"1" if valid[at : at + 1] != b"1" else b"2"
    return valid[:at] + digit + valid[at + 1 :]


def _with_metadata(valid: bytes, key: str, value: str) -> bytes:
    """``valid`` with ``__metadata__[key] = value`` (its digest and manifest untouched)."""
    header, body = h.split(valid)
    header["__metadata__"][key] = value
    text = json.dumps(header, separators=(",", ":")).encode()
    return h.with_header_text(text + b" " * (-len(text) % 8), body)


def _huge_offset(valid: bytes) -> bytes:
    """``valid`` with its first data offset written with 5,000 leading zeros (not JSON)."""
    (n,) = struct.unpack("<Q", valid[:8])
    text = valid[8 : 8 + n].rstrip(b" ").replace(b'"data_offsets":[0,', b'"data_offsets":[' + b"0" * 5000 + b",", 1)
    return h.with_header_text(text + b" " * (-len(text) % 8), valid[8 + n :])


def _deep(depth: int):
    node = 1
    for _ in range(depth):
        node = ["list", node]
    return node


def _torch_save_bytes() -> bytes:
    import io

    buf = io.BytesIO()
    torch.save({"w": torch.ones(2)}, buf)
    return buf.getvalue()


def main(missing_only: bool = False) -> None:
    expected = {}
    written = 0
    for name, (data, cls, fragment) in sorted(attacks().items()):
        path = os.path.join(HERE, f"{name}.bin")
        if not (missing_only and os.path.exists(path)):
            with open(path, "wb") as f:
                f.write(data)
            written += 1
        expected[name] = {"raises": cls, "message": fragment}
    with open(os.path.join(HERE, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"wrote {written} of {len(expected)} attacks to {HERE}")


if __name__ == "__main__":
    main(missing_only="--missing" in sys.argv[1:])
