"""Fuzz sharded checkpoint directories as an attacker who controls every byte of them (issue 19).

The attacker here is complete: besides editing the index, it rewrites rank files and gives them
the digests and names the index then records, so every file-level digest still matches. What must
hold whatever it does:

- every reader (verify, load_unsharded with and without ``rank=``, consolidate) either raises a
  tensorcanon error within a deadline or succeeds;
- if ``verify`` passes with digest ``d``, the logical state that loads has fingerprint ``d``, every
  rank's load gives back that logical state plus per-rank values only at paths the logical state
  does not hold (a verified digest pins what loads), and consolidating gives a file of digest ``d``.

Derandomized, so a failure reproduces; TENSORCANON_FUZZ_CASES scales it as tests/fuzz does.
"""

from __future__ import annotations

import collections
import copy
import os
import shutil

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import tensorcanon
import tensorcanon.dcp as tcd
from tensorcanon.format import manifest
from tensorcanon.format.errors import TensorCanonError
from tensorcanon.format.ordering import sort_key
from tensorcanon.sharded import layout

import hostile_lib as h
from helpers import Shard, distribute_tensor
from threaded import run_ranks

_TOTAL = int(os.environ.get("TENSORCANON_FUZZ_CASES", "0") or 0)


def cases(n: int) -> settings:
    if _TOTAL:
        n = max(1, n * _TOTAL // 10_000)
    return settings(max_examples=n, derandomize=not _TOTAL, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck), print_blob=True)


def _state(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    model = collections.OrderedDict([("w", distribute_tensor(torch.arange(12.0).reshape(6, 2), mesh, [Shard(0)])),
                                     ("b", torch.arange(3, dtype=torch.int64))])
    return {"model": model, "b": [0, 1, 2, 3, 4], "step": 7, "cfg": {"name": "run", "pair": (1, "x")},
            "groups": [{"lr": 0.5}],
            "flags": distribute_tensor(torch.tensor([True, False, True, True]), mesh, [Shard(0)]),
            "rng": tcd.PerRank({"rank": rank})}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("fuzz") / "ckpt")
    run_ranks(2, lambda r: tcd.save(_state(r), folder))
    return folder


# Paths an attacker may list as per-rank: the saved one, paths the logical state holds (a value,
# a dict, an item of a list or tuple, a key of an OrderedDict), paths it does not hold (under a dict,
# under a list, under a leaf, under another per-rank path), and keys whose names collide.
PATHS = [("rng",), ("step",), ("b",), ("b", 0), ("b", 9), ("model",), ("model", "w"), ("model", "b"),
         ("model", "new"), ("cfg",), ("cfg", "name"), ("cfg", "pair"), ("cfg", "pair", 0), ("cfg", "new"),
         ("new",), ("new", "deeper"), ("rng", "rank"), ("rng", "x"), ("step", "x"), ("a.b",), ("a", "b"),
         ("groups", 0, "new"), ("groups", 0, "lr"), ("groups", 1, "new"), ("groups", 0),
         (0,), (1.5,), ("flags",)]


def _rewrite(folder: str, per_rank: list[tuple], values: list, index_change=None) -> None:
    """Give every rank file exactly ``per_rank``'s keys (valued ``values[r]``), re-save and rename
    the rank files, and record their digests in an index rewritten by ``index_change``."""
    path = layout.index_path(folder)
    index = tensorcanon.load(path)
    world = len(index["files"])
    old_keys = layout.per_rank_keys(index["per_rank"])
    new_keys = layout.per_rank_keys(per_rank)
    files = []
    for r in range(world):
        rank_path = os.path.join(folder, layout.rank_file_name(r, world, index["files"][r]))
        content = tensorcanon.load(rank_path)
        os.unlink(rank_path)
        for k in old_keys:
            content.pop(k, None)
        for k in new_keys:
            content[k] = values[r]
        tmp = os.path.join(folder, "tmp.safetensors")
        d = tensorcanon.save(content, tmp)
        os.rename(tmp, os.path.join(folder, layout.rank_file_name(r, world, d)))
        files.append(d)
    index["files"] = files
    index["per_rank"] = per_rank
    if index_change is not None:
        index_change(index)
    tensorcanon.save(index, path)


def _without(value, paths: list[tuple]):
    """``value`` with the per-rank paths removed (each parent must be a dict holding the key)."""
    value = copy.copy(value)
    for p in paths:
        parent = value
        for k in p[:-1]:  # through dicts and lists (FORMAT.md §14.6)
            assert type(parent) in (dict, collections.OrderedDict, list), (p, type(parent))
            parent[k] = copy.copy(parent[k])
            parent = parent[k]
        assert type(parent) in (dict, collections.OrderedDict), (p, type(parent))
        assert p[-1] in parent, p
        del parent[p[-1]]
    return value


def _holds(root, path: tuple) -> bool:
    node = root
    for k in path:
        if type(node) in (dict, collections.OrderedDict) and k in node:
            node = node[k]
        elif type(node) in (list, tuple) and type(k) is int and 0 <= k < len(node):
            node = node[k]
        else:
            return False
    return True


def _attempt(fn):
    """``fn()``'s result, or the tensorcanon error it raised; anything else fails the test."""
    try:
        with h.deadline():
            return fn()
    except TensorCanonError as e:
        return e


def _check_pinned(folder: str, tmp: str) -> None:
    """The property: a directory that verifies loads only what its digest covers."""
    found = _attempt(lambda: tcd.verify(folder))
    logical = _attempt(lambda: tcd.load_unsharded(folder))
    if isinstance(found, TensorCanonError):
        return  # refused; the loads above only had to fail cleanly (or succeed) within the deadline
    assert not isinstance(logical, TensorCanonError), f"verify passed but load_unsharded raised {logical!r}"
    assert tensorcanon.fingerprint(logical) == found
    index = layout.read(folder)
    for p in index.per_rank:
        assert not _holds(logical, p), f"per-rank path {p} is part of the verified logical state"
    for r in range(index.world_size):
        got = tcd.load_unsharded(folder, rank=r)
        assert tensorcanon.fingerprint(_without(got, index.per_rank)) == found, r
    out = os.path.join(tmp, "one.safetensors")
    assert tcd.consolidate(folder, out) == found
    assert tensorcanon.verify(out) == found


@cases(60)
@given(paths=st.lists(st.sampled_from(PATHS), max_size=4, unique=True),
       value=st.sampled_from([1000, None, [7], {"x": 1}, torch.zeros(2)]))
def test_per_rank_paths_never_load_unverified_values(base, tmp_path_factory, paths, value):
    folder = str(tmp_path_factory.mktemp("case") / "ckpt")
    shutil.copytree(base, folder)
    ordered = sorted(paths, key=sort_key)  # the index lists them in canonical order
    values = [value if not isinstance(value, int) else value + r for r in range(2)]
    _rewrite(folder, ordered, values)
    _check_pinned(folder, os.path.dirname(folder))


def _mutate_chunks(index: dict, t: int, j: int, field: int, dim: int, new: int) -> None:
    chunk = index["chunks"][t % len(index["chunks"])]
    entry = chunk[j % len(chunk)]
    if field == 0:
        entry[0] = new
    elif entry[field]:
        entry[field][dim % len(entry[field])] = new


def _mutate_logical_shape(index: dict, t: int, dim: int, new: int) -> None:
    obj = dict(manifest.unpack(index["logical"])[0])
    rows = [dict(r) for r in obj["tensors"]]
    row = rows[t % len(rows)]
    shape = list(row["shape"])
    if shape:
        shape[dim % len(shape)] = new
    row["shape"] = shape
    obj["tensors"] = rows
    index["logical"] = h.repack(obj)


SIZES = st.sampled_from([0, 1, 2, 3, 5, 6, 2**31, 2**38, 2**62, 2**63 - 1])


@cases(80)
@given(st.data())
def test_lying_chunks_and_shapes_are_refused_or_pinned(base, tmp_path_factory, data):
    folder = str(tmp_path_factory.mktemp("case") / "ckpt")
    shutil.copytree(base, folder)
    if data.draw(st.booleans(), "change the logical shape"):
        t, dim, new = data.draw(st.integers(0, 9)), data.draw(st.integers(0, 3)), data.draw(SIZES)
        change = lambda index: _mutate_logical_shape(index, t, dim, new)  # noqa: E731
    else:
        t, j, field, dim = (data.draw(st.integers(0, 9)) for _ in range(4))
        new = data.draw(SIZES)
        change = lambda index: _mutate_chunks(index, t, j, field % 3, dim, new)  # noqa: E731
    index = tensorcanon.load(layout.index_path(folder))
    _rewrite(folder, list(index["per_rank"]), [{"rank": 0}, {"rank": 1}], change)
    _check_pinned(folder, os.path.dirname(folder))


def test_the_unchanged_checkpoint_passes_the_property(base, tmp_path):
    """The oracle itself: the real checkpoint verifies and every load is pinned."""
    folder = str(tmp_path / "ckpt")
    shutil.copytree(base, folder)
    _check_pinned(folder, str(tmp_path))
    assert tcd.load_unsharded(folder, rank=1)["rng"] == {"rank": 1}
