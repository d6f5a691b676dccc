"""Indexes that lie about per-rank paths and tensor sizes (security review of sharded checkpoints).

The attacker controls every byte of the directory: it rewrites the index (an ordinary tensorcanon
file) and the rank files, and records the rank files' new digests, so every file digest matches.
What must hold:

- a per-rank path is refused by ``layout.read`` (so by every reader) unless it is where a writer
  puts per-rank values: the value of a dict key that the logical state lacks, reached through
  dicts and lists. So if ``verify`` passes with digest ``d``, every load of the directory, on any
  rank, gives the values ``d`` covers plus per-rank values outside the logical state;
- a claimed tensor size is refused (FormatError / LimitError naming the index and the tensor)
  before anything of that size is allocated, on every path: load_unsharded, diff, dcp.load;
- nothing raises a raw KeyError / TypeError / RuntimeError, and the command line exits with its
  error status (2), without a traceback.
"""

from __future__ import annotations

import collections
import copy
import math
import os
import shutil
import subprocess
import sys
import textwrap

import msgpack
import pytest
import torch

import tensorcanon
import tensorcanon.dcp as tcd
from tensorcanon.format import manifest, paths
from tensorcanon.format.errors import FormatError, LimitError, TensorCanonError
from tensorcanon.format.ordering import sort_key
from tensorcanon.sharded import layout, tools
from tensorcanon.tools.cli import EXIT_ERROR, main
from tensorcanon.tools.diff import load_file

from threaded import run_ranks

BIG = 2**20000  # a key whose repr() raises (more than 4,300 digits)


def _state(rank: int = 0) -> dict:
    return {"b": [0, 1, 2, 3, 4], "step": 5, "w": torch.arange(6.0).reshape(3, 2),
            "cfg": {"pair": (1, "x"), "opts": {"lr": 0.5}, 1: "one"}, "runs": [{"seed": 3}],
            "model": collections.OrderedDict([("bias", torch.ones(2))]), "rng": tcd.PerRank(1000 + rank)}


def _logical(rank: int = 0) -> dict:
    state = _state(rank)
    del state["rng"]
    return state


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("hostile") / "ckpt")
    assert tcd.save(_state(), folder) == tensorcanon.fingerprint(_logical())
    return folder


@pytest.fixture(scope="module")
def base2(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("hostile2") / "ckpt")
    run_ranks(2, lambda r: tcd.save(_state(r), folder))
    return folder


def _forge(base: str, folder: str, per_rank: list[tuple] | None = None, change=None) -> str:
    """A copy of ``base`` whose rank files hold per-rank values (rank ``r``: ``1000 + r``) at
    ``per_rank`` (sorted as an index lists them), renamed by their new digests, and whose
    index records them, changed by ``change(index)``."""
    shutil.copytree(base, folder)
    path = layout.index_path(folder)
    index = tensorcanon.load(path)
    world = len(index["files"])
    if per_rank is not None:
        per_rank = sorted(per_rank, key=sort_key)
        old, new = layout.per_rank_keys(index["per_rank"]), layout.per_rank_keys(per_rank)
        for r in range(world):
            rank_path = os.path.join(folder, layout.rank_file_name(r, world, index["files"][r]))
            content = tensorcanon.load(rank_path)
            os.unlink(rank_path)
            for k in old:
                del content[k]
            content.update((k, 1000 + r) for k in new)
            tmp = os.path.join(folder, "tmp")
            index["files"][r] = tensorcanon.save(content, tmp)
            os.rename(tmp, os.path.join(folder, layout.rank_file_name(r, world, index["files"][r])))
        index["per_rank"] = per_rank
    if change is not None:
        change(index)
    tensorcanon.save(index, path)
    return folder


def _reshape(name: str, shape: list[int]):
    """An index change: the logical tensor ``name`` claims ``shape``, stored as one chunk on rank 0."""
    def change(index: dict) -> None:
        obj = dict(manifest.unpack(index["logical"])[0])
        rows = [dict(r) for r in obj["tensors"]]
        t = next(i for i, r in enumerate(rows) if r["name"] == name)
        rows[t]["shape"] = shape
        obj["tensors"] = rows
        index["logical"] = msgpack.packb(obj, use_bin_type=True)
        index["chunks"][t] = [[0, [0] * len(shape), list(shape)]]
    return change


def _refusals(folder: str) -> list[BaseException | None]:
    """What every reader does with ``folder``: its exception, or None if it succeeded."""
    target = _state()
    target["rng"] = tcd.PerRank(None)
    out = os.path.join(os.path.dirname(folder), "one.safetensors")
    calls = [lambda: layout.read(folder), lambda: tcd.verify(folder), lambda: tcd.load_unsharded(folder),
             lambda: tcd.load_unsharded(folder, rank=0), lambda: tcd.load(target, folder),
             lambda: tcd.consolidate(folder, out), lambda: load_file(folder), lambda: tools.describe(folder)]
    found: list[BaseException | None] = []
    for call in calls:
        try:
            call()
        except Exception as e:  # noqa: BLE001 - the test looks at what it was
            found.append(e)
        else:
            found.append(None)
    return found


# ---------------------------------------------------------------------------- per-rank paths

ILLEGAL = [
    ([("step",)], "names a value of the logical state"),
    ([("b",)], "names a value of the logical state"),
    ([("cfg",)], "names a value of the logical state"),
    ([("model", "bias")], "names a value of the logical state"),
    ([("cfg", True)], "names a value of the logical state"),  # Python merges True and the key 1
    ([("cfg", 1.0)], "names a value of the logical state"),   # canonically equal to the key 1
    ([("b", 0)], 'its parent $["b"] is a list'),
    ([("runs", 0)], 'its parent $["runs"] is a list'),
    ([("cfg", "pair", 0)], 'its parent $["cfg"]["pair"] is a tuple'),
    ([("step", "x")], 'its parent $["step"] is an int'),
    ([("b", 9, "x")], "a list without an item 9"),
    ([("nope", "x")], 'leads through $["nope"], which the logical state does not hold'),
    ([("rng",), ("rng", "x")], 'leads through $["rng"], another per-rank path'),
    ([("cfg", "opts", (1,)), ("cfg", "opts", (True,))], "the same key to Python"),
]


@pytest.mark.parametrize("per_rank, words", ILLEGAL, ids=[repr(p) for p, _ in ILLEGAL])
def test_a_per_rank_path_inside_the_logical_state_is_refused_by_every_reader(base, tmp_path, per_rank, words):
    folder = _forge(base, str(tmp_path / "ckpt"), per_rank)
    for found in _refusals(folder):
        assert isinstance(found, FormatError), repr(found)
        text = str(found)
        assert words in text and layout.index_path(folder) in text, text
        assert any(paths.join(p) in text for p in per_rank), text


@pytest.mark.parametrize("change, words", [
    (lambda i: i.update(format=BIG), "'format' is 0x8.*an int of 20001 bits"),
    (lambda i: i.update(layout=BIG), "layout version 0x8.*an int of 20001 bits"),
    (lambda i: i.update(files=[BIG]), "must be a xxh3-128 digest text, found 0x8.*an int of 20001 bits"),
    (lambda i: i["chunks"][0][0].__setitem__(0, BIG), "malformed chunk"),
])
def test_fields_holding_huge_ints_are_named_not_crashed_on(base, tmp_path, change, words):
    """repr() of an int of more than 4,300 digits raises ValueError: messages never call it."""
    folder = _forge(base, str(tmp_path / "ckpt"), change=change)
    with pytest.raises(FormatError, match=words) as info:
        layout.read(folder)
    assert layout.index_path(folder) in str(info.value)


LEGAL = [[("rng",)], [("cfg", "new")], [("runs", 0, "new")], [("model", "new")], [("fresh",), ("zz",)],
         [("cfg", BIG)], [("a.b",), ("cfg", "opts", "x")]]


@pytest.mark.parametrize("per_rank", LEGAL)
def test_verify_then_load_gives_the_verified_values_and_per_rank_values_outside_them(base, tmp_path, per_rank):
    """An attacker may still move per-rank values to other legal paths: they stay outside the
    logical state, and the logical state is exactly what verify covered."""
    folder = _forge(base, str(tmp_path / "ckpt"), per_rank)
    digest = tcd.verify(folder, expect=tensorcanon.fingerprint(_logical()))
    logical = tcd.load_unsharded(folder)
    assert tensorcanon.fingerprint(logical) == digest
    with_rank = tcd.load_unsharded(folder, rank=0)
    for p in per_rank:
        parent = with_rank
        for k in p[:-1]:
            parent = parent[k]
        assert parent.pop(p[-1]) == 1000
    assert tensorcanon.fingerprint(with_rank) == digest
    assert tools.describe(folder)["per_rank"] == [paths.join(p) for p in sorted(per_rank, key=sort_key)]


def test_per_rank_values_at_every_legal_place_round_trip(tmp_path, capsys):
    """What the writer saves, the reader accepts and gives back at the same paths: dicts,
    OrderedDicts, dicts inside lists, keys whose base names collide (unique rank-file keys),
    an int key too big for repr()."""
    nested = collections.OrderedDict([("w", torch.ones(2)), ("own", tcd.PerRank("od"))])
    state = {"a.b": tcd.PerRank("flat"), "a": {"b": tcd.PerRank("nested"), "c": 1},
             "runs": [{"seed": tcd.PerRank(7), "n": 2}], "model": nested, "big": {BIG: tcd.PerRank("big")}}
    want = {("a.b",): "flat", ("a", "b"): "nested", ("runs", 0, "seed"): 7, ("model", "own"): "od", ("big", BIG): "big"}
    folder = str(tmp_path / "ckpt")
    digest = tcd.save(state, folder)
    index = layout.read(folder)
    assert len(set(index.per_rank_keys)) == len(want) and "a.b@rank" in index.per_rank_keys
    assert tcd.verify(folder) == digest
    loaded = tcd.load_unsharded(folder, rank=0)
    for p, value in want.items():
        parent = loaded
        for k in p[:-1]:
            parent = parent[k]
        assert parent.pop(p[-1]) == value
    assert tensorcanon.fingerprint(loaded) == digest == tensorcanon.fingerprint(tcd.load_unsharded(folder))
    target = copy.deepcopy(state)
    for p in want:
        parent = target
        for k in p[:-1]:
            parent = parent[k]
        parent[p[-1]] = tcd.PerRank(None)
    tcd.load(target, folder)
    assert target["a.b"].value == "flat" and target["a"]["b"].value == "nested" and target["big"][BIG].value == "big"
    assert main(["inspect", folder]) == 0
    assert "per-rank values at" in capsys.readouterr().out


def test_a_per_rank_value_below_a_nan_key_loads(tmp_path):
    """A NaN key equals itself only canonically: the reader still finds its dict."""
    nan = float("nan")
    folder = str(tmp_path / "ckpt")
    digest = tcd.save({nan: {"own": tcd.PerRank(5), "x": 1}}, folder)
    assert tcd.verify(folder) == digest
    loaded = tcd.load_unsharded(folder, rank=0)
    ((key, inner),) = loaded.items()
    assert math.isnan(key) and inner == {"x": 1, "own": 5}


def test_two_ranks_refuse_a_per_rank_path_that_names_a_logical_value(base2, tmp_path):
    """Before: each rank of a 2-rank dcp.load got its own 'step' (1000, 1001), after verify said OK."""
    folder = _forge(base2, str(tmp_path / "ckpt"), [("step",)])

    def load(rank):
        target = _state(rank)
        target["rng"] = tcd.PerRank(None)
        try:
            tcd.load(target, folder)
        except TensorCanonError as e:
            return e
        return target["step"]

    got = run_ranks(2, load)
    assert all(isinstance(e, FormatError) and '$["step"]' in str(e) for e in got), got


def test_two_ranks_load_the_verified_values_and_their_own(base2, tmp_path):
    folder = _forge(base2, str(tmp_path / "ckpt"), [("cfg", "own")])
    tcd.verify(folder, expect=tensorcanon.fingerprint(_logical()))

    def load(rank):
        target = _state(rank)
        del target["rng"]
        target["cfg"]["own"] = tcd.PerRank(None)
        target["step"] = None
        tcd.load(target, folder)
        return target["step"], target["cfg"]["own"].value

    assert run_ranks(2, load) == [(5, 1000), (5, 1001)]


# ---------------------------------------------------------------------------- claimed sizes

SHAPES = [
    ([2**62, 2**62], FormatError, "reach 2^63 or more"),
    ([2**31, 2**31, 2**31], FormatError, "reach 2^63 or more"),
    ([1] * 65, LimitError, "65 dimensions, over max_ndim=64"),
    ([2**62] * 100_000, FormatError, "reach 2^63 or more"),  # refused before its size is multiplied out
    ([1] * 100_000, LimitError, "100000 dimensions"),
]


@pytest.mark.parametrize("shape, error, words", SHAPES, ids=["2^124", "2^93", "ndim65", "huge1e5", "ndim1e5"])
def test_a_shape_no_tensor_can_have_is_refused_by_every_reader(base, tmp_path, shape, error, words):
    folder = _forge(base, str(tmp_path / "ckpt"), change=_reshape("w", shape))
    for found in _refusals(folder):
        assert type(found) is error, repr(found)
        assert words in str(found) and layout.index_path(folder) in str(found) and "'w'" in str(found)


_CAPPED = textwrap.dedent("""
    import resource, sys, warnings
    import torch
    import tensorcanon, tensorcanon.dcp as tcd
    warnings.simplefilter("ignore")  # DCP's "no process group" warning
    from tensorcanon.tools.diff import load_file
    folder = sys.argv[1]
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.RLIM_INFINITY))  # 1 TiB cannot fit
    import torch.distributed.checkpoint as dcp
    from tensorcanon.dcp import _compat

    def from_keys():  # DCP builds torch.empty(shape) of every key from the metadata before reading
        if _compat.load_state_dict_from_keys is None:  # (a torch without it: the same read through DCP)
            return dcp.load({"w": torch.empty(0)}, storage_reader=tcd.Reader(folder), planner=dcp.DefaultLoadPlanner())
        return _compat.load_state_dict_from_keys({"w"}, storage_reader=tcd.Reader(folder))

    def default_planner():
        return dcp.load({"w": None}, storage_reader=tcd.Reader(folder), planner=dcp.DefaultLoadPlanner())

    calls = {"load_unsharded": lambda: tcd.load_unsharded(folder),
             "rank": lambda: tcd.load_unsharded(folder, rank=0),
             "diff": lambda: load_file(folder),
             "dcp.load": lambda: tcd.load({"w": None}, folder),   # a non-tensor target: read whole
             "_load_state_dict_from_keys": from_keys,
             "DefaultLoadPlanner": default_planner}
    for name, call in calls.items():
        try:
            call()
        except BaseException as e:  # (DCP's CheckpointException is a BaseException)
            e = tcd.api.unwrap(e)  # the rank's own error
            if not isinstance(e, tensorcanon.TensorCanonError):
                print(name, "RAW", type(e).__name__, e)
                continue
            print(name, type(e).__name__, folder + "/index.safetensors" in str(e) and "'w'" in str(e))
        except BaseException as e:
            print(name, "RAW", type(e).__name__, e)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs RLIMIT_AS and /proc")
def test_a_claimed_terabyte_is_refused_before_it_is_allocated(base, tmp_path):
    """2**37 x 2 float32 (1 TiB) fits in 64 bits, so only the rank file's row can refute it: every
    path finds the rows before allocating (checked under a capped address space)."""
    folder = _forge(base, str(tmp_path / "ckpt"), change=_reshape("w", [2**37, 2]))
    out = subprocess.run([sys.executable, "-c", _CAPPED, folder], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[:-1] == [f"{name} FormatError True" for name in
                                           ("load_unsharded", "rank", "diff", "dcp.load",
                                            "_load_state_dict_from_keys", "DefaultLoadPlanner")], out.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs RLIMIT_AS")
@pytest.mark.parametrize("shape", [[2**37, 2], [2**62, 2**62]], ids=["1TiB", "2^124"])
def test_the_command_line_diff_of_a_lying_directory_is_an_error_not_a_difference(base, tmp_path, shape):
    folder = _forge(base, str(tmp_path / "ckpt"), change=_reshape("w", shape))
    other = str(tmp_path / "other.safetensors")
    tensorcanon.save(_logical(), other)

    def cap() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (16 << 30, resource.RLIM_INFINITY))

    out = subprocess.run([sys.executable, "-m", "tensorcanon", "diff", folder, other], capture_output=True,
                         text=True, timeout=300, preexec_fn=cap)
    assert out.returncode == EXIT_ERROR, (out.returncode, out.stderr[-3000:])
    assert "Traceback" not in out.stderr and "'w'" in out.stderr and layout.INDEX_NAME in out.stderr, out.stderr
