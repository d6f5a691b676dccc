"""Per-rank state, async_save (thread executor), numpy arrays and other values (threaded tier)."""

from __future__ import annotations

import collections
import dataclasses
import os

import numpy as np
import pytest
import torch

import tensorcanon
import tensorcanon.dcp as tcd
from tensorcanon.dcp import _compat
from tensorcanon.sharded import layout

from helpers import rank_files, unsharded, zeros_like_state
from states import logical_digest, sharded_state
from threaded import run_ranks


def test_each_rank_gets_its_own_generator_back(tmp_path):
    """Threads share torch's global generator, so this tier uses one generator per rank;
    test_spawned.py round-trips each process's whole RngState."""
    folder = str(tmp_path / "rng")

    def save_then_load(rank):
        gen = torch.Generator().manual_seed(7 * rank)
        torch.rand(5, generator=gen)                       # advance it
        state = {"w": torch.zeros(2), "gen": tcd.PerRank(gen), "sampler": {"epoch": 3, "pos": tcd.PerRank(17 + rank)}}
        digest = tcd.save(state, folder)
        expected_next = torch.rand(4, generator=gen)       # what this rank draws next
        target = {"w": torch.ones(2), "gen": tcd.PerRank(None), "sampler": {"epoch": 0, "pos": None}}
        wrapper = target["gen"]
        tcd.load(target, folder)
        assert target["gen"] is wrapper                    # the wrapper is kept, its value replaced
        return digest, torch.equal(torch.rand(4, generator=target["gen"].value), expected_next), \
            target["sampler"]["pos"], target["gen"].value.initial_seed()

    got = run_ranks(3, save_then_load)
    assert len({g[0] for g in got}) == 1
    assert [g[1:] for g in got] == [(True, 17 + r, 7 * r) for r in range(3)]
    assert tcd.logical_digest(folder) == tensorcanon.fingerprint({"w": torch.zeros(2), "sampler": {"epoch": 3}})


def test_per_rank_state_with_another_world_size(tmp_path):
    folder = str(tmp_path / "resize")
    run_ranks(2, lambda r: tcd.save({"w": torch.zeros(2), "opt": {"seed": tcd.PerRank(r)}}, folder))

    def load(rank, **kw):
        target = {"w": torch.ones(2), "opt": {"seed": tcd.PerRank(-1)}}
        try:
            tcd.load(target, folder, **kw)
        except tensorcanon.TensorCanonError as e:
            return e
        return target["opt"]["seed"].value, target["w"].tolist()

    errors = run_ranks(3, load)
    assert all(isinstance(e, tensorcanon.UsageError) for e in errors)
    text = str(errors[0])
    assert '$["opt"]["seed"]' in text and "saved by 2 ranks" in text and "keep_per_rank_on_resize" in text
    assert run_ranks(3, lambda r: load(r, keep_per_rank_on_resize=True)) == [(-1, [0.0, 0.0])] * 3
    assert run_ranks(2, load) == [(0, [0.0, 0.0]), (1, [0.0, 0.0])]


def test_per_rank_values_must_sit_in_dicts(tmp_path):
    def save(rank):
        try:
            tcd.save({"runs": (tcd.PerRank(rank),)}, str(tmp_path / "t"))
        except tensorcanon.TensorCanonError as e:
            return e

    errors = run_ranks(2, save)
    assert all(isinstance(e, tensorcanon.UnsupportedTypeError) and "PerRank" in str(e) for e in errors)


def test_async_save_thread_gives_the_same_files_and_ignores_later_changes(tmp_path):
    """One process (the threaded group has no CPU device type, which async_save requires;
    test_spawned.py runs both executors on gloo across processes)."""
    from states import logical_state

    sync_dir, async_dir = str(tmp_path / "sync"), str(tmp_path / "async")
    tcd.save(logical_state(), sync_dir)
    state = logical_state()
    fut = tcd.async_save(state, async_dir, executor="thread")
    # Staging copied the state before async_save returned: these changes must not be saved.
    state["model"]["layer.weight"].fill_(123.0)
    state["extra"]["plain"].fill_(-1.0)
    state["step"] = -1
    assert fut.result(timeout=60) == logical_digest()
    assert rank_files(sync_dir) == rank_files(async_dir)


def test_async_save_failure_is_the_librarys_error(tmp_path):
    fut = tcd.async_save({"bad": object()}, str(tmp_path / "bad"))
    with pytest.raises(tensorcanon.UnsupportedTypeError, match=r'\$\["bad"\]'):
        fut.result(timeout=60)


def test_bad_executor_name():
    with pytest.raises(tensorcanon.UsageError, match="executor"):
        tcd.async_save({}, "unused", executor="fork")


def test_the_process_executor_is_used_where_dcp_has_it_and_refused_where_not(tmp_path):
    if _compat.AsyncCheckpointerType is not None:  # torch >= 2.7 (test_spawned.py saves with it too)
        process = _compat.AsyncCheckpointerType.PROCESS
        assert _compat.async_kwargs("process") == {"async_checkpointer_type": process}
        assert _compat.async_kwargs(process) == {"async_checkpointer_type": process}
        return
    with pytest.raises(tensorcanon.UsageError, match=r"executor='process' needs torch >= 2\.7") as e:
        tcd.async_save({"w": torch.ones(2)}, str(tmp_path / "p"), executor="process")
    assert torch.__version__ in str(e.value) and "executor='thread'" in str(e.value)
    assert not (tmp_path / "p").exists()


def test_dcp_async_save_with_the_writer_stages_faithfully(tmp_path):
    """dcp.async_save called directly with the Writer: whichever stager runs (DCP's own, or
    on a DCP whose staging is lossy the Writer itself), the files are those of a plain save,
    OrderedDict metadata included, and changes made after the call are not saved."""
    import torch.distributed.checkpoint as dcp

    from states import logical_state

    sync_dir, async_dir = str(tmp_path / "sync"), str(tmp_path / "async")
    tcd.save(logical_state(), sync_dir)
    state = logical_state()
    got = dcp.async_save(state, storage_writer=tcd.Writer(async_dir), planner=tcd.SavePlanner())
    state["model"]["layer.weight"].fill_(5.0)
    state["model"]._metadata[""]["version"] = 99
    got = got.upload_completion if hasattr(got, "upload_completion") else got
    got.result(timeout=60)
    assert rank_files(sync_dir) == rank_files(async_dir)
    assert tcd.verify(async_dir) == logical_digest()


def test_staged_copy_keeps_everything_a_save_records():
    """The staging the Writer does where DCP's own is lossy (torch < 2.9)."""
    from tensorcanon.dcp.staging import staged_copy

    base = torch.arange(12.0)
    weight = torch.nn.Parameter(torch.randn(3, 4), requires_grad=True)
    model = collections.OrderedDict([("w", weight), ("tied", weight), ("view", base[2:6]), ("whole", base)])
    model._metadata = {"": {"version": 3}}
    state = {"model": model, "pair": (base, "x"), "grad": torch.ones(2).requires_grad_(), "n": [1, {2}],
             "own": tcd.PerRank(torch.zeros(2)), "array": np.arange(3)}
    staged = staged_copy(state)
    plain = {k: v for k, v in state.items() if k != "own"}
    assert tensorcanon.dumps({k: v for k, v in staged.items() if k != "own"}) == tensorcanon.dumps(plain)
    m = staged["model"]
    assert type(m) is collections.OrderedDict and m._metadata == {"": {"version": 3}}
    assert m["w"] is m["tied"] and type(m["w"]) is torch.nn.Parameter and m["w"].requires_grad
    assert m["view"].untyped_storage().data_ptr() == m["whole"].untyped_storage().data_ptr() == \
        staged["pair"][0].untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    assert staged["grad"].requires_grad and type(staged["own"]) is tcd.PerRank
    assert staged["own"].value is not state["own"].value and torch.equal(staged["own"].value, torch.zeros(2))
    base.fill_(-1.0)
    weight.data.fill_(0.0)
    state["n"][1].add(3)
    assert torch.equal(m["whole"], torch.arange(12.0)) and m["w"].abs().sum() > 0 and staged["n"] == [1, {2}]


def test_staged_copy_stages_what_a_tensor_reads_and_copies_sparse_and_meta_tensors():
    from tensorcanon.dcp.staging import staged_copy

    z = torch.tensor([1 + 2j, 3 - 1j])
    x = torch.arange(4.0)
    sparse = torch.eye(2).to_sparse()
    state = {"conj": z.conj(), "neg": x._neg_view(), "sparse": sparse, "meta": torch.empty(2, device="meta")}
    staged = staged_copy(state)
    assert torch.equal(staged["conj"], z.conj()) and not staged["conj"].is_conj()
    assert torch.equal(staged["neg"], -x) and not staged["neg"].is_neg()
    z.zero_()
    x.zero_()
    assert torch.equal(staged["conj"], torch.tensor([1 - 2j, 3 + 1j]))
    assert torch.equal(staged["neg"], -torch.arange(4.0))
    # sparse and meta tensors are saved (FORMAT.md §6.12): staged as copies of their own
    assert staged["sparse"] is not sparse and staged["meta"].is_meta and staged["meta"] is not state["meta"]
    expected = tensorcanon.dumps({"sparse": torch.eye(2).to_sparse()})
    sparse._values().zero_()
    assert tensorcanon.dumps({"sparse": staged["sparse"]}) == expected
    assert tensorcanon.dumps({"c": staged["conj"], "n": staged["neg"]}) == \
        tensorcanon.dumps({"c": torch.tensor([1 - 2j, 3 + 1j]), "n": -torch.arange(4.0)})


@dataclasses.dataclass
class Schedule:
    warmup: int
    factors: torch.Tensor


def test_values_of_every_kind_round_trip(tmp_path):
    tensorcanon.register(Schedule)
    try:
        folder = str(tmp_path / "kinds")
        arr = np.arange(12, dtype=">i4").reshape(3, 4)      # big-endian: stored little-endian
        state = {
            "arrays": {"a": arr, "f16": np.linspace(0, 1, 5, dtype=np.float16), "zero": np.zeros(())},
            "odd keys": {1: "int", (1, "t"): "tuple", None: "none", b"b": "bytes", 2.5: "float"},
            "schedule": Schedule(3, torch.tensor([0.5, 0.25])),
            "values": [complex(1, 2), np.float32(1.5), torch.float8_e4m3fn, torch.device("cpu"), frozenset({3})],
            "exotic": torch.arange(8, dtype=torch.uint8).view(torch.float8_e5m2),
            "c128": torch.randn(3, dtype=torch.complex128),
        }
        digest = run_ranks(2, lambda r: tcd.save(state, folder))[0]
        assert digest == tensorcanon.fingerprint(state)
        full = tcd.load_unsharded(folder)
        assert not tensorcanon.diff(state, full)
        assert full["arrays"]["a"].dtype == np.dtype("<i4") and type(full["schedule"]) is Schedule

        def load(rank):
            target = {"arrays": {"a": np.zeros((3, 4), dtype="<i4"), "f16": None, "zero": None},
                      "odd keys": {1: None, (1, "t"): None}, "schedule": None, "values": None,
                      "exotic": torch.zeros(8, dtype=torch.float8_e5m2), "c128": torch.zeros(3, dtype=torch.complex128)}
            array = target["arrays"]["a"]
            tcd.load(target, folder)
            return (target["arrays"]["a"] is array and np.array_equal(array, arr),
                    target["odd keys"], target["schedule"].warmup,
                    torch.equal(target["exotic"].view(torch.uint8), torch.arange(8, dtype=torch.uint8)),
                    torch.equal(target["c128"], state["c128"]))

        assert run_ranks(2, load) == [(True, {1: "int", (1, "t"): "tuple"}, 3, True, True)] * 2
    finally:
        tensorcanon.unregister(Schedule)


def test_tied_targets_that_are_separate_objects_are_each_filled(tmp_path):
    folder = str(tmp_path / "tie")

    def run(rank):
        state = sharded_state(2, rank)
        tcd.save(state, folder)
        target = zeros_like_state(state)
        # Untie the target: two separate DTensors where the checkpoint has one tensor.
        from helpers import DTensor

        t = target["model"]["embed.weight"]
        target["model"]["embed.weight"] = DTensor.from_local(torch.zeros_like(t.to_local()), t.device_mesh,
                                                             t.placements, shape=t.shape, stride=t.stride())
        tcd.load(target, folder)
        a, b = target["model"]["head.weight"], target["model"]["embed.weight"]
        return a is not b and torch.equal(a.full_tensor(), b.full_tensor()) and \
            torch.equal(a.full_tensor(), state["model"]["head.weight"].full_tensor())

    assert run_ranks(2, run) == [True, True]


def test_meta_device_targets_are_materialized(tmp_path):
    folder = str(tmp_path / "meta")
    run_ranks(2, lambda r: tcd.save(sharded_state(2, r), folder))

    def load(rank):
        target = zeros_like_state(sharded_state(2, rank))
        target["extra"]["plain"] = torch.empty(3, device="meta")
        tcd.load(target, folder)
        return target["extra"]["plain"].device.type, tensorcanon.fingerprint(unsharded(target))

    assert run_ranks(2, load) == [("cpu", logical_digest())] * 2


def test_index_holds_no_path_uuid_or_device(tmp_path):
    folder = str(tmp_path / "nothing-personal")
    run_ranks(2, lambda r: tcd.save(sharded_state(2, r), folder))
    index = tensorcanon.load(os.path.join(folder, layout.INDEX_NAME))
    assert sorted(index) == ["chunks", "files", "format", "layout", "logical", "per_rank"]
    raw = open(os.path.join(folder, layout.INDEX_NAME), "rb").read()
    for word in (b"nothing-personal", b"tmp", b"uuid", b"cpu", os.uname().nodename.encode()):
        assert word not in raw
    assert index["per_rank"] == [("rng",)]
    assert isinstance(collections.OrderedDict, type)
