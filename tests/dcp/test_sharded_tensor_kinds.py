"""Sparse, nested and meta tensors in sharded checkpoints: a checkpoint that verifies loads.

``verify`` of a checkpoint directory runs the value rules of the tensor kinds (docs/FORMAT.md
§6.12: sparse indices in range and coalesced, jagged offsets) on the verified bytes of their
parts, as verify of one file does, with the same function (tensorkinds.run_deferred): a directory
whose bytes break one of them, every digest re-sealed so that only the rule can reject it, fails
``verify`` (the dcp function, ``tensorcanon.verify`` and the command line) with the message
``load_unsharded`` fails with. The parts' shapes are checked when the index is read, so every
reader refuses a tree whose shapes do not fit.
"""

from __future__ import annotations

import os
import shutil

import msgpack
import pytest
import torch

import tensorcanon
import tensorcanon.dcp as tcd
from tensorcanon.format import digest, manifest
from tensorcanon.format.errors import FormatError
from tensorcanon.sharded import layout
from tensorcanon.tools.cli import EXIT_ERROR, main

import hostile_lib as h
from threaded import run_ranks


def _coo(indices: list[list[int]], size: tuple[int, ...]) -> torch.Tensor:
    values = torch.arange(1.0, len(indices[0]) + 1)
    return torch.sparse_coo_tensor(torch.tensor(indices), values, size, check_invariants=True).coalesce()


def _state(rank: int = 0) -> dict:
    csr = torch.tensor([[0.0, 2.0], [3.0, 0.0]]).to_sparse_csr()
    return {
        "coo": _coo([[0, 1, 2], [2, 0, 1]], (3, 3)),
        "csr": csr,
        "jagged": torch.nested.nested_tensor([torch.arange(3.0), torch.arange(5.0)], layout=torch.jagged),
        "strided": torch.nested.nested_tensor([torch.ones(2, 2), torch.zeros(1, 2)]),
        "meta": torch.empty(4, 5, device="meta"),
        "w": torch.arange(6.0).reshape(3, 2),
        "mine": tcd.PerRank({"coo": _coo([[rank, 2]], (3,)), "step": rank}),
    }


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return type(a) is type(b) and sorted(a) == sorted(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        if a.is_meta:
            return b.is_meta and a.shape == b.shape and a.dtype is b.dtype
        if a.is_nested:
            return b.is_nested and a.layout is b.layout and all(
                torch.equal(x, y) for x, y in zip(a.unbind(), b.unbind(), strict=True))
        return a.layout is b.layout and torch.equal(a.to_dense(), b.to_dense())
    return a == b


def _logical(state: dict) -> dict:
    return {k: v for k, v in state.items() if k != "mine"}


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("kinds") / "ckpt")
    tcd.save(_state(), folder)
    return folder


@pytest.mark.parametrize("world", [1, 2])
def test_a_checkpoint_of_tensor_kinds_verifies_and_loads(tmp_path, world, capsys):
    folder = str(tmp_path / "ckpt")
    if world == 1:
        tcd.save(_state(), folder)
    else:
        run_ranks(world, lambda r: tcd.save(_state(r), folder))
    found = tcd.verify(folder)
    assert found == tensorcanon.verify(folder) == tensorcanon.fingerprint(_logical(_state()))
    assert main(["verify", folder]) == 0
    assert found in capsys.readouterr().out
    assert _same(tcd.load_unsharded(folder), _logical(_state()))
    for r in range(world):
        back = tcd.load_unsharded(folder, rank=r)
        assert _same(back["mine"], _state(r)["mine"].value)


# ---------------------------------------------------------------------------- forging


def _rank_file(folder: str, r: int = 0) -> str:
    index = tensorcanon.load(layout.index_path(folder))
    return os.path.join(folder, layout.rank_file_name(r, len(index["files"]), index["files"][r]))


def _resealed(base: str, folder: str, key: str, value, logical: str | None = None) -> str:
    """A copy of ``base`` whose rank file 0 holds ``value`` under ``key``, re-saved (so its tensor
    digests and file digest are right) and renamed by its new digest; the index records the new file
    digest and, when ``key`` is the one chunk of logical tensor ``logical``, that tensor's new digest
    (so the logical digest is that of the forged state: only a rule on values can reject it)."""
    shutil.copytree(base, folder)
    old = _rank_file(folder)
    content = tensorcanon.load(old)
    content[key] = value
    os.unlink(old)
    tmp = os.path.join(folder, "tmp")
    path = layout.index_path(folder)
    index = tensorcanon.load(path)
    index["files"][0] = tensorcanon.save(content, tmp)
    os.rename(tmp, os.path.join(folder, layout.rank_file_name(0, len(index["files"]), index["files"][0])))
    if logical is not None:
        obj = dict(manifest.unpack(index["logical"])[0])
        rows = [dict(row) for row in obj["tensors"]]
        row = next(row for row in rows if row["name"] == logical)
        assert tuple(row["shape"]) == tuple(value.shape) and row["dtype"] == str(value.dtype).split(".")[1]
        h = digest.tensor_hasher(row["dtype"], row["shape"], "xxh3-128")
        h.update(value.contiguous().view(torch.uint8).numpy().tobytes())
        row["digest"] = h.digest()
        obj["tensors"] = rows
        index["logical"] = msgpack.packb(obj, use_bin_type=True)
    tensorcanon.save(index, path)
    return folder


def _fails_as_load(folder: str, match: str, capsys, rank: int | None = None) -> str:
    """Every verify of ``folder`` fails with the FormatError load fails with; returns the message."""
    with pytest.raises(FormatError, match=match) as loaded:
        tcd.load_unsharded(folder, rank=rank)
    message = str(loaded.value)
    for verify in (tcd.verify, tensorcanon.verify):
        with pytest.raises(FormatError) as verified:
            verify(folder)
        assert str(verified.value) == message
    capsys.readouterr()
    assert main(["verify", folder]) == EXIT_ERROR
    assert message in capsys.readouterr().err
    return message


def test_a_sparse_index_out_of_range_in_a_rank_file_fails_verify_as_it_fails_load(one_rank, tmp_path, capsys):
    bad = torch.tensor([[0, 1, 7], [2, 0, 1]])  # 7: outside the 3x3 matrix
    folder = _resealed(one_rank, str(tmp_path / "bad"), "coo.indices@0,0", bad, logical="coo.indices")
    assert tcd.logical_digest(folder) != tcd.logical_digest(one_rank)  # re-sealed: every digest is right
    message = _fails_as_load(folder, "out of range", capsys)
    assert message.endswith('at $["coo"]')


def test_uncoalesced_sparse_indices_in_a_rank_file_fail_verify_as_they_fail_load(one_rank, tmp_path, capsys):
    folder = _resealed(one_rank, str(tmp_path / "bad"), "coo.indices@0,0",
                       torch.tensor([[1, 0, 2], [0, 2, 1]]), logical="coo.indices")
    _fails_as_load(folder, "coalesced", capsys)


def test_decreasing_jagged_offsets_in_a_rank_file_fail_verify_as_they_fail_load(one_rank, tmp_path, capsys):
    folder = _resealed(one_rank, str(tmp_path / "bad"), "jagged.offsets@0", torch.tensor([0, 9, 8]),
                       logical="jagged.offsets")
    message = _fails_as_load(folder, "must not decrease", capsys)
    assert message.endswith('at $["jagged"]')


def test_a_bad_per_rank_sparse_value_fails_verify_as_it_fails_load(one_rank, tmp_path, capsys):
    """A per-rank value is decoded by verify as load decodes it (every rank's), so the rule holds
    there too. The writer refuses such a value, so the rank file's manifest is edited (the size of
    rank 0's COO value, indices [[0, 2]], becomes 1) and its file digest re-sealed."""
    folder = str(tmp_path / "bad")
    shutil.copytree(one_rank, folder)
    old = _rank_file(folder)
    with open(old, "rb") as f:
        data = f.read()

    def edit(m):
        root = m["root"]
        value = root[root.index("mine@rank") + 1]
        coo = value[value.index("coo") + 1]
        assert coo[:3] == ["sparse", "coo", ["size", 3]]
        coo[2] = ["size", 1]
    data = h.with_manifest(data, edit)
    os.unlink(old)
    path = layout.index_path(folder)
    index = tensorcanon.load(path)
    with tensorcanon.open(data) as cf:
        index["files"][0] = cf.digest
    with open(os.path.join(folder, layout.rank_file_name(0, 1, index["files"][0])), "wb") as f:
        f.write(data)
    tensorcanon.save(index, path)
    assert tcd.logical_digest(folder) == tcd.logical_digest(one_rank)  # the logical state is untouched
    assert _same(tcd.load_unsharded(folder), _logical(_state()))       # and loads
    message = _fails_as_load(folder, "out of range", capsys, rank=0)
    assert "[0, 1)" in message


def test_parts_whose_shapes_do_not_fit_are_refused_by_every_reader_when_the_index_is_read(one_rank, tmp_path):
    """The logical tree's size of the COO tensor is edited to one dimension: its 2-row indices no
    longer fit. Reading the index refuses it (by the table's shapes, nothing is built)."""
    folder = str(tmp_path / "bad")
    shutil.copytree(one_rank, folder)
    path = layout.index_path(folder)
    index = tensorcanon.load(path)
    obj = dict(manifest.unpack(index["logical"])[0])
    root = list(obj["root"])
    at = root.index("coo") + 1
    node = list(root[at])
    node[2] = ("size", 9)
    root[at] = tuple(node)
    obj["root"] = tuple(root)
    index["logical"] = msgpack.packb(obj, use_bin_type=True)
    tensorcanon.save(index, path)
    for read in (layout.read, tcd.verify, tcd.load_unsharded, tensorcanon.verify):
        with pytest.raises(FormatError, match=r"logical manifest: .*a coo sparse tensor: .*at \$\[\"coo\"\]"):
            read(folder)
