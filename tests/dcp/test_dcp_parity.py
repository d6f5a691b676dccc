"""What DCP users expect of a storage plugin (issue 22), on the threaded tier: partial loads through
DCP's own entry points, overwrite=False, refusals that name the path, DCP's options, the process
executor's main-script check. The same behaviours across gloo processes: test_spawned.py; under
torchrun: test_docs_examples.py."""

from __future__ import annotations

import os
import shutil
import sys
import types

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import tensorcanon
import tensorcanon.dcp as tcd
from tensorcanon.dcp import _compat
from tensorcanon.sharded import layout

from helpers import flip_byte, rank_files, unsharded, zeros_like_state
from states import logical_state, sharded_state
from threaded import run_ranks


def _error(fn):
    try:
        fn()
    except CheckpointException as e:
        return tcd.api.unwrap(e)
    except BaseException as e:  # noqa: BLE001 - the test looks at it
        return e
    return None


# ------------------------------------------------------------------ partial loads

def test_a_part_of_the_checkpoint_loads_and_a_missing_key_is_named(saved, no_unpickling):
    model_only = tensorcanon.fingerprint({"model": logical_state()["model"]})

    def load(rank):
        target = {"model": zeros_like_state(sharded_state(2, rank))["model"]}
        tcd.load(target, saved)                                   # the model of a model + optim checkpoint
        got = tensorcanon.fingerprint(unsharded(target))
        extra = {"model": zeros_like_state(sharded_state(2, rank))["model"], "lr": 0.5}
        refused = _error(lambda: tcd.load(extra, saved))
        tcd.load(extra, saved, allow_partial_load=True)          # the key the checkpoint lacks keeps its value
        return got, refused, extra["lr"]

    for got, refused, lr in run_ranks(2, load):
        assert got == model_only and lr == 0.5
        assert isinstance(refused, tensorcanon.UsageError) and '$["lr"]' in str(refused)
        assert "allow_partial_load=True" in str(refused)
        assert "(which holds 'cfg', 'extra', 'model', 'optim', 'step' there)" in str(refused)  # quoted once


def test_dcp_default_planner_reads_verified_tensors_and_values_without_pickle(saved, no_unpickling):
    full = logical_state()

    def load(rank):
        zero = zeros_like_state(sharded_state(2, rank))
        target = {"model": zero["model"], "optim": zero["optim"], "extra": zero["extra"], "step": None,
                  "cfg": {"tags": None, "name": None}, "not_saved": 3}   # DCP's planner needs every key
        dcp.load(target, storage_reader=tcd.Reader(saved), planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
        strict = _error(lambda: dcp.load({"not_saved": 1}, storage_reader=tcd.Reader(saved)))
        return unsharded(target), strict

    for got, strict in run_ranks(2, load):
        for k, v in full["model"].items():
            assert torch.equal(got["model"][k], v), k
        assert torch.equal(got["optim"]["state"][0]["exp_avg"], full["optim"]["state"][0]["exp_avg"])
        assert got["optim"]["param_groups"] == full["optim"]["param_groups"]
        assert torch.equal(got["extra"]["pair"][0], full["extra"]["pair"][0]) and got["extra"]["pair"][1] == "text"
        assert (got["extra"]["array"] == full["extra"]["array"]).all()
        assert got["step"] == 42 and got["not_saved"] == 3
        assert got["cfg"] == {"tags": {"a", "b"}, "name": "run-7"}
        assert isinstance(strict, tcd.CheckpointError) and "not_saved" in str(strict)


@pytest.mark.skipif(_compat.load_state_dict_from_keys is None,
                    reason="this torch's DCP has no _load_state_dict_from_keys")
def test_dcp_load_state_dict_from_keys(saved, no_unpickling):
    sd = _compat.load_state_dict_from_keys({"model", "step"}, storage_reader=tcd.Reader(saved))
    assert sorted(sd) == ["model", "step"] and sd["step"] == 42
    assert all(torch.equal(sd["model"][k], v) for k, v in logical_state()["model"].items())
    everything = _compat.load_state_dict_from_keys(storage_reader=tcd.Reader(saved))
    if _compat.TORCH_VERSION < (2, 5):  # torch 2.4 passes `keys or set()` on, so keys=None loads nothing
        assert everything == {}
        return
    assert sorted(everything) == ["cfg", "extra", "model", "optim", "step"]
    assert everything["cfg"]["7"] == b"\x00\x01"                       # DCP's keys are text


def test_dcp_default_planner_gets_the_damage_error(saved, tmp_path):
    folder = str(tmp_path / "damaged")
    shutil.copytree(saved, folder)
    index = layout.read(folder)
    path = index.file_path(1)
    with tensorcanon.open(path) as f:   # the last byte of rank 1's chunk of model.layer.weight
        info = next(i for i in f.manifest.tensors if i.name.startswith("model.layer.weight@"))
        offset = f.header.data_start + info.end - 1
    flip_byte(path, offset, 1)
    errors = run_ranks(2, lambda r: _error(lambda: dcp.load(
        {"model": zeros_like_state(sharded_state(2, r))["model"]}, storage_reader=tcd.Reader(folder))))
    assert all(isinstance(e, tensorcanon.IntegrityError) for e in errors), errors
    assert "rank-00001-of-00002" in str(errors[0]) and "model.layer.weight" in str(errors[0])


def test_a_planner_with_its_own_load_bytes_is_refused_for_values(saved):
    class Custom(dcp.DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            return torch.load(value, weights_only=False)

    def load(rank, keys):
        zero = zeros_like_state(sharded_state(2, rank))
        return _error(lambda: dcp.load({k: zero[k] for k in keys}, storage_reader=tcd.Reader(saved),
                                       planner=Custom()))

    assert run_ranks(2, lambda r: load(r, ["model"])) == [None, None]       # tensors only: any planner
    errors = run_ranks(2, lambda r: load(r, ["model", "step"]))
    assert all(isinstance(e, tensorcanon.UsageError) for e in errors), errors
    assert "'step'" in str(errors[0]) and "load_bytes" in str(errors[0]) and "LoadPlanner" in str(errors[0])


# ------------------------------------------------------------------ overwrite

def test_overwrite_false_refuses_an_existing_checkpoint_before_writing(tmp_path):
    folder = str(tmp_path / "ckpt")
    run_ranks(2, lambda r: tcd.save({"w": torch.zeros(2), "step": 1}, folder, overwrite=False))  # new: fine
    before = rank_files(folder)

    refused = run_ranks(2, lambda r: _error(lambda: tcd.save({"w": torch.ones(2), "step": 2}, folder,
                                                              overwrite=False)))
    # async_save needs a CPU backend, which the threaded group is not: one process here
    refused.append(_error(lambda: tcd.async_save({"w": torch.ones(2)}, folder, overwrite=False).result(60)))
    for e in refused:
        assert isinstance(e, tcd.CheckpointExistsError) and isinstance(e, FileExistsError), e
        assert folder in str(e) and "overwrite=True" in str(e) and e.filename == folder
    assert rank_files(folder) == before                               # nothing written, nothing removed
    run_ranks(2, lambda r: tcd.save({"w": torch.ones(2), "step": 2}, folder))   # the default: replaced
    assert tcd.load_unsharded(folder)["step"] == 2


def test_dcp_storage_options_are_refused_naming_why(tmp_path):
    for make, words in [(lambda: tcd.Writer(tmp_path, thread_count=4), "thread_count"),
                        (lambda: tcd.Writer(tmp_path, _extensions=[]), "compression"),
                        (lambda: tcd.Writer(tmp_path, sync_files=False), "fsynced"),
                        (lambda: tcd.Reader(tmp_path, _extension_registry=None), "_extension_registry"),
                        (lambda: tcd.Writer(tmp_path, colour="red"), "unexpected option colour")]:
        e = _error(make)
        assert isinstance(e, tensorcanon.UsageError) and words in str(e), (words, e)


# ------------------------------------------------------------------ refusals name the path

class _Hooked(torch.Tensor):
    """A tensor subclass with DCP's hooks for custom tensors."""

    def __create_write_items__(self, fqn, obj):
        raise AssertionError("not called")


class _Hostile:
    def __getattribute__(self, name):
        raise RuntimeError(f"no attribute access here ({name})")


def test_tensor_subclasses_and_hostile_objects_are_refused_naming_the_path(tmp_path):
    hooked = torch.zeros(2).as_subclass(_Hooked)
    for value, words in [(hooked, "_Hooked is not supported by tensorcanon.dcp"),
                         (_Hostile(), "RuntimeError: no attribute access here")]:
        e = _error(lambda value=value: tcd.save({"model": {"w": value}}, str(tmp_path / "x")))
        assert isinstance(e, tensorcanon.UnsupportedTypeError), e
        assert words in str(e) and '$["model"]["w"]' in str(e), e
        assert "use tensorcanon.dcp" not in str(e)
    assert "__create_write_items__" in str(_error(lambda: tcd.save({"w": hooked}, str(tmp_path / "x"))))
    # at the top level, DCP's own Stateful check touches it first; async_save's staging copies it first
    for save in (lambda: tcd.save({"x": _Hostile()}, str(tmp_path / "y")),
                 lambda: tcd.async_save({"x": _Hostile()}, str(tmp_path / "y")).result(60),
                 lambda: tcd.async_save({"m": {"w": hooked}}, str(tmp_path / "y")).result(60)):
        e = _error(save)
        assert isinstance(e, tensorcanon.UnsupportedTypeError) and '$["' in str(e), e


def test_sharded_tensor_is_refused_naming_the_path(tmp_path):
    from torch.distributed._shard.sharded_tensor import empty
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    def save(rank):
        spec = ChunkShardingSpec(dim=0, placements=["rank:0/cpu", "rank:1/cpu"])
        return _error(lambda: tcd.save({"model": {"st": empty(spec, 4, 2)}}, str(tmp_path / "st")))

    errors = run_ranks(2, save)
    for e in errors:
        assert isinstance(e, tensorcanon.UnsupportedTypeError), e
        assert "ShardedTensor" in str(e) and '$["model"]["st"]' in str(e) and "DTensor" in str(e)


# ------------------------------------------------------------------ the process executor's main script

def _run_as_main(monkeypatch, tmp_path, source):
    """Run ``source`` as the main script's top level (a module named __main__ with a file)."""
    path = tmp_path / "train.py"
    path.write_text(source)
    main = types.ModuleType("__main__")
    main.__file__ = str(path)
    main.__spec__ = None
    monkeypatch.setitem(sys.modules, "__main__", main)
    main.__dict__.update(tcd=tcd, _compat=_compat, torch=torch, folder=str(tmp_path / "ckpt"))
    exec(compile(source, str(path), "exec"), main.__dict__)
    return main.__dict__


def test_process_executor_is_refused_from_an_unguarded_script(monkeypatch, tmp_path):
    unguarded = "try:\n    tcd.async_save({'w': torch.zeros(1)}, folder, executor='process')\n" \
                "except Exception as e:\n    error = e\n"
    error = _run_as_main(monkeypatch, tmp_path, unguarded)["error"]
    if _compat.AsyncCheckpointerType is None:  # torch < 2.7: no process executor at all, refused up front
        assert isinstance(error, tensorcanon.UsageError) and "executor='process' needs torch >=" in str(error)
        return
    assert isinstance(error, tensorcanon.UsageError) and "train.py, line 2" in str(error)
    assert "if __name__ == \"__main__\":" in str(error) and "executor='thread'" in str(error)
    in_a_function = "def main():\n    tcd.async_save({'w': torch.zeros(1)}, folder, executor='process')\n" \
                    "try:\n    main()\nexcept Exception as e:\n    error = e\n"
    assert "line 4" in str(_run_as_main(monkeypatch, tmp_path, in_a_function)["error"])
    guarded = "def main():\n    _compat.check_spawn_safe_main()\n    return 'fine'\n" \
              "if __name__ == '__main__':\n    result = main()\n"
    assert _run_as_main(monkeypatch, tmp_path, guarded)["result"] == "fine"
    assert not os.path.exists(str(tmp_path / "ckpt"))


# ------------------------------------------------------------------ Stateful objects

def test_stateful_objects_are_saved_and_loaded_through_their_state_dict(tmp_path):
    folder = str(tmp_path / "stateful")
    model = torch.nn.Linear(3, 2)
    tcd.save({"model": model, "step": 5}, folder)
    assert tcd.logical_digest(folder) == tensorcanon.fingerprint({"model": model.state_dict(), "step": 5})
    fresh = torch.nn.Linear(3, 2)
    state = {"model": fresh, "step": 0}
    tcd.load(state, folder)
    assert state["step"] == 5 and torch.equal(fresh.weight, model.weight)
    if _compat.TORCH_VERSION >= (2, 5):
        assert state["model"] is fresh
    else:  # DCP of torch 2.4 (the floor) puts the state_dict it loaded in place of the Stateful object
        assert state["model"].keys() == model.state_dict().keys()
