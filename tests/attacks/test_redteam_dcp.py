"""Red-team attacks on the DCP surface (docs/SECURITY.md "The DCP surface: an index handed to
torch.distributed.checkpoint", docs/DISTRIBUTED.md, FORMAT.md §14), written from the docs alone.

The attacker owns the whole checkpoint directory: it rewrites the index (an ordinary tensorcanon
file, so forged by saving a changed dict) and the rank files, and records their new digests, so
every file digest matches and only the attacked rule is broken. The attacks go beyond
tests/dcp/test_hostile_index.py (per-rank paths, claimed dense shapes) to the tensor kinds in a
logical manifest (meta tensors described to DCP, sparse and jagged parts whose index values lie),
chunk bounds and types, rank-file chunks that disagree with their chunk, numpy string widths, and
partial loads.

Every directory is read by every reader in a worker process (tests/attacks/kinds_probe.py: address
space capped at 2 GiB above its start, restarted if it dies), which reports each reader's outcome.
The promise (SECURITY.md): each failure is a tensorcanon error naming the index or rank file and
what is wrong, no reader allocates what the index merely claims, and ``verify`` passing implies
every load succeeding.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import warnings

import msgpack
import pytest
import torch
from test_redteam_kinds import Worker, forge

import tensorcanon
import tensorcanon.dcp as tcd
from tensorcanon.format import manifest

import hostile_lib as h

warnings.filterwarnings("ignore", message=".*(Sparse|sparse|nested|prototype|process group).*")
for _name in ("dcp_logger", "c10d-NullHandler-dcp_logger"):  # DCP logs every step of every save
    logging.getLogger(_name).setLevel(logging.CRITICAL)

INDEX = "index.safetensors"

READERS = r"""
import json, os, warnings
warnings.simplefilter("ignore")
import tensorcanon.dcp as tcd
import torch.distributed.checkpoint as dcp
from tensorcanon.dcp import _compat
folder = {folder!r}
target = {target}

def from_keys():
    if _compat.load_state_dict_from_keys is None:
        return dcp.load({{k: None for k in target}}, storage_reader=tcd.Reader(folder),
                        planner=dcp.DefaultLoadPlanner())
    return _compat.load_state_dict_from_keys(set(target), storage_reader=tcd.Reader(folder))

def default_planner():
    return dcp.load(dict(target), storage_reader=tcd.Reader(folder), planner=dcp.DefaultLoadPlanner())

calls = {{
    "verify": lambda: tcd.verify(folder),
    "tensorcanon.verify": lambda: tensorcanon.verify(folder),
    "load_unsharded": lambda: tcd.load_unsharded(folder),
    "load_unsharded_rank": lambda: tcd.load_unsharded(folder, rank=0),
    "load": lambda: tcd.load(dict(target), folder, allow_partial_load=True),
    "consolidate": lambda: tcd.consolidate(folder, folder + ".one.safetensors"),
    "diff": lambda: tensorcanon.diff(folder, folder),
    "from_keys": from_keys,
    "DefaultLoadPlanner": default_planner,
}}
out = {{}}
for name, call in calls.items():
    try:
        call()
    except BaseException as e:
        e = tcd.api.unwrap(e)
        out[name] = [type(e).__name__, str(e)[:600], isinstance(e, tensorcanon.TensorCanonError)]
    else:
        out[name] = "ok"
result = json.dumps(out)
"""

ALL = ("verify", "tensorcanon.verify", "load_unsharded", "load_unsharded_rank", "load", "consolidate", "diff",
       "from_keys", "DefaultLoadPlanner")


@pytest.fixture(scope="module")
def worker():
    w = Worker()
    yield w
    w.close()


def readers(worker: Worker, folder: str, target: str = "{'w': None}") -> dict:
    answer = worker.ask({"op": "call", "code": READERS.format(folder=folder, target=target)})
    assert "died" not in answer, answer["died"]
    assert answer["ok"], answer
    return json.loads(eval(answer["result"]))  # the repr of a JSON str


def _state() -> dict:
    return {"w": torch.arange(6.0).reshape(3, 2), "step": 3, "rng": tcd.PerRank(7),
            "s": torch.eye(3).to_sparse(), "m": torch.empty(4, device="meta"),
            "n": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("reddcp") / "ckpt")
    tcd.save(_state(), folder)
    return folder


def _row_digest(t: torch.Tensor) -> bytes:
    """The tensor digest (FORMAT.md §7.1) of ``t``: its row's digest in a file of its own."""
    return h.manifest_of(tensorcanon.dumps({"x": t}))[0]["tensors"][0]["digest"]


class Forge:
    """A copy of ``base`` to rewrite: the index as a dict, its logical manifest as a dict, the one
    rank file's content as a dict; ``write()`` saves them back with every digest and name valid."""

    def __init__(self, base: str, folder: str) -> None:
        shutil.copytree(base, folder)
        self.folder = folder
        self.index = tensorcanon.load(os.path.join(folder, INDEX))
        assert len(self.index["files"]) == 1
        self.logical = manifest.unpack(self.index["logical"])[0]
        self.logical = {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.logical.items()}
        self.logical["tensors"] = [dict(r) for r in self.logical["tensors"]]
        self.rank_path = os.path.join(folder, self._rank_name())
        self.rank = tensorcanon.load(self.rank_path)
        self.rank_bytes: bytes | None = None

    def _rank_name(self) -> str:
        return f"rank-00000-of-00001.{self.index['files'][0].split(':')[1]}.safetensors"

    def row(self, name: str) -> dict:
        return next(r for r in self.logical["tensors"] if r["name"] == name)

    def replace_tensor(self, name: str, t: torch.Tensor) -> None:
        """The logical tensor ``name`` (stored whole, as one chunk) becomes ``t``: its row, its
        chunk and the rank file's chunk all say so."""
        i = next(i for i, r in enumerate(self.logical["tensors"]) if r["name"] == name)
        row = self.logical["tensors"][i]
        row["shape"], row["digest"] = list(t.shape), _row_digest(t)
        row["dtype"] = str(t.dtype).removeprefix("torch.")
        key = next(k for k in self.rank if k.startswith(name + "@"))
        del self.rank[key]
        self.rank[f"{name}@{','.join('0' * 1 for _ in t.shape)}"] = t
        self.index["chunks"][i] = [[0, [0] * t.dim(), list(t.shape)]]

    def write(self) -> str:
        os.unlink(self.rank_path)
        tmp = os.path.join(self.folder, "tmp")
        if self.rank_bytes is not None:
            with open(tmp, "wb") as f:
                f.write(self.rank_bytes)
            self.index["files"][0] = h.split(self.rank_bytes)[0]["__metadata__"]["tensorcanon.digest"]
        else:
            self.index["files"][0] = tensorcanon.save(self.rank, tmp)
        os.rename(tmp, os.path.join(self.folder, self._rank_name()))
        self.index["logical"] = msgpack.packb(self.logical, use_bin_type=True)
        tensorcanon.save(self.index, os.path.join(self.folder, INDEX))
        return self.folder


def set_root(f: Forge, key: str, node) -> None:
    root = list(f.logical["root"])
    i = root.index(key)
    root[i + 1] = node
    f.logical["root"] = root


def assert_all_refuse(outcomes: dict, *words: str | tuple, only=ALL) -> None:
    """Every reader of ``only`` refused with a tensorcanon error whose message holds each of ``words``
    (a tuple: one of its strs)."""
    for name in only:
        got = outcomes[name]
        assert got != "ok", f"{name} accepted the forged checkpoint"
        cls, msg, ours = got
        assert ours, f"{name} raised a foreign {cls}: {msg}"
        for w in words:
            assert any(x in msg for x in ((w,) if isinstance(w, str) else w)), f"{name}: {cls}: {msg}"


def assert_consistent(outcomes: dict) -> None:
    """No reader raises a foreign exception, and if verify passes every load succeeds."""
    for name, got in outcomes.items():
        assert got == "ok" or got[2], f"{name} raised a foreign {got[0]}: {got[1]}"
    if outcomes["verify"] == "ok":
        for name in ("load_unsharded", "load_unsharded_rank", "consolidate", "diff"):
            assert outcomes[name] == "ok", f"verify passed, then {name} raised {outcomes[name]}"


# ------------------------------------------------------------------ the base checkpoint is sound


def test_the_base_checkpoint_loads_on_every_path(worker, base):
    outcomes = readers(worker, base, "{'w': torch.empty(3, 2)}")
    assert {k: v for k, v in outcomes.items() if v != "ok"} == {}


# ------------------------------------------------------------------ tensor kinds in the logical manifest


def test_a_meta_tensor_claiming_a_terabyte_is_never_allocated(worker, base, tmp_path):
    """A meta tensor has no chunk and no row, so no rank file bounds its size: an index may give it
    2^37 x 2 float32 (1 TiB). It is a meta tensor, not a claim of bytes: no reader may build it
    with memory, including DCP's planners, which build ``torch.empty(shape)`` for what
    ``read_metadata`` describes."""
    f = Forge(base, str(tmp_path / "ckpt"))
    set_root(f, "m", ["meta", "float32", ["size", 2**37, 2], "tensor", False])
    folder = f.write()
    outcomes = readers(worker, folder, "{'m': None}")
    assert_consistent(outcomes)
    for name in ("from_keys", "DefaultLoadPlanner", "load"):
        assert outcomes[name] == "ok" or "MemoryError" not in outcomes[name][0], outcomes[name]
    assert outcomes["verify"] == "ok" and outcomes["load_unsharded"] == "ok", outcomes


def test_a_meta_tensor_of_a_size_no_tensor_can_have_is_refused(worker, base, tmp_path):
    f = Forge(base, str(tmp_path / "ckpt"))
    set_root(f, "m", ["meta", "float32", ["size", 2**62, 2**62], "tensor", False])
    outcomes = readers(worker, f.write(), "{'m': None}")
    assert_all_refuse(outcomes, INDEX, only=("verify", "load_unsharded", "consolidate", "from_keys"))


@pytest.mark.parametrize("indices", [[[0, 1, 5], [0, 1, 2]], [[0, 1, 2], [0, -1, 2]], [[0, 0, 2], [1, 1, 2]]],
                         ids=["past_size", "negative", "repeated"])
def test_sparse_parts_whose_indices_lie_are_refused_by_every_reader(worker, base, tmp_path, indices):
    f = Forge(base, str(tmp_path / "ckpt"))
    f.replace_tensor("s.indices", torch.tensor(indices))
    outcomes = readers(worker, f.write(), "{'s': None}")
    # every reader, DCP's own planners included (which name the value as DCP does: 's')
    assert_all_refuse(outcomes, ('$["s"]', "the value 's'"))
    assert_consistent(outcomes)


@pytest.mark.parametrize("offsets", [[0, 3, 2], [1, 2, 5], [0, 2, 9]], ids=["decreasing", "not_zero", "past_rows"])
def test_jagged_offsets_that_lie_are_refused_by_every_reader(worker, base, tmp_path, offsets):
    f = Forge(base, str(tmp_path / "ckpt"))
    f.replace_tensor("n.offsets", torch.tensor(offsets))
    outcomes = readers(worker, f.write(), "{'n': None}")
    assert_all_refuse(outcomes, ('$["n"]', "the value 'n'"))  # every reader, DCP's own planners included
    assert_consistent(outcomes)


def test_a_string_array_claiming_gigabytes_in_the_index_is_refused_before_allocating(worker, base, tmp_path):
    f = Forge(base, str(tmp_path / "ckpt"))
    set_root(f, "step", ["np.strings", "U", 2**28, 1, 64, *["a"] * 64])
    outcomes = readers(worker, f.write(), "{'step': None}")
    assert_consistent(outcomes)
    for name, got in outcomes.items():
        assert got == "ok" or "MemoryError" not in got[0], (name, got)
    assert_all_refuse(outcomes, INDEX, '$["step"]', only=("verify", "load_unsharded", "consolidate"))


# ------------------------------------------------------------------ chunks


def _chunks(change):
    def edit(f: Forge) -> None:
        i = next(i for i, r in enumerate(f.logical["tensors"]) if r["name"] == "w")
        f.index["chunks"][i] = change
    return edit


CHUNK_ATTACKS = {
    "past_the_end": [[0, [1, 0], [3, 2]]],
    "negative_offset": [[0, [-1, 0], [3, 2]]],
    "negative_size": [[0, [0, 0], [-3, 2]]],
    "rank_out_of_range": [[1, [0, 0], [3, 2]]],
    "rank_negative": [[-1, [0, 0], [3, 2]]],
    "rank_is_bool": [[False, [0, 0], [3, 2]]],
    "offsets_of_another_rank": [[0, [0], [3, 2]]],
    "offsets_floats": [[0, [0.0, 0.0], [3, 2]]],
    "offsets_bigint": [[0, [2**70, 0], [3, 2]]],
    "overlapping": [[0, [0, 0], [2, 2]], [0, [1, 0], [2, 2]]],
    "gap": [[0, [0, 0], [2, 2]]],
    "empty_list": [],
    "not_a_list": 5,
    "chunk_too_short": [[0, [0, 0]]],
}


@pytest.mark.parametrize("name", list(CHUNK_ATTACKS))
def test_chunk_lists_that_lie_are_refused_naming_the_index(worker, base, tmp_path, name):
    f = Forge(base, str(tmp_path / "ckpt"))
    _chunks(CHUNK_ATTACKS[name])(f)
    outcomes = readers(worker, f.write(), "{'w': None}")
    assert_all_refuse(outcomes, INDEX)


def test_a_chunk_list_for_each_table_row_no_more_no_fewer(worker, base, tmp_path):
    f = Forge(base, str(tmp_path / "ckpt"))
    f.index["chunks"] = f.index["chunks"][:-1]
    assert_all_refuse(readers(worker, f.write()), INDEX)
    g = Forge(base, str(tmp_path / "ckpt2"))
    g.index["chunks"] = g.index["chunks"] + [g.index["chunks"][-1]]
    assert_all_refuse(readers(worker, g.write()), INDEX)


# ------------------------------------------------------------------ rank files that disagree with their chunks


def _rank_chunk(t: torch.Tensor):
    def edit(f: Forge) -> None:
        f.rank["w@0,0"] = t  # the logical row and the chunk still say float32 [3, 2]
    return edit


RANK_ATTACKS = {
    "dtype_int32_same_bytes": torch.arange(6, dtype=torch.int32).reshape(3, 2),
    "shape_transposed": torch.arange(6.0).reshape(2, 3),
    "shape_fewer_rows": torch.arange(4.0).reshape(2, 2),
    "a_parameter": torch.nn.Parameter(torch.arange(6.0).reshape(3, 2)),
    "requires_grad": torch.arange(6.0).reshape(3, 2).requires_grad_(),
    "sparse_chunk": torch.arange(6.0).reshape(3, 2).to_sparse(),
    "meta_chunk": torch.empty(3, 2, device="meta"),
    "not_a_tensor": 5,
}


@pytest.mark.parametrize("name", list(RANK_ATTACKS))
def test_a_rank_file_chunk_unlike_its_chunk_is_refused_naming_it(worker, base, tmp_path, name):
    """FORMAT.md §14.2: a chunk key's value is a tensor of kind ``tensor``, ``requires_grad`` false,
    the logical tensor's dtype and the chunk's sizes as shape."""
    f = Forge(base, str(tmp_path / "ckpt"))
    _rank_chunk(RANK_ATTACKS[name])(f)
    outcomes = readers(worker, f.write(), "{'w': torch.empty(3, 2)}")
    assert_all_refuse(outcomes, "tensor 'w' chunk at offsets [0, 0]",
                      only=("verify", "tensorcanon.verify", "load_unsharded", "consolidate", "load", "from_keys",
                            "DefaultLoadPlanner"))


def test_a_rank_file_with_an_extra_key_fails_verify_and_loads_what_verify_covers(worker, base, tmp_path):
    f = Forge(base, str(tmp_path / "ckpt"))
    f.rank["x@0"] = torch.ones(1)
    outcomes = readers(worker, f.write())
    assert_all_refuse(outcomes, "x@0", only=("verify", "tensorcanon.verify"))
    assert_consistent(outcomes)


def test_a_per_rank_value_with_hostile_sparse_parts_is_refused_naming_the_rank_file(worker, tmp_path):
    folder = str(tmp_path / "ckpt")
    tcd.save({"w": torch.ones(2), "rng": tcd.PerRank(torch.eye(2).to_sparse())}, folder)
    f = Forge(folder, str(tmp_path / "forged"))
    f.rank_bytes = forge([(("rng@rank", "indices"), torch.tensor([[0], [7]])), (("rng@rank", "values"), torch.ones(1)),
                          (("w@0",), torch.ones(2))],
                         ["dict", "rng@rank", ["sparse", "coo", ["size", 2, 2], "tensor", False, ["tensor", 0],
                                               ["tensor", 1]], "w@0", ["tensor", 2]])
    outcomes = readers(worker, f.write())
    assert_all_refuse(outcomes, "rng@rank", only=("verify", "load_unsharded_rank"))
    assert_consistent(outcomes)


# ------------------------------------------------------------------ partial loads


PARTIAL = {
    "shape_differs": ("{'w': torch.empty(2, 2)}", '$["w"]'),
    "dtype_differs": ("{'w': torch.empty(3, 2, dtype=torch.float64)}", '$["w"]'),
    "dense_for_sparse": ("{'s': torch.empty(3, 3)}", '$["s"]'),
    "dense_for_meta": ("{'m': torch.empty(4)}", '$["m"]'),
    "tensor_for_int": ("{'step': torch.empty(1)}", '$["step"]'),
}


@pytest.mark.parametrize("name", list(PARTIAL))
def test_a_partial_load_into_a_target_unlike_the_checkpoint_names_the_path(worker, base, name):
    target, where = PARTIAL[name]
    outcomes = readers(worker, base, target)
    got = outcomes["load"]
    assert got != "ok", f"load put the checkpoint's value into {target}"
    assert got[2] and where in got[1], got
