"""The sharded layout's golden vector (docs/FORMAT.md §14.9): committed bytes are the contract."""

from __future__ import annotations

import importlib.util
import pathlib

import torch

import tensorcanon
import tensorcanon.dcp as tcd

from helpers import rank_files

GOLDEN = pathlib.Path(__file__).resolve().parent.parent / "golden" / "sharded"
# golden/sharded/regenerate.py, by its path: golden/regenerate.py (the single-file vectors' script)
# has the same module name on the test path.
_spec = importlib.util.spec_from_file_location("sharded_regenerate", GOLDEN / "regenerate.py")
assert _spec is not None and _spec.loader is not None
regenerate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(regenerate)

LOGICAL = "xxh3-128:1dff5453a818a55db060bf1e9235912a"
INDEX = "xxh3-128:846fffc76fa222fde4f9ebe596db2a11"
# The same checkpoint written by the format-version-2 writer (layout 1 both): read-only, still read.
LOGICAL_V2 = "xxh3-128:6f70ab9f3b260274852c32b4ff9f9097"
INDEX_V2 = "xxh3-128:2ad52f54f88d2ad203f2701dfad33834"


def test_saving_the_example_gives_the_committed_bytes(tmp_path):
    folder = str(tmp_path / "again")
    assert regenerate.write(folder) == LOGICAL
    committed = rank_files(str(GOLDEN / "two_ranks"))
    assert sorted(committed) == ["index.safetensors",
                                 "rank-00000-of-00002.c9106d689d44afe2134a281be0dcc43b.safetensors",
                                 "rank-00001-of-00002.4f3a23ced5594aefa561de2d83c2912f.safetensors"]
    assert rank_files(folder) == committed, (
        "the bytes of a sharded checkpoint changed: a layout change must bump LAYOUT_VERSION, update "
        "docs/FORMAT.md §14 and run tests/golden/sharded/regenerate.py --layout-change")


def test_the_committed_checkpoint_reads_back(tmp_path):
    folder = str(GOLDEN / "two_ranks")
    full = {"step": 1, "w": torch.arange(6, dtype=torch.float32).reshape(3, 2)}
    assert tensorcanon.fingerprint(full) == LOGICAL == tcd.verify(folder)
    assert tensorcanon.verify(str(GOLDEN / "two_ranks" / "index.safetensors")) == INDEX
    assert not tensorcanon.diff(full, tcd.load_unsharded(folder))
    assert tcd.load_unsharded(folder, rank=1)["rng"] == 1
    index = tensorcanon.load(str(GOLDEN / "two_ranks" / "index.safetensors"))
    assert index["chunks"] == [[[0, [0, 0], [2, 2]], [1, [2, 0], [1, 2]]]]
    assert index["per_rank"] == [("rng",)] and index["layout"] == 1 and index["format"] == "tensorcanon-sharded"
    one = tmp_path / "full.safetensors"
    one.write_bytes(tensorcanon.dumps(full))
    with tensorcanon.open(str(one)) as f:
        assert index["logical"] == f.manifest.raw      # the logical manifest is dumps(full)'s manifest


def test_the_version_2_checkpoint_still_reads_back():
    """Written by the format-version-2 writer: the same layout, files of format version 2 (its
    logical manifest says 2); every reader still reads and verifies it (docs/FORMAT.md §14)."""
    folder = str(GOLDEN / "two_ranks_v2")
    full = {"step": 1, "w": torch.arange(6, dtype=torch.float32).reshape(3, 2)}
    assert tcd.verify(folder) == LOGICAL_V2
    assert tensorcanon.verify(str(GOLDEN / "two_ranks_v2" / "index.safetensors")) == INDEX_V2
    assert not tensorcanon.diff(full, tcd.load_unsharded(folder))
    assert tcd.load_unsharded(folder, rank=1)["rng"] == 1
    index = tensorcanon.load(str(GOLDEN / "two_ranks_v2" / "index.safetensors"))
    assert index["layout"] == 1 and index["logical"][-1:] == b"\x02"  # the logical manifest's version
