"""Real tier: the same properties across separate processes on gloo (scenarios.py, spawn.py).

Two launches (starting processes costs seconds here, so each runs many scenarios):
2 ranks save (FSDP2 + AdamW, a mixed DTensor state, async thread and process executors,
per-rank RNG state, byte items), load a part of a checkpoint, and meet damage and refusals
(overwrite=False, a ShardedTensor); then 3 ranks reshard what 2 saved,
save again, and get the same logical digest. Files written by the threaded tier in this
process must be byte-identical to those written by the 2 processes.
"""

from __future__ import annotations

import os

import pytest

import tensorcanon
import tensorcanon.dcp as tcd
from tensorcanon.dcp import _compat

from helpers import FSDP2_ON_CPU, NO_FSDP2_ON_CPU, rank_files
from models import train_state
from spawn import launch
from states import bytes_logical, loader_bytes, logical_digest, logical_state


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("spawned"))
    two = launch(2, "two", folder)
    three = launch(3, "three", folder)
    return folder, two, three


def _same_on_every_rank(results, name):
    values = [r[name] for r in results]
    assert all(v == values[0] for v in values), (name, values)
    if isinstance(values[0], dict) and "traceback" in values[0]:
        pytest.fail(f"{name} raised on every rank:\n{values[0]['traceback']}")
    return values[0]


@pytest.mark.skipif(not FSDP2_ON_CPU, reason=NO_FSDP2_ON_CPU)
def test_fsdp2_adamw_across_processes(runs):
    folder, two, three = runs
    digest, logical, gloo_averages = _same_on_every_rank(two, "fsdp2_save")
    assert digest == logical                                        # the state FSDP2 holds, gathered by torch
    if gloo_averages:  # else this torch's FSDP2 sums gradients on gloo (see scenarios.fsdp2_save)
        assert digest == tensorcanon.fingerprint(train_state(None)[2])   # one process, no FSDP
    loaded_digest, saved_digest = _same_on_every_rank(three, "fsdp2_reshard_and_save")
    assert loaded_digest == saved_digest == digest                  # 2 -> 3 ranks, bitwise
    for name in ("fsdp2", "fsdp3"):
        assert tcd.verify(os.path.join(folder, name)) == digest
        assert tensorcanon.fingerprint(tcd.load_unsharded(os.path.join(folder, name))) == digest  # -> 1


def test_files_are_identical_across_processes_runs_and_names(runs, tmp_path):
    folder, two, _ = runs
    a, b, same = _same_on_every_rank(two, "state_save_twice")
    assert a == b == logical_digest() and same
    from states import sharded_state
    from threaded import run_ranks

    here = str(tmp_path / "threads")
    run_ranks(2, lambda r: tcd.save(sharded_state(2, r), here))     # another run: threads, this process
    assert rank_files(here) == rank_files(os.path.join(folder, "state-a"))


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_async_save_executors(runs, executor):
    _, two, _ = runs
    if executor == "process" and _compat.AsyncCheckpointerType is None:
        # This torch's DCP has no process executor: refused on every rank, naming the torch needed.
        errors = [r["async_process"] for r in two]
        assert all(e == errors[0] for e in errors), errors
        err = errors[0]
        assert err["error"] == "UsageError", err
        assert "torch >= 2.7" in err["message"] and "executor='thread'" in err["message"]
        return
    digest, same_files = _same_on_every_rank(two, f"async_{executor}")
    assert digest == logical_digest() and same_files


def test_each_process_gets_its_own_rng_state(runs):
    _, two, _ = runs
    assert [r["rng_per_rank"] for r in two] == [[True, [0.0, 0.0, 0.0]]] * 2


def test_damage_is_the_same_error_on_every_rank(runs):
    _, two, _ = runs
    err = _same_on_every_rank(two, "damaged_chunk")
    assert err["error"] == "IntegrityError" and "rank-00001-of-00002" in err["message"]
    assert "offsets" in err["message"] and "tensor '" in err["message"]
    err = _same_on_every_rank(two, "missing_index")
    assert err["error"] == "CheckpointNotFoundError" and "interrupted save" in err["message"]


def test_replica_mismatch_refused_on_every_rank(runs):
    _, two, _ = runs
    err = _same_on_every_rank(two, "replica_mismatch")
    assert err["error"] == "ReplicaMismatchError" and '$["step"]' in err["message"]


def test_no_pickle_when_loading(runs):
    _, two, _ = runs
    assert _same_on_every_rank(two, "no_pickle_load") == {"fingerprint": logical_digest()}


def test_reshard_2_to_3_and_the_per_rank_refusal(runs):
    folder, _, three = runs
    assert _same_on_every_rank(three, "state_reshard_2_to_3") == {"fingerprint": logical_digest()}
    err = _same_on_every_rank(three, "per_rank_resize_refused")
    assert err["error"] == "UsageError" and '$["rng"]' in err["message"]
    assert _same_on_every_rank(three, "state_save_three") == logical_digest()
    out = os.path.join(folder, "three.safetensors")
    tcd.consolidate(os.path.join(folder, "state-3"), out)
    with open(out, "rb") as fh:
        assert fh.read() == tensorcanon.dumps(logical_state())


def test_a_part_of_a_checkpoint_loads_across_processes(runs):
    _, two, _ = runs
    got = _same_on_every_rank(two, "partial_loads")
    model = logical_state()["model"]
    assert got["model"] == tensorcanon.fingerprint({"model": model})       # tcd.load, only the model
    assert got["missing"]["error"] == "UsageError" and '$["lr"]' in got["missing"]["message"]
    assert got["kept"] == 0.5                                                # allow_partial_load=True
    assert got["dcp_model"] == tensorcanon.fingerprint(dict(model))        # DCP's DefaultLoadPlanner
    assert got["dcp_values"] == [42, 3]


def test_overwrite_false_is_refused_on_every_rank_before_writing(runs):
    folder, two, _ = runs
    errors, unchanged = _same_on_every_rank(two, "overwrite_refused")
    assert unchanged
    for err in errors:                                                      # save, async_save
        assert err["error"] == "CheckpointExistsError", err
        assert os.path.join(folder, "state-a") in err["message"] and "overwrite=True" in err["message"]


def test_a_sharded_tensor_is_refused_naming_the_path(runs):
    _, two, _ = runs
    *errors, committed = _same_on_every_rank(two, "sharded_tensor_refused")
    assert not committed
    for err in errors:                                                      # save, async_save
        assert err["error"] == "UnsupportedTypeError", err
        assert '$["model"]["st"]' in err["message"] and "DTensor" in err["message"]


def test_byte_items_across_processes(runs):
    """io.BytesIO values: saved as bytes by 2 processes, back without pickle on 2 and on 3, and the
    logical digest is the unsharded state's fingerprint at both world sizes."""
    folder, two, three = runs
    digest = tensorcanon.fingerprint(bytes_logical())
    back = {"train": [3, True], "sampler": ["BytesIO", 0, True], "w": True}
    got = [r["byte_items_save"] for r in two]
    assert got == [[digest, digest, dict(back, loader=[0, loader_bytes(r).decode()])] for r in range(2)], got
    assert _same_on_every_rank(three, "byte_items_reshard_2_to_3") == [dict(back, loader=None), digest]
    assert tcd.verify(os.path.join(folder, "bytes-3")) == digest
