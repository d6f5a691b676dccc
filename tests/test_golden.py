"""Golden vectors: the committed bytes and digests are the format's contract.

If this fails, tensorcanon now writes different bytes for the same content.
That is only allowed as a deliberate format change: bump FORMAT_VERSION,
update docs/FORMAT.md and run ``python tests/golden/regenerate.py --format-change``.
"""

import dataclasses
import io
import json
import pathlib
import sys

import pytest
import torch

import tensorcanon as tc

GOLDEN = pathlib.Path(__file__).parent / "golden"
sys.path.insert(0, str(GOLDEN))

import vectors  # noqa: E402
from compare import assert_same  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).parent / "fuzz"))
import hostile_lib as h  # noqa: E402

RECORD = json.loads((GOLDEN / "digests.json").read_text())
NAMES = sorted(vectors.VECTORS)


def test_every_vector_is_committed():
    assert sorted(RECORD["digests"]) == NAMES
    assert RECORD["format_version"] == tc.FORMAT_VERSION, "format version changed: regenerate golden files"
    for name in NAMES:
        assert (GOLDEN / f"{name}.safetensors").is_file(), name


def build(name: str):
    """The golden object, or skip where the running torch lacks a dtype it holds (torch 2.4,
    the floor, has no float8_e8m0fnu, float4_e2m1fn_x2 or int1..int7): such a file still
    verifies (test_committed_files_verify) and refuses to load with a clear error."""
    try:
        return vectors.build(name)
    except AttributeError as e:
        if "module 'torch' has no attribute" not in str(e):
            raise
        pytest.skip(f"torch {torch.__version__}: {e}")


@pytest.mark.parametrize("name", NAMES)
def test_committed_files_verify(name):
    # needs no object and no torch dtype: every byte is hashed against the recorded digests
    assert tc.verify(GOLDEN / f"{name}.safetensors") == RECORD["digests"][name]


@pytest.mark.parametrize("name", NAMES)
def test_bytes_and_digest_are_unchanged(name):
    obj, meta = build(name)
    expected = (GOLDEN / f"{name}.safetensors").read_bytes()
    data = tc.dumps(obj, metadata=meta)
    if data != expected:
        first = next((i for i, (x, y) in enumerate(zip(data, expected)) if x != y), min(len(data), len(expected)))
        pytest.fail(f"{name}: bytes changed at offset {first} (now {len(data)} bytes, golden {len(expected)}); "
                    "a format change must bump FORMAT_VERSION and regenerate (tests/golden/regenerate.py)")
    digest = RECORD["digests"][name]
    assert tc.fingerprint(obj, metadata=meta) == digest
    assert tc.save(obj, io.BytesIO(), metadata=meta) == digest
    assert tc.verify(expected) == digest


@pytest.mark.parametrize("name", NAMES)
def test_committed_files_load_back(name):
    obj, meta = build(name)
    data = (GOLDEN / f"{name}.safetensors").read_bytes()
    assert_same(obj, tc.loads(data), aliases={})
    assert tc.read_metadata(data) == meta
    # loading and saving again reproduces the file exactly
    assert tc.dumps(tc.loads(data), metadata=meta) == data


def test_golden_set_covers_every_dtype():
    # read from the committed files' tensor tables, so that the check does not depend on which
    # dtypes the running torch has
    from tensorcanon import dtypes

    seen = set()
    for name in NAMES:
        manifest, _, _ = h.manifest_of((GOLDEN / f"{name}.safetensors").read_bytes())
        seen.update(row["dtype"] for row in manifest["tensors"])
    missing = set(dtypes.BY_NAME) - seen
    assert not missing, f"golden vectors lack tensors of {sorted(missing)}"


def test_a_dtype_this_torch_lacks_is_refused_by_name():
    from tensorcanon import dtypes, tensorbytes

    # a table row as an older torch sees a newer dtype: no torch type
    row = dataclasses.replace(dtypes.BY_NAME["float8_e8m0fnu"], torch=None)
    buf, _ = tensorbytes.empty_buffer(3, "tensor")
    with pytest.raises(tc.UnsupportedTypeError, match=r"'w' has dtype float8_e8m0fnu, which this torch"):
        tensorbytes.finish(buf, row, (3,), "tensor", "w")
    lacking = [r.name for r in dtypes.BY_NAME.values() if r.torch is None]
    if lacking:  # on such a torch (2.4 lacks some), the committed file says which one, as TypeError
        with pytest.raises(TypeError, match=r"has dtype (%s), which this torch" % "|".join(lacking)):
            tc.load(GOLDEN / "dtypes_u8.safetensors")
