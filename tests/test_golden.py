"""Golden vectors: the committed bytes and digests are the format's contract.

If this fails, tensorcanon now writes different bytes for the same content.
That is only allowed as a deliberate format change: bump FORMAT_VERSION,
update docs/FORMAT.md and run ``python tests/golden/regenerate.py --format-change``.

tests/golden/v1/ and tests/golden/v2/ hold the version-1 and version-2 golden files, read-only:
every reader must still load and verify them, and saving what they hold gives the current file.
"""

import dataclasses
import io
import json
import pathlib

import msgpack
import pytest

import tensorcanon as tc

GOLDEN = pathlib.Path(__file__).parent / "golden"

import hostile_lib as h
import vectors
from compare import assert_same

RECORD = json.loads((GOLDEN / "digests.json").read_text())
NAMES = sorted(vectors.VECTORS)
BUILT = [n for n in NAMES if vectors.buildable(n)]  # all but on a torch that lacks some dtypes (2.4)
V1 = GOLDEN / "v1"
V1_RECORD = json.loads((V1 / "digests.json").read_text())
V2 = GOLDEN / "v2"
V2_RECORD = json.loads((V2 / "digests.json").read_text())


def test_every_vector_is_committed():
    assert sorted(RECORD["digests"]) == NAMES
    assert RECORD["format_version"] == tc.FORMAT_VERSION, "format version changed: regenerate golden files"
    for name in NAMES:
        assert (GOLDEN / f"{name}.safetensors").is_file(), name


@pytest.mark.parametrize("name", NAMES)
def test_committed_files_verify(name):
    # needs no object and no torch dtype: every byte is hashed against the recorded digests
    assert tc.verify(GOLDEN / f"{name}.safetensors") == RECORD["digests"][name]


@pytest.mark.parametrize("name", BUILT)
def test_bytes_and_digest_are_unchanged(name):
    obj, meta = vectors.build(name)
    expected = (GOLDEN / f"{name}.safetensors").read_bytes()
    data = tc.dumps(obj, metadata=meta)
    if data != expected:
        first = next((i for i, (x, y) in enumerate(zip(data, expected, strict=False)) if x != y),
                     min(len(data), len(expected)))
        pytest.fail(f"{name}: bytes changed at offset {first} (now {len(data)} bytes, golden {len(expected)}); "
                    "a format change must bump FORMAT_VERSION and regenerate (tests/golden/regenerate.py)")
    digest = RECORD["digests"][name]
    assert tc.fingerprint(obj, metadata=meta) == digest
    assert tc.save(obj, io.BytesIO(), metadata=meta) == digest
    assert tc.verify(expected) == digest


@pytest.mark.parametrize("name", BUILT)
def test_committed_files_load_back(name):
    obj, meta = vectors.build(name)
    data = (GOLDEN / f"{name}.safetensors").read_bytes()
    assert_same(obj, tc.loads(data), aliases={})
    assert tc.read_metadata(data) == meta
    # loading and saving again reproduces the file exactly
    assert tc.dumps(tc.loads(data), metadata=meta) == data


def test_golden_set_covers_every_dtype():
    # read from the committed files' tensor tables, so that the check does not depend on which
    # dtypes the running torch has
    from tensorcanon.format import dtypes

    seen = set()
    for name in NAMES:
        manifest, _, _ = h.manifest_of((GOLDEN / f"{name}.safetensors").read_bytes())
        seen.update(row["dtype"] for row in manifest["tensors"])
    missing = set(dtypes.BY_NAME) - seen
    assert not missing, f"golden vectors lack tensors of {sorted(missing)}"


def test_a_dtype_this_torch_lacks_is_refused_by_name():
    from tensorcanon.format import dtypes, tensorbytes

    # a table row as an older torch sees a newer dtype: no torch type
    row = dataclasses.replace(dtypes.BY_NAME["float8_e8m0fnu"], torch=None)
    buf, _ = tensorbytes.empty_buffer(3, "tensor")
    with pytest.raises(tc.UnsupportedTypeError, match=r"'w' has dtype float8_e8m0fnu, which this torch"):
        tensorbytes.finish(buf, row, (3,), "tensor", "w")
    lacking = [r.name for r in dtypes.BY_NAME.values() if r.torch is None]
    # dtypes_u8 holds dtypes an older torch lacks; tensor_kinds_kept, cached lengths its jagged tensors
    # cannot be given (torch 2.4: both; that file still loads there, test_interop.py)
    unbuilt = sorted(set(NAMES) - set(BUILT) - {"tensor_kinds_kept"})
    assert unbuilt == (["dtypes_u8"] if lacking else []), "only dtypes_u8 holds dtypes an older torch lacks"
    for name in unbuilt:  # on such a torch (2.4 lacks some), the committed file says which one, as TypeError
        with pytest.raises(TypeError, match=rf"has dtype ({'|'.join(lacking)}), which this torch"):
            tc.load(GOLDEN / f"{name}.safetensors")
        for v1 in V1.glob(f"{name}.safetensors"):
            assert tc.verify(v1) == V1_RECORD["digests"][name]
            with pytest.raises(TypeError, match=rf"has dtype ({'|'.join(lacking)}), which this torch"):
                tc.load(v1)


# ------------------------------------------------------------------ version 1, read-only


def test_v1_record_is_frozen():
    assert V1_RECORD["format_version"] == 1
    assert sorted(V1_RECORD["digests"]) == sorted(p.stem for p in V1.glob("*.safetensors"))
    assert set(V1_RECORD["digests"]) <= set(NAMES), "every v1 file has a v2 counterpart"


def _older_file_loads_and_verifies(folder: pathlib.Path, record: dict, name: str) -> None:
    data = (folder / f"{name}.safetensors").read_bytes()
    assert tc.verify(data) == record["digests"][name]
    obj, meta = vectors.build(name)
    loaded = tc.loads(data)
    assert_same(obj, loaded, aliases={})
    assert tc.read_metadata(data) == meta
    # Saving what an older file holds gives exactly the current golden file: same content, new rules.
    assert tc.dumps(loaded, metadata=meta) == (GOLDEN / f"{name}.safetensors").read_bytes()


@pytest.mark.parametrize("name", sorted(set(V1_RECORD["digests"]) & set(BUILT)))
def test_v1_files_load_and_verify(name):
    _older_file_loads_and_verifies(V1, V1_RECORD, name)


@pytest.mark.parametrize("name", sorted(V1_RECORD["digests"]))
def test_v1_and_v2_manifests_differ_only_where_the_changelog_says(name):
    """Between versions only the version field and the names of §3.6's keys change."""
    from tensorcanon.io import reader

    manifests = []
    for folder in (V1, V2):
        with reader.open_file((folder / f"{name}.safetensors").read_bytes()) as cf:
            manifests.append(cf.manifest)
    old, new = manifests
    assert (old.version, new.version) == (1, 2)
    renamed = {r.name for r in old.tensors} != {r.name for r in new.tensors}
    assert renamed == (name == "names")
    if not renamed:  # byte for byte, except the version (the last byte: 0x01 -> 0x02)
        assert old.raw[:-1] == new.raw[:-1] and (old.raw[-1], new.raw[-1]) == (1, 2)


def test_the_aliasing_vector_merges_exactly_what_the_spec_says():
    """docs/FORMAT.md §6.5: one stored tensor per distinct (address, device, shape, strides,
    dtype, kind, requires_grad, lazy bits); two torch storages over one buffer are one memory."""
    from tensorcanon.io import reader

    with reader.open_file((GOLDEN / "aliasing.safetensors").read_bytes()) as cf:
        groups: dict[int, list] = {}
        for trail, index in cf.uses():
            groups.setdefault(index, []).append(trail[0])
    merged = sorted(sorted(g) for g in groups.values() if len(g) > 1)
    assert merged == [["array", "array_view"], ["from_numpy_1", "from_numpy_2"],
                      ["same_slice", "slice"], ["strided", "strided_again"]]
    assert sum(len(g) == 1 for g in groups.values()) == 9  # everything else stands alone


# ------------------------------------------------------------------ version 2, read-only


def test_v2_record_is_frozen():
    assert V2_RECORD["format_version"] == 2
    assert sorted(V2_RECORD["digests"]) == sorted(p.stem for p in V2.glob("*.safetensors"))
    # every v3 vector has its v2 file, but those added in version 3: packed lists (the version's change), the
    # ecosystem's codecs (§6.9.5) and the tensor kinds kept as held (§6.12, issue 37), added within version 3
    assert set(V2_RECORD["digests"]) == set(NAMES) - {"packed_lists", "ecosystem", "tensor_kinds_kept"}


@pytest.mark.parametrize("name", sorted(set(V2_RECORD["digests"]) & set(BUILT)))
def test_v2_files_load_and_verify(name):
    _older_file_loads_and_verifies(V2, V2_RECORD, name)


def _packed_as_lists(node):
    """A tree with every packed list (FORMAT.md §6.13) written back as the list node version 2 has."""
    from tensorcanon.format import packed

    node = packed.expand(node)
    if type(node) in (list, tuple):  # (not an ExtType, a namedtuple)
        return tuple(_packed_as_lists(x) for x in node)
    return node


@pytest.mark.parametrize("name", sorted(V2_RECORD["digests"]))
def test_v2_and_v3_manifests_differ_only_where_the_changelog_says(name):
    """Between versions 2 and 3 only the version field and the packed lists change (FORMAT.md §1.3):
    the tensor table (names, digests) is the same, and unpacking every packed list gives the v2 tree."""
    from tensorcanon.io import reader

    manifests = []
    for folder in (V2, GOLDEN):
        with reader.open_file((folder / f"{name}.safetensors").read_bytes()) as cf:
            manifests.append(cf.manifest)
    old, new = manifests
    assert (old.version, new.version) == (2, 3)
    assert [(r.name, r.digest, r.shape) for r in old.tensors] == [(r.name, r.digest, r.shape) for r in new.tensors]
    def packed(tree):  # (compared as bytes: a NaN is not equal to itself)
        return msgpack.packb(tree, use_bin_type=True)

    assert packed(_packed_as_lists(new.root)) == packed(_packed_as_lists(old.root)) == packed(old.root)
    assert packed(_packed_as_lists(new.meta)) == packed(old.meta)
    if new.raw != old.raw[:-1] + b"\x03":  # the version (the last byte) alone, or packed lists too
        assert new.root != old.root or new.meta != old.meta
