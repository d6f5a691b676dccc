"""Build the conformance corpus in this folder: ``python tests/conformance/build_corpus.py``.

Writes ``valid/`` (the golden vectors of tests/golden, versions 3, 2 and 1, and a few files for
rules settled in issue 20), ``invalid/`` (the hostile files of tests/attacks and one file per rule
settled in issue 20) and ``manifest.json``, which gives each file's expected outcome (README.md).
The output is deterministic: running it twice gives the same bytes. tests/test_conformance_corpus.py
checks that the committed corpus is what this script builds and that tensorcanon passes it.

Run it from a checkout (it reads tests/golden and tests/attacks, and crafts files with
tests/fuzz/hostile_lib.py).
"""

from __future__ import annotations

import collections
import hashlib
import json
import pathlib
import struct
import sys
from collections.abc import Callable

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
GOLDEN = ROOT / "tests" / "golden"
ATTACKS = ROOT / "tests" / "attacks"
sys.path.insert(0, str(ROOT / "tests" / "fuzz"))

import numpy as np
import torch

import tensorcanon

import hostile_lib as h

CORPUS_VERSION = 1

CATEGORIES = {
    "format": "the file is not one a conforming writer produces (tensorcanon: FormatError)",
    "limit": "the file declares more than the reader's limits allow, §9.4 (tensorcanon: LimitError, a FormatError)",
    "integrity": "a digest does not match, §9.2 item 5 and §9.3 item 1 (tensorcanon: IntegrityError)",
    "unsupported": "a valid file this reader cannot build: an unregistered type, a dtype or device it lacks "
                   "(tensorcanon: UnsupportedTypeError, DeviceUnavailableError)",
}

# The section and the requirement (an id of tests/golden/conformance.json) each hostile file of
# tests/attacks breaks. An attack added there without a row here is left out of the corpus.
ATTACK_RULES = {
    "bool_byte_2": ("9.3", "bool-bytes"),
    "data_bit_flip": ("9.3", "hash-and-name"),
    "dtype_unknown": ("9.1", "header-checks"),
    "empty": ("9.1", "header-checks"),
    "header_bad_utf8": ("9.1", "header-checks"),
    "header_deep_json": ("9.1", "header-checks"),
    "header_duplicate_key": ("9.1", "header-checks"),
    "header_length_huge": ("9.4", "limits"),
    "header_length_lies": ("9.1", "header-checks"),
    "header_length_tiny": ("9.1", "header-checks"),
    "header_nan": ("9.1", "header-checks"),
    "header_not_json": ("9.1", "header-checks"),
    "manifest_deep_tree": ("9.4", "limits"),
    "manifest_deep_tree_damaged_data": ("9.3", "hash-and-name"),
    "manifest_digest_mismatch": ("9.2", "manifest-checks"),
    "manifest_empty_maps": ("5.1", "msgpack-profile"),
    "manifest_hash_flood": ("6.3", "hash-bound-reader"),
    "manifest_hash_flood_odict": ("6.3", "hash-bound-reader"),
    "manifest_hash_flood_set": ("6.3", "hash-bound-reader"),
    "manifest_hash_flood_tuple_keys": ("6.3", "hash-bound-reader"),
    "manifest_key_renamed": ("2.4", "metadata-exact-members"),
    "manifest_obj_os_system": ("6.6", "no-name-resolution"),
    "manifest_tensor_out_of_range": ("6.2", "tags-arity-args"),
    "manifest_unknown_tag": ("6.2", "tags-arity-args"),
    "metadata_devices_huge_index": ("5.5", "devices-reader"),
    "metadata_memory_formats_huge_index": ("5.6", "memory-formats-reader"),
    "ndim_over_limit": ("9.4", "limits"),
    "negative_dim": ("9.1", "header-checks"),
    "offsets_gap": ("9.1", "header-checks"),
    "offsets_huge_digits": ("9.1", "header-checks"),
    "offsets_overlap": ("9.1", "header-checks"),
    "offsets_reversed": ("9.1", "header-checks"),
    "pickle_global_reduce": ("9.1", "header-checks"),
    "pickle_protocol_0": ("9.1", "header-checks"),
    "pickle_torch_save": ("9.1", "header-checks"),
    "shape_zero_numel_overflow": ("5.3", "shape-size-reader"),
    "table_shapes_colliding": ("9.3", "hash-and-name"),
    "tensor_1tb": ("9.1", "header-checks"),
    "tensor_1tb_shape_product": ("9.1", "header-checks"),
    "trailing_bytes": ("9.1", "header-checks"),
    "truncated_data": ("9.1", "header-checks"),
    "truncated_header": ("9.1", "header-checks"),
    "truncated_length": ("9.1", "header-checks"),
}

ERROR_CATEGORY = {"FormatError": "format", "LimitError": "limit", "IntegrityError": "integrity",
                  "UnsupportedTypeError": "unsupported", "DeviceUnavailableError": "unsupported"}

# Valid files that a conforming reader may still fail to build, and why (category -> reason).
MAY_REJECT = {
    "dtypes_u8": {"unsupported": "a reader whose torch lacks a dtype of §4.1 fails naming it (§4.5)"},
    "registered": {"unsupported": "a reader that did not register golden.GoldenConfig (§6.6)"},
    "enum_keys": {"unsupported": "a reader that did not register golden.Split (§6.6)"},
    "builtin_codecs": {"unsupported": "a reader that did not enable the built-in codecs (§6.9)"},
    "ecosystem": {"unsupported": "a reader that has not imported transformers, omegaconf and yacs (§6.9.5)"},
    "v2/dtypes_u8": {"unsupported": "a reader whose torch lacks a dtype of §4.1 fails naming it (§4.5)"},
    "v2/registered": {"unsupported": "a reader that did not register golden.GoldenConfig (§6.6)"},
    "v2/enum_keys": {"unsupported": "a reader that did not register golden.Split (§6.6)"},
    "v2/builtin_codecs": {"unsupported": "a reader that did not enable the built-in codecs (§6.9)"},
    "v1/dtypes_u8": {"unsupported": "a reader whose torch lacks a dtype of §4.1 fails naming it (§4.5)"},
    "v1/registered": {"unsupported": "a reader that did not register golden.GoldenConfig (§6.6)"},
    "v1/names": {"format": "a reader not written in Python MAY reject version-1 names below such keys (§3.5)"},
    "mps_generator": {"unsupported": "a reader on a machine without an MPS device cannot build it (§6.7)"},
    "mps0_generator": {"unsupported": "a reader on a machine without an MPS device cannot build it (§6.7)"},
}


# ------------------------------------------------------------------ crafting files


def _nan(bits: int) -> float:
    return struct.unpack(">d", struct.pack(">Q", bits))[0]


def _edit_value(value: object, edit: Callable[[list], object]) -> bytes:
    """The file of ``{"v": value}`` with the node of ``v`` replaced by ``edit(node)`` (a msgpack
    list, changed in place or replaced), its manifest digest recomputed so that only the edit is wrong."""
    data = tensorcanon.dumps({"v": value})
    m, header, body = h.manifest_of(data)
    node = m["root"][2]
    out = edit(node)
    m["root"][2] = node if out is None else out
    return h.rebuild(data, h.repack(m), header, body)


def _with_header_member(value: object, key: str, text: str) -> bytes:
    """The file of ``value`` with ``__metadata__[key] = text`` (the header is outside every digest)."""
    header, body = h.split(tensorcanon.dumps(value))
    header["__metadata__"][key] = text
    return h.with_header(header, body)


def _settings(**change: object) -> tensorcanon.DeterminismSettings:
    fields = dict(deterministic_algorithms=True, deterministic_warn_only=False, cudnn_deterministic=True,
                  cudnn_benchmark=False, cudnn_allow_tf32=True, cuda_matmul_allow_tf32=False,
                  float32_matmul_precision="highest", cublas_workspace_config=":4096:8", pythonhashseed="0",
                  num_threads=4, torch_version="2.13.0", numpy_version="2.4.6", cuda_version="12.8",
                  cudnn_version=91000, machine="x86_64", gpu_names=("NVIDIA H100",), gpu_sm_counts=(132,))
    return tensorcanon.DeterminismSettings(**{**fields, **change})


def _set_field(name: str, value: object) -> Callable[[list], None]:
    """Edit an ``["obj", name, ["dict", k, v, ...]]`` node: the field ``name`` gets ``value``."""
    def edit(node: list) -> None:
        state = node[2]
        state[state.index(name) + 1] = value
    return edit


def _pcg64() -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(7)))


def _seed_seq(index: int, value: object) -> Callable[[list], None]:
    """Edit an ``["rng.numpy", ["rng.bitgen", name, ["tuple", entropy, spawn_key, pool, children], ...]]``."""
    def edit(node: list) -> None:
        node[1][2][1 + index] = value
    return edit


def _generator_state(device: str) -> bytes:
    """A file whose ``rng.torch`` node names ``device`` (with the state of a fresh CPU generator when
    the device is a CPU, else a state of that device type's length)."""
    g = torch.Generator().manual_seed(3)
    sizes = {"cpu": 5056, "mps": 36}

    def edit(node: list) -> None:
        node[1] = device
        if not device.startswith("cpu"):
            node[2] = bytes(sizes[device.split(":")[0]])
    return _edit_value(g, edit)


def _rngstate_cuda(offset: int) -> tensorcanon.RngState:
    r = np.random.RandomState(11).get_state(legacy=False)
    name, fields = tensorcanon.training.rng.bitgen_fields(r)
    return tensorcanon.RngState(
        python=__import__("random").Random(1).getstate(), numpy=(name, fields, 0, 0.0),
        torch_cpu=bytes(torch.Generator().manual_seed(1).get_state().numpy()),
        cuda=(struct.pack("<Qq", 5, offset),))


def _odict_tied_nans(node: list) -> list:
    nan = _nan(0x7FF8000000000000)
    return ["odict", None, nan, 1, nan, 2]


# name -> (builder, section, rule id, tensorcanon error, message fragment, what it shows, when)
# ``when``: "always", or "building" when only a reader that builds values must reject the file.
NEW_INVALID: dict[str, tuple] = {
    "odict_tied_nan_keys": (
        lambda: _edit_value(collections.OrderedDict(a=1, b=2), _odict_tied_nans), "6.3", "odict-tied-keys",
        "FormatError", "repeats", "an OrderedDict whose two keys are NaNs with the same bits", "always"),
    "memory_format_no_elements": (
        lambda: _with_header_member({"t": torch.zeros(0, 3, 2, 2)}, "tensorcanon.memory_formats", "0:channels_last"),
        "5.6", "memory-formats-no-elements", "FormatError", "cannot be channels_last",
        "a memory format recorded for a tensor with no elements", "always"),
    "generator_cpu_with_index": (
        lambda: _generator_state("cpu:0"), "6.7", "rng-torch-device", "FormatError", "not canonical",
        "a torch generator on device text cpu:0 (torch prints cpu)", "always"),
    "generator_mps_index_1": (
        lambda: _generator_state("mps:1"), "6.7", "rng-torch-device", "FormatError", "not canonical",
        "a torch generator on mps:1 (torch has one MPS generator)", "always"),
    "seed_seq_children_2_32": (
        lambda: _edit_value(_pcg64(), _seed_seq(3, 2**32)), "6.7", "rng-fields-checked", "FormatError",
        "n_children_spawned", "a SeedSequence that spawned 2^32 children (numpy holds 32 bits)", "always"),
    "seed_seq_pool_1025": (
        lambda: _edit_value(_pcg64(), _seed_seq(2, 1025)), "6.7", "rng-fields-checked", "FormatError",
        "pool_size", "a SeedSequence pool of 1025 words", "always"),
    "seed_seq_empty_entropy": (
        lambda: _edit_value(_pcg64(), _seed_seq(0, ["tuple"])), "6.7", "rng-fields-checked", "FormatError",
        "entropy", "a SeedSequence with empty entropy", "always"),
    "bitgen_has_uint32_7": (
        lambda: _edit_value(np.random.PCG64(np.random.SeedSequence(7)),
                            lambda node: node.__setitem__(5, 7)), "6.7", "rng-fields-checked", "FormatError",
        "has_uint32", "a bare PCG64 whose has_uint32 is 7", "always"),
    "legacy_gauss_without_flag": (
        lambda: _edit_value(np.random.RandomState(5), lambda node: node.__setitem__(2, 0.5)), "6.7",
        "rng-legacy-gauss", "FormatError", "must have gauss 0.0",
        "a RandomState whose cached Gaussian is 0.5 while has_gauss is 0", "always"),
    "random_gauss_next_int": (
        lambda: _edit_value(__import__("random").Random(3), lambda node: node.__setitem__(4, 5)), "6.7",
        "rng-fields-checked", "FormatError", "gauss_next", "a random.Random whose gauss_next is the int 5",
        "always"),
    "philox_offset_not_multiple_of_4": (
        lambda: _edit_value(_rngstate_cuda(8), lambda node: node[4].__setitem__(1, struct.pack("<Qq", 5, -2))),
        "6.7.1", "philox-offset", "FormatError", "multiple of 4", "a CUDA generator state with offset -2",
        "always"),
    "settings_precision_ieee": (
        lambda: _edit_value(_settings(), _set_field("float32_matmul_precision", "ieee")), "6.7.2",
        "determinism-settings", "FormatError", "float32_matmul_precision",
        "determinism settings whose float32_matmul_precision is 'ieee'", "building"),
    "settings_num_threads_str": (
        lambda: _edit_value(_settings(), _set_field("num_threads", "4")), "6.7.2", "determinism-settings",
        "FormatError", "num_threads", "determinism settings whose num_threads is the str '4'", "building"),
    "settings_sm_counts_length": (
        lambda: _edit_value(_settings(), _set_field("gpu_sm_counts", ["tuple"])), "6.7.2", "determinism-settings",
        "FormatError", "gpu_sm_counts", "determinism settings with one GPU name and no SM count", "building"),
}


def _path_with_nul() -> bytes:
    tensorcanon.register_builtin_codecs()
    import pathlib as p
    return _edit_value(p.PurePosixPath("/data"), lambda node: node[2].__setitem__(2, "/da\x00ta"))


def _namespace_int_key() -> bytes:
    tensorcanon.register_builtin_codecs()
    import argparse
    return _edit_value(argparse.Namespace(a=1), lambda node: node[2].__setitem__(1, 0))


NEW_INVALID.update({
    "path_with_nul": (
        _path_with_nul, "6.9", "builtin-codec-states", "FormatError", "U+0000",
        "a pathlib.PurePath state whose text holds U+0000", "building"),
    "namespace_int_key": (
        _namespace_int_key, "6.9", "builtin-codec-states", "FormatError", "str keys",
        "an argparse.Namespace state with the int key 0", "building"),
})

# issue 30: the standard containers (§6.10)
NEW_INVALID.update({
    "counter_keys_out_of_order": (
        lambda: _edit_value(collections.Counter({"a": 1, "b": 2}), lambda node: ["counter", "b", 2, "a", 1]),
        "6.10.1", "counter-order", "FormatError", "not in canonical order",
        "a Counter whose keys are not in canonical order", "always"),
    "defaultdict_unknown_factory": (
        lambda: _edit_value(collections.defaultdict(list, {"a": 1}), lambda node: node.__setitem__(1, "os.system")),
        "6.10.2", "defaultdict-factory", "FormatError", "not a default factory",
        "a defaultdict whose factory is a name outside the closed list", "always"),
    "deque_over_maxlen": (
        lambda: _edit_value(collections.deque([1, 2], maxlen=2), lambda node: node.__setitem__(1, 1)),
        "6.10.3", "deque-maxlen", "FormatError", "holds 2 items",
        "a deque of maxlen 1 holding 2 items", "always"),
})

# issue 30: numpy strings (§6.11) and the new key kinds (§6.3)
NEW_INVALID.update({
    "np_str_of_bytes": (
        lambda: _edit_value(np.str_("ab"), lambda node: node.__setitem__(1, b"ab")), "6.11", "numpy-str-args",
        "FormatError", "takes a str", "a numpy str_ whose text is a bin", "always"),
    "np_strings_too_long": (
        lambda: _edit_value(np.array(["ab", "c"]), lambda node: node.__setitem__(5, "abc")), "6.11",
        "numpy-strings-reader", "FormatError", "at most 2 characters",
        "a U2 array holding an element of 3 characters", "always"),
    "np_strings_count": (
        lambda: _edit_value(np.array(["ab", "c"]), lambda node: node.__delitem__(-1)), "6.11", "numpy-strings-reader",
        "FormatError", "holds 1 elements", "a U2 array of shape [2] holding one element", "always"),
    "dtype_keys_out_of_order": (
        lambda: _edit_value({torch.float32: 1, torch.int8: 2},
                            lambda node: ["dict", ["dtype", "int8"], 2, ["dtype", "float32"], 1]),
        "6.3", "dict-key-order", "FormatError", "not in canonical order",
        "a dict whose torch.dtype keys are not in name order", "always"),
    "numpy_float_key": (
        lambda: _edit_value({np.int64(1): 1},
                            lambda node: node.__setitem__(1, ["np.scalar", "float32", b"\x00\x00\x80?"])),
        "6.3", "key-types", "FormatError", "is not allowed", "a dict whose key is a numpy float32 scalar",
        "always"),
})


def _tensor_kind_node(parts: dict, node: list) -> bytes:
    """A file whose root is ``node`` (a §6.12 node over tensors 0, 1, ...), its parts saved as an
    OrderedDict in their order: the paths, names, table and digests a writer gives them."""
    data = tensorcanon.dumps(collections.OrderedDict(parts))
    return h.with_manifest(data, lambda m: m.__setitem__("root", node))


def _coo(indices: list, size: int) -> bytes:
    return _tensor_kind_node({"indices": torch.tensor([indices]), "values": torch.ones(len(indices))},
                             ["sparse", "coo", ["size", size], "tensor", False, ["tensor", 0], ["tensor", 1]])


def _attrs_on_later_use() -> bytes:
    t = torch.ones(1)
    t.a = 1
    data = tensorcanon.dumps([t, t])
    return h.with_manifest(data, lambda m: m["root"].__setitem__(2, ["tensor.attrs", ["tensor", 0], ["dict", "a", 1]]))


NEW_INVALID.update({
    "sparse_coo_index_out_of_range": (
        lambda: _coo([0, 5], 2), "6.12.1", "sparse-coo-reader", "FormatError", "out of range",
        "a COO sparse tensor of size (2,) with the index 5", "always"),
    "sparse_coo_uncoalesced": (
        lambda: _coo([1, 0], 2), "6.12.1", "sparse-coo-reader", "FormatError", "coalesced",
        "a COO sparse tensor whose indices are not sorted", "always"),
    "sparse_csr_crow_decreasing": (
        lambda: _tensor_kind_node(
            {"crow_indices": torch.tensor([0, 2, 1]), "col_indices": torch.tensor([0, 1]), "values": torch.ones(2)},
            ["sparse", "csr", ["size", 2, 2], "tensor", False, ["tensor", 0], ["tensor", 1], ["tensor", 2]]),
        "6.12.1", "sparse-compressed-reader", "FormatError", "compressed indices must",
        "a CSR sparse tensor whose compressed indices decrease", "always"),
    "nested_jagged_offsets_decreasing": (
        lambda: _tensor_kind_node({"values": torch.ones(5, 2), "offsets": torch.tensor([0, 3, 2, 5])},
                                  ["nested", "jagged", "float32", False, ["tensor", 0], ["tensor", 1]]),
        "6.12.2", "nested-jagged-reader", "FormatError", "decrease",
        "a jagged nested tensor whose offsets decrease", "always"),
    "tensor_attrs_on_later_use": (
        _attrs_on_later_use, "6.12.4", "tensor-attrs-first-use", "FormatError", "first use",
        "attributes carried by the second use of a tensor", "always"),
    "meta_int_requires_grad": (
        lambda: h.with_manifest(tensorcanon.dumps(torch.empty(2, dtype=torch.int64, device="meta")),
                                lambda m: m["root"].__setitem__(4, True)),
        "6.12", "tensor-kinds-grad-dtype", "FormatError", "requires_grad",
        "an int64 meta tensor with requires_grad", "always"),
})

def _jagged_node(*seqlens: object) -> bytes:
    return _tensor_kind_node({"values": torch.ones(5, 2), "offsets": torch.tensor([0, 2, 5])},
                             ["nested", "jagged", "float32", False, ["tensor", 0], ["tensor", 1], *seqlens])


def _string_array_33_dims(node: list) -> list:
    return ["np.strings", "U", 1, 33, *([1] * 33), "x"]


# issue 37: what a tensor of these kinds holds is kept (§6.12.1, §6.12.2); writers refuse what readers reject (§8)
NEW_INVALID.update({
    "sparse_coo_last_value_true": (
        lambda: _tensor_kind_node({"indices": torch.tensor([[0, 1]]), "values": torch.ones(2)},
                                  ["sparse", "coo", ["size", 2], "tensor", False, ["tensor", 0], ["tensor", 1], True]),
        "6.12.1", "sparse-coo-reader", "FormatError", "must be false",
        "a COO node ending with true (a coalesced one has no last value, an uncoalesced one ends with false)",
        "always"),
    "jagged_seqlens_both_nil": (
        lambda: _jagged_node(None, None), "6.12.2", "nested-jagged-seqlens-reader", "FormatError", "both nil",
        "a jagged node whose two cached lengths are nil (a tensor caching neither is written without them)",
        "always"),
    "jagged_seqlen_negative": (
        lambda: _jagged_node(-1, 3), "6.12.2", "nested-jagged-seqlens-reader", "FormatError",
        "must be nil or an int", "a jagged node caching a min_seqlen of -1", "always"),
    "np_strings_33_dims": (
        lambda: _edit_value(np.array(["x"]).reshape((1,) * 32), _string_array_33_dims), "6.11",
        "numpy-strings-reader", "FormatError", "at most 32", "a numpy string array of 33 dimensions", "always"),
    "meta_size_2_63_bytes": (
        lambda: _edit_value(torch.empty(0, 2, device="meta"), lambda node: node.__setitem__(2, ["size", 0, 2**61])),
        "6.2", "tags-arity-args", "FormatError", "2^63", "a float32 meta tensor of size [0, 2^61]: 2^63 bytes (§5.3, "
        "§6.12)", "always"),
})


def _attrs_every_use() -> bytes:
    noted = torch.eye(3).to_sparse()
    noted.note = "kept"
    plain = torch.sparse_coo_tensor(noted._indices(), noted._values(), (3, 3), is_coalesced=True)
    return tensorcanon.dumps({"v": [plain, noted, noted, plain]})


def _as_version(value: object, version: int, edit: Callable[[list], object] | None = None) -> bytes:
    """The file of ``{"v": value}`` with its manifest's version set to ``version`` (and the node of
    ``v`` replaced by ``edit(node)``), digests recomputed: only the version (or the edit) is wrong."""
    data = tensorcanon.dumps({"v": value})
    m, header, body = h.manifest_of(data)
    m["version"] = version
    if edit is not None:
        node = m["root"][2]
        out = edit(node)
        m["root"][2] = node if out is None else out
    return h.rebuild(data, h.repack(m), header, body)


def _as_list(node: list) -> list:
    """A packed node written back as the ``list`` node version 2 has (§6.13)."""
    from tensorcanon.format import packed

    return [x if type(x) is not tuple else list(x) for x in packed.expand(node)]


def _as_list_deep(node: list) -> list:
    return ["list", *(_as_list(x) for x in node[1:])]


def _ints(kind: str, data: bytes) -> Callable[[list], list]:
    return lambda node: ["ints", kind, data]


# format version 3: packed lists (§6.13)
NEW_INVALID.update({
    "ints_not_first_type": (
        lambda: _edit_value(list(range(16)), _ints("uint16", b"".join(i.to_bytes(2, "little") for i in range(16)))),
        "6.13.1", "ints-first-type", "FormatError", "comes before uint16",
        "an ints node of type uint16 whose items uint8 holds", "always"),
    "ints_signed_when_unsigned": (
        lambda: _edit_value(list(range(16)), _ints("int8", bytes(range(16)))),
        "6.13.1", "ints-first-type", "FormatError", "comes before int8",
        "an ints node of type int8 whose items are all non-negative (uint8 comes first)", "always"),
    "ints_fifteen_items": (
        lambda: _edit_value(list(range(16)), _ints("uint8", bytes(range(15)))),
        "6.13.1", "ints-data", "FormatError", "fewer than 16",
        "an ints node of 15 items (a list of 15 ints is a list node)", "always"),
    "ints_ragged_data": (
        lambda: _edit_value(list(range(300, 316)), _ints("uint16", bytes(33))),
        "6.13.1", "ints-data", "FormatError", "multiple of 2",
        "an ints node of type uint16 whose data is 33 bytes", "always"),
    "list_not_packed_ints": (
        lambda: _edit_value(list(range(16)), _as_list),
        "6.13", "packed-lists-reader", "FormatError", "is written as a 'ints' node",
        "a version-3 file holding 16 ints as a list node", "always"),
    "list_not_packed_records": (
        lambda: _edit_value([{"a": 1}, {"a": 2}], _as_list),
        "6.13", "packed-lists-reader", "FormatError", "is written as a 'records' node",
        "a version-3 file holding two dicts of str keys and leaf values as a list node", "always"),
    "records_keys_unsorted": (
        lambda: _edit_value([{"a": 1, "b": 2}, {"a": 3, "b": 4}],
                            lambda node: ["records", [["b", "a"]], [0, 2, 1], [0, 4, 3]]),
        "6.13.2", "records-reader", "FormatError", "strictly increasing",
        "a records node whose key list is not in UTF-8 order", "always"),
    "records_first_use_order": (
        lambda: _edit_value([{"a": 1}, {"b": 2}], lambda node: ["records", [["a"], ["b"]], [1, 2], [0, 1]]),
        "6.13.2", "records-reader", "FormatError", "order of first use",
        "a records node whose first row uses key list 1", "always"),
    "records_unused_key_list": (
        lambda: _edit_value([{"a": 1}, {"a": 2}], lambda node: ["records", [["a"], ["b"]], [0, 1], [0, 2]]),
        "6.13.2", "records-reader", "FormatError", "its rows use 1",
        "a records node with a key list no row uses", "always"),
    "records_nested_value": (
        lambda: _edit_value([{"a": 1}, {"a": 2}], lambda node: ["records", [["a"]], [0, ["list", 1]], [0, 2]]),
        "6.13.2", "records-reader", "FormatError", "not a leaf",
        "a records row holding a tagged array", "always"),
    "records_one_row": (
        lambda: _edit_value([{"a": 1}, {"a": 2}], lambda node: ["records", [["a"]], [0, 1]]),
        "6.13.2", "records-reader", "FormatError", "at least 2 rows",
        "a records node of one row (one dict is a list node)", "always"),
    "v2_with_ints": (
        lambda: _as_version(list(range(16)), 2),
        "1.3", "packed-lists-version", "FormatError", "not in format version 2",
        "a version-2 file holding an ints node", "always"),
})

# name -> (builder, what it shows): valid files for rules settled in issue 20
NEW_VALID: dict[str, tuple] = {
    "np_str_trailing_nuls": (lambda: tensorcanon.dumps({"v": [np.str_("a\x00"), np.bytes_(b"\x00")]}),
                             "numpy str_ and bytes_ scalars whose trailing NULs are part of them, §6.11"),
    "philox_negative_offset": (lambda: tensorcanon.dumps({"v": _rngstate_cuda(-4)}),
                               "an RngState whose CUDA Philox offset is -4 (2^64 - 4 as torch counts), §6.7.1"),
    "mps_generator": (lambda: _generator_state("mps"), "a torch generator on device text mps, §6.7"),
    "mps0_generator": (lambda: _generator_state("mps:0"), "a torch generator on device text mps:0, §6.7"),
    "sparse_coo_from_parts": (lambda: _coo([0, 1], 2),
                              "a COO sparse tensor crafted from its parts as a writer writes them, §6.12.1"),
    "v2_unpacked_lists": (lambda: _as_version([list(range(16)), [{"a": 1}, {"a": 2}]], 2, _as_list_deep),
                          "a version-2 file holding 16 ints and two flat dicts as list nodes, as version 2 "
                          "writes them (§1.3, §6.13)"),
    "bare_bit_generator": (lambda: tensorcanon.dumps(np.random.SFC64(np.random.SeedSequence(np.uint64(9)))),
                           "a bare SFC64 bit generator (rng.bitgen as a value on its own), whose "
                           "SeedSequence was given a numpy int, §6.7"),
    "sparse_attrs_at_every_use": (_attrs_every_use,
                                  "a sparse tensor with attributes used twice, its whole tensor.attrs node at each "
                                  "use, beside a sparse tensor of the same parts without them: two objects, §6.12 "
                                  "(issue 37)"),
    "settings_hashseed_texts": (lambda: tensorcanon.dumps({"v": [_settings(pythonhashseed=v)
                                                                 for v in (None, "", "random")]}),
                                "determinism settings recorded with PYTHONHASHSEED unset, empty and 'random': nil, "
                                "'' and 'random', kept as written, §6.7.2 (issue 37)"),
}


# ------------------------------------------------------------------ the corpus


def _digest_of(data: bytes) -> str:
    return tensorcanon.verify(data)


def cases() -> list[tuple[str, bytes, dict]]:
    """``(file name in this folder, bytes, manifest entry)`` for every case, in manifest order."""
    out = []
    golden = json.loads((GOLDEN / "digests.json").read_text())["digests"]
    older = {v: json.loads((GOLDEN / f"v{v}" / "digests.json").read_text())["digests"] for v in (1, 2)}
    covers = json.loads((GOLDEN / "conformance.json").read_text())["vectors"]
    now = tensorcanon.FORMAT_VERSION
    for version, folder, digests in ((now, GOLDEN, golden), (2, GOLDEN / "v2", older[2]), (1, GOLDEN / "v1", older[1])):
        for name in sorted(digests):
            key = name if version == now else f"v{version}/{name}"
            entry = {"expect": "accept", "digest": digests[name], "version": version,
                     "describes": covers[name] if version == now else f"the object of {name}, written by the "
                                                                      f"version-{version} writer",
                     "source": str((folder / f"{name}.safetensors").relative_to(ROOT))}
            if key in MAY_REJECT:
                entry["may_reject"] = MAY_REJECT[key]
            out.append((f"valid/{key.replace('/', '_')}.safetensors", (folder / f"{name}.safetensors").read_bytes(),
                        entry))
    for name, (build, what) in NEW_VALID.items():
        data = build()
        entry = {"expect": "accept", "digest": _digest_of(data), "version": h.manifest_of(data)[0]["version"],
                 "describes": what}
        if name in MAY_REJECT:
            entry["may_reject"] = MAY_REJECT[name]
        out.append((f"valid/{name}.safetensors", data, entry))
    expected = json.loads((ATTACKS / "expected.json").read_text())
    for name in sorted(expected):
        if name not in ATTACK_RULES:
            continue
        section, rule = ATTACK_RULES[name]
        error = expected[name]["raises"]
        out.append((f"invalid/{name}.bin", (ATTACKS / f"{name}.bin").read_bytes(),
                    {"expect": "reject", "category": ERROR_CATEGORY[error], "error": error, "section": section,
                     "rule": rule, "message": expected[name]["message"], "when": "always",
                     "source": f"tests/attacks/{name}.bin"}))
    for name, (build, section, rule, error, message, what, when) in NEW_INVALID.items():
        out.append((f"invalid/{name}.bin", build(),
                    {"expect": "reject", "category": ERROR_CATEGORY[error], "error": error, "section": section,
                     "rule": rule, "message": message, "when": when, "describes": what}))
    return out


def manifest(built: list[tuple[str, bytes, dict]]) -> dict:
    return {
        "corpus": "tensorcanon-conformance",
        "corpus_version": CORPUS_VERSION,
        "format_version": tensorcanon.FORMAT_VERSION,
        "spec": "docs/FORMAT.md",
        "reader": {
            "builds_values": True,
            "builtin_codecs": True,
            "registered": {"golden.GoldenConfig": "a dataclass with the fields lr (float), steps (int), tags (tuple)",
                           "golden.Split": "an Enum with the members TRAIN = 'train', TEST = 'test', FOLD = (1, 2)"},
        },
        "categories": CATEGORIES,
        "cases": [{"file": name, "sha256": hashlib.sha256(data).hexdigest(), **entry}
                  for name, data, entry in built],
    }


def render(built: list[tuple[str, bytes, dict]]) -> dict[str, bytes]:
    """Every file of the corpus (relative path -> bytes), manifest.json included."""
    files = {name: data for name, data, _ in built}
    files["manifest.json"] = (json.dumps(manifest(built), indent=1, ensure_ascii=False) + "\n").encode()
    return files


def main() -> None:
    files = render(cases())
    for sub in ("valid", "invalid"):
        for old in (HERE / sub).glob("*"):
            if f"{sub}/{old.name}" not in files:
                old.unlink()
    for name, data in files.items():
        path = HERE / name
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(data)
    print(f"{len(files) - 1} files and manifest.json written to {HERE}")


if __name__ == "__main__":
    main()
