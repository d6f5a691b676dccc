"""The layout's building blocks: tiling, names, and an index that lies (no process group needed)."""

from __future__ import annotations

import itertools
import os
import random
import shutil

import pytest
import torch

import tensorcanon
import tensorcanon.dcp as tcd
from tensorcanon.sharded import layout, tiling
from tensorcanon.sharded.tiling import Box


def _grid(shape, cuts):
    dims = []
    for n, c in zip(shape, cuts, strict=True):
        points = [0, *sorted(c), n]
        dims.append([(points[i], points[i + 1] - points[i]) for i in range(len(points) - 1)])
    return [Box(tuple(o for o, _ in combo), tuple(s for _, s in combo)) for combo in itertools.product(*dims)]


def test_runs_visit_every_element_once_in_c_order():
    rng = random.Random(1)
    for _ in range(400):
        shape = tuple(rng.randint(0, 5) for _ in range(rng.randint(0, 4)))
        boxes = _grid(shape, [rng.choices(range(n + 1), k=rng.randint(0, 3)) for n in shape])
        rng.shuffle(boxes)
        full = torch.arange(torch.Size(shape).numel()).reshape(shape)
        pieces = [full[tuple(slice(o, o + s) for o, s in zip(b.offsets, b.sizes, strict=True))].reshape(-1)
                  for b in boxes]
        tiling.check(shape, boxes, "t")
        runs = list(tiling.runs(shape, boxes))
        got = (torch.cat([pieces[j][start:start + n] for j, start, n in runs]) if runs
               else torch.empty(0, dtype=torch.long))
        assert torch.equal(got, full.reshape(-1)), (shape, boxes)
        for (j1, s1, n1), (j2, s2, _) in itertools.pairwise(runs):
            assert not (j1 == j2 and s1 + n1 == s2)  # adjacent runs of one chunk are merged


def test_a_split_along_dimension_0_is_one_run_per_chunk():
    boxes = [Box((0, 0), (3, 8)), Box((3, 0), (3, 8)), Box((6, 0), (0, 8))]
    assert list(tiling.runs((6, 8), boxes)) == [(0, 0, 24), (1, 0, 24)]


@pytest.mark.parametrize("shape, boxes, words", [
    ((4,), [Box((0,), (2,)), Box((1,), (3,))], "overlap or are missing"),
    ((4,), [Box((0,), (3,))], "overlap or are missing"),
    ((4,), [Box((2,), (3,))], "outside the tensor"),
    ((2, 2), [Box((0,), (2,))], "wrong number of dimensions"),
    ((2, 2), [Box((0, 0), (1, 2)), Box((0, 0), (1, 2))], "overlap"),
    ((2, 2), [Box((0, 0), (2, 2)), Box((1, 1), (1, 1)), Box((0, 1), (1, 1))], "overlap or are missing"),
])
def test_bad_tilings_are_refused(shape, boxes, words):
    with pytest.raises(tensorcanon.FormatError, match=words):
        tiling.check(shape, boxes, "tensor 'x'")


def test_names():
    assert layout.chunk_key("model.w", (128, 0)) == "model.w@128,0"
    assert layout.chunk_key("step", ()) == "step@"
    assert layout.per_rank_keys([("rng",), ("a", 1), ("a.1",)]) == ["rng@rank", "a.1@rank", "a.1~1@rank"]
    name = layout.rank_file_name(3, 12, "xxh3-128:" + "ab" * 16)
    assert name == "rank-00003-of-00012." + "ab" * 16 + ".safetensors" and layout.RANK_FILE_RE.fullmatch(name)


# ---------------------------------------------------------------------------- lying indexes


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("idx") / "ckpt")
    tcd.save({"w": torch.arange(6.0).reshape(3, 2), "step": 1, "rng": tcd.PerRank(b"r")}, folder)
    return folder


def _with_index(one_rank, tmp_path, change):
    folder = str(tmp_path / "lying")
    shutil.copytree(one_rank, folder)
    path = os.path.join(folder, layout.INDEX_NAME)
    index = tensorcanon.load(path)
    change(index)
    tensorcanon.save(index, path, algorithm=index.pop("_algorithm", "xxh3-128"))
    return folder


class _opened:
    """The manifest bytes of a file made of ``data`` (written to a temporary file)."""

    def __init__(self, data):
        import tempfile

        with tempfile.NamedTemporaryFile(suffix=".safetensors", delete=False) as fh:
            fh.write(data)
            self.path = fh.name

    def __enter__(self):
        with tensorcanon.open(self.path) as f:
            return f.manifest.raw

    def __exit__(self, *exc):
        os.unlink(self.path)


@pytest.mark.parametrize("change, words", [
    (lambda i: i.pop("per_rank"), "exactly the keys"),
    (lambda i: i.update(format="dcp"), "not a sharded checkpoint index"),
    (lambda i: i.update(layout=2), "layout version 2 is not supported"),
    (lambda i: i.update(layout=True), "layout version True"),
    (lambda i: i.update(logical="text"), "'logical' must be bytes"),
    (lambda i: i.update(logical=i["logical"][:-1]), "logical manifest"),
    (lambda i: i.update(files=[]), "one digest per rank"),
    (lambda i: i.update(files=["sha256:" + "0" * 64]), "must be a xxh3-128 digest"),
    (lambda i: i.update(chunks=[]), "one list per logical tensor"),
    (lambda i: i.update(chunks=[[[1, [0, 0], [3, 2]]]]), "malformed chunk"),
    (lambda i: i.update(chunks=[[[0, [0, 0], [2, 2]]]]), "overlap or are missing"),
    (lambda i: i.update(chunks=[[[0, [1, 0], [2, 2]], [0, [0, 0], [1, 2]]]]), "canonical order"),
    (lambda i: i.update(chunks=[[[0, [0, 0], [3, 2.0]]]]), "malformed chunk"),
    (lambda i: i.update(per_rank=[["rng"]]), "key tuples"),
    (lambda i: i.update(per_rank=[("b",), ("a",)]), "canonical order"),
    (lambda i: i.update(_algorithm="sha256"), "uses sha256 digests but its logical manifest uses xxh3-128"),
])
def test_an_index_that_lies_is_refused(one_rank, tmp_path, change, words):
    folder = _with_index(one_rank, tmp_path, change)
    with pytest.raises(tensorcanon.FormatError, match=words) as info:
        layout.read(folder)
    assert layout.INDEX_NAME in str(info.value)


def test_an_index_that_swaps_the_logical_manifest_fails_verification(one_rank, tmp_path):
    """A well-formed logical manifest of other content: the recomputed digests disagree."""
    with _opened(tensorcanon.dumps({"step": 1, "w": torch.zeros(3, 2)})) as raw:
        folder = _with_index(one_rank, tmp_path, lambda i: i.update(logical=raw))
    assert layout.read(folder).logical_digest == tensorcanon.fingerprint({"step": 1, "w": torch.zeros(3, 2)})
    with pytest.raises(tensorcanon.IntegrityError, match="logical digest"):
        tcd.verify(folder)
    with pytest.raises(tensorcanon.IntegrityError):
        tcd.load_unsharded(folder)


def test_a_plain_file_or_a_rank_file_is_not_an_index(one_rank, tmp_path):
    folder = str(tmp_path / "swap")
    shutil.copytree(one_rank, folder)
    rank_file = layout.read(folder).file_path(0)
    shutil.copy(rank_file, os.path.join(folder, layout.INDEX_NAME))
    with pytest.raises(tensorcanon.FormatError, match="holds no tensors"):
        layout.read(folder)
    with pytest.raises(tensorcanon.FormatError, match="a file, not a sharded checkpoint"):
        layout.read(rank_file)
