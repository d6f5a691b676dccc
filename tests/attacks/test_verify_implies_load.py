"""A file that verifies loads: ``verify`` runs every check ``load`` runs on the values the format
itself specifies (docs/FORMAT.md §6.7.2, §6.9: registry.specify), so the two cannot disagree.

Found by attack: an ``io.BytesIO`` node whose state was a str, a list or nil verified and then
failed to load. Checked here on every attack file and conformance file, and on every state
mutation of every specified type: the built-in codecs and DeterminismSettings, each state replaced
whole and item by item with a palette of other nodes.

The only load failures allowed after a passing verify are the environment's (a type not
registered in this process, a device or dtype it lacks); a mutated specified state must load.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import io
import pathlib
import sys

import msgpack
import pytest

import tensorcanon
from tensorcanon.format import tree
from tensorcanon.format.errors import DeviceUnavailableError, TensorCanonError, UnsupportedTypeError

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "fuzz"))

import hostile_lib as h

ENVIRONMENT = (UnsupportedTypeError, DeviceUnavailableError)


def outcomes(data: bytes) -> tuple[bool, BaseException | None]:
    """(verify passed, what load raised or None)."""
    try:
        tensorcanon.verify(data)
        verified = True
    except TensorCanonError:
        verified = False
    try:
        tensorcanon.loads(data)
        loaded = None
    except TensorCanonError as e:
        loaded = e
    return verified, loaded


@pytest.fixture(autouse=True)
def _builtin_codecs():
    tensorcanon.register_builtin_codecs()  # (conftest's builtin_codecs_left_off turns them off again)


def _corpus() -> list[pathlib.Path]:
    conformance = HERE.parent / "conformance"
    files = sorted(HERE.glob("*.bin")) + sorted((conformance / "valid").rglob("*.safetensors"))
    files += sorted((conformance / "invalid").rglob("*.bin"))
    return files


@pytest.mark.parametrize("path", _corpus(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_corpus_files_that_verify_load(path):
    verified, loaded = outcomes(path.read_bytes())
    if verified:
        assert loaded is None or isinstance(loaded, ENVIRONMENT), f"verified, then load raised {loaded!r}"


def test_the_corpus_is_found():
    assert len(_corpus()) > 100


# ------------------------------------------------------------------ mutated specified states

PALETTE = [
    "text", b"bin", None, 0, -1, msgpack.ExtType(tree.EXT_BIGINT, tree.bigint_bytes(2**70)), 1.5, True,
    ["list"], ["list", 1], ["list", "a", "b"], ["tuple"], ["tuple", "a"], ["dict"], ["dict", "a", 1],
    ["set"], ["size", 1], ["dtype", "float32"], ["device", "cpu"], ["complex", 0.0, 0.0],
    ["obj", "io.BytesIO", b"x"], ["np", "float32", b"\0\0\0\0"],
]


def _values() -> dict[str, object]:
    return {
        "io.BytesIO": io.BytesIO(b"abc"),
        "pathlib.PurePath": pathlib.PurePosixPath("/data/x"),
        "datetime.date": datetime.date(2024, 2, 29),
        "datetime.time": datetime.time(1, 2, 3, 4, tzinfo=datetime.timezone.utc),
        "datetime.datetime": datetime.datetime(2024, 1, 2, 3, 4, 5, 6),
        "datetime.timedelta": datetime.timedelta(days=-1, seconds=5),
        "argparse.Namespace": argparse.Namespace(lr=0.1, name="x"),
        "tensorcanon.DeterminismSettings": tensorcanon.DeterminismSettings(
            deterministic_algorithms=True, deterministic_warn_only=False, cudnn_deterministic=True,
            cudnn_benchmark=False, cudnn_allow_tf32=True, cuda_matmul_allow_tf32=False,
            float32_matmul_precision="highest", cublas_workspace_config=None, pythonhashseed="0",
            num_threads=4, torch_version="2.4.0", numpy_version="1.26.4", cuda_version=None,
            cudnn_version=None, machine="x86_64", gpu_names=("A",), gpu_sm_counts=(108,)),
    }


def _mutations(state) -> list:
    """The state replaced whole by each palette node, and each of its items (a list's items, a
    dict's values and keys) by each."""
    out = [copy.deepcopy(p) for p in PALETTE]
    if isinstance(state, list) and state and state[0] in ("list", "tuple", "dict"):
        for i in range(1, len(state)):
            for p in PALETTE:
                m = copy.deepcopy(state)
                m[i] = copy.deepcopy(p)
                out.append(m)
        out.append(state[:-1])  # one item fewer
        out.append(state + [state[-1]])  # one more
    return out


@pytest.mark.parametrize("name", list(_values()))
def test_mutated_specified_states_that_verify_load(name):
    data = tensorcanon.dumps({"v": _values()[name]})
    m, _, _ = h.manifest_of(data)
    node = m["root"][2]
    assert node[:2] == ["obj", name], node
    tried = refused = 0
    for state in _mutations(node[2]):
        def edit(m, state=state):
            m["root"][2][2] = state
        bad = h.with_manifest(data, edit)
        verified, loaded = outcomes(bad)
        tried += 1
        refused += not verified
        if verified:
            assert loaded is None, f"{name} with state {state!r}: verified, then load raised {loaded!r}"
    assert refused  # every type has states the format forbids, and verify finds them
    assert outcomes(data) == (True, None)
