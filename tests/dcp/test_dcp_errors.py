"""Damage, refusals and mismatches: the library's own error, naming what and where, on every rank."""

from __future__ import annotations

import errno
import os
import pickle
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh

import tensorcanon
import tensorcanon.dcp as tcd
from tensorcanon.sharded import layout

from helpers import Partial, Replicate, _StridedShard, flip_byte, unsharded, zeros_like_state
from states import logical_digest, logical_state, sharded_state
from threaded import run_ranks


def _load_everywhere(folder, world=2):
    """Load on every rank; return each rank's exception (or None)."""

    def load(rank):
        target = zeros_like_state(sharded_state(world, rank, seed=9))
        try:
            tcd.load(target, folder, keep_per_rank_on_resize=True)
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            return e
        return None

    return run_ranks(world, load)


def _chunk(folder, name, rank_file=None):
    """(path of the rank file, offset of the chunk's first data byte, the chunk's key) for a tensor."""
    index = layout.read(folder)
    t = [i.name for i in index.logical.tensors].index(name)
    c = index.chunks[t][-1] if rank_file is None else next(c for c in index.chunks[t] if c.rank == rank_file)
    path = index.file_path(c.rank)
    key = layout.chunk_key(name, c.offsets)
    with tensorcanon.open(path) as f:
        info = next(i for i in f.manifest.tensors if i.name == key)
        start = f.header.data_start + info.begin
    return path, start, key, c


def test_a_flipped_byte_names_file_tensor_and_offsets_on_every_rank(copy):
    path, start, key, chunk = _chunk(copy, "model.layer.weight")
    flip_byte(path, start + 3)
    errors = _load_everywhere(copy)
    assert all(isinstance(e, tensorcanon.IntegrityError) for e in errors), errors
    assert len({str(e) for e in errors}) == 1                      # the same error on every rank
    text = str(errors[0])
    assert os.path.basename(path) in text and "'model.layer.weight'" in text
    assert f"offsets {list(chunk.offsets)}" in text
    with pytest.raises(tensorcanon.IntegrityError, match="model.layer.weight"):
        tcd.verify(copy)
    # loading and consolidating prove bytes by the logical digest, then name the damaged chunk too
    out = os.path.join(copy, "..", "out.safetensors")
    for fn in (lambda: tcd.load_unsharded(copy), lambda: tcd.consolidate(copy, out)):
        with pytest.raises(tensorcanon.IntegrityError, match="model.layer.weight") as e:
            fn()
        assert f"offsets {list(chunk.offsets)}" in str(e.value) and "its digest in the rank file" in str(e.value)
    assert not os.path.exists(out)


def test_a_bool_chunk_holding_a_2_is_a_damaged_chunk(copy):
    path, start, _, chunk = _chunk(copy, "optim.state.1.mask")
    flip_byte(path, start, 2)  # 0 or 1 becomes 2 or 3: the digests say so before the 0/1 rule does
    for fn in (tcd.verify, tcd.load_unsharded):
        with pytest.raises(tensorcanon.IntegrityError, match="optim.state.1.mask") as e:
            fn(copy)
        assert f"offsets {list(chunk.offsets)}" in str(e.value)


def test_a_truncated_rank_file(copy):
    path, _, _, _ = _chunk(copy, "model.layer.weight")
    with open(path, "r+b") as fh:
        fh.truncate(os.path.getsize(path) - 5)
    errors = _load_everywhere(copy)
    assert all(isinstance(e, tensorcanon.FormatError) for e in errors), errors
    assert "truncated" in str(errors[0]) and os.path.basename(path) in str(errors[0])
    assert "tensor '" in str(errors[0]) and "offsets" in str(errors[0])
    with pytest.raises(tensorcanon.FormatError, match="truncated"):
        tcd.verify(copy)


def test_a_missing_rank_file(copy):
    path, _, _, _ = _chunk(copy, "model.layer.weight", rank_file=1)
    os.unlink(path)
    errors = _load_everywhere(copy)
    assert all(isinstance(e, tcd.CheckpointNotFoundError) and isinstance(e, FileNotFoundError) for e in errors)
    assert "missing" in str(errors[0]) and os.path.basename(path) in str(errors[0])
    assert "offsets" in str(errors[0])
    assert all(e.filename == path for e in errors)  # kept through the added context
    with pytest.raises(tcd.CheckpointNotFoundError) as e:
        tcd.load_unsharded(copy)
    assert e.value.filename == path and e.value.errno == errno.ENOENT


def test_a_missing_index_is_an_incomplete_checkpoint(copy):
    os.unlink(os.path.join(copy, layout.INDEX_NAME))
    errors = _load_everywhere(copy)
    assert all(isinstance(e, tcd.CheckpointNotFoundError) for e in errors), errors
    assert "interrupted save" in str(errors[0])
    for fn in (tcd.verify, tcd.load_unsharded, tcd.logical_digest):
        with pytest.raises(tcd.CheckpointNotFoundError, match="interrupted save"):
            fn(copy)
    with pytest.raises(tcd.CheckpointNotFoundError, match="does not exist"):
        tcd.verify(copy + "-nowhere")


def test_an_edited_index(copy):
    path = os.path.join(copy, layout.INDEX_NAME)
    flip_byte(path, os.path.getsize(path) // 2)
    errors = _load_everywhere(copy)
    assert all(isinstance(e, tensorcanon.TensorCanonError) for e in errors), errors
    assert layout.INDEX_NAME in str(errors[0])
    with pytest.raises(tensorcanon.TensorCanonError, match="index"):
        tcd.verify(copy)


def test_a_rank_file_from_another_save_is_refused(copy, tmp_path):
    """Same name pattern, valid file, other content: the index's digest catches it."""
    index = layout.read(copy)
    other = str(tmp_path / "other")
    run_ranks(2, lambda r: tcd.save(sharded_state(2, r, seed=4), other))
    theirs = layout.read(other)
    shutil.copy(theirs.file_path(1), index.file_path(1))
    with pytest.raises(tensorcanon.IntegrityError, match="the index records"):
        tcd.verify(copy)
    errors = _load_everywhere(copy)
    assert all(isinstance(e, tensorcanon.IntegrityError) for e in errors)


def test_an_extra_tensor_in_a_rank_file_fails_verify(copy):
    index = layout.read(copy)
    path = index.file_path(0)
    content = tensorcanon.load(path)
    content["intruder@0"] = torch.zeros(2)
    tensorcanon.save(content, path)
    with pytest.raises(tensorcanon.IntegrityError, match="the index records"):
        tcd.verify(copy)


def test_no_pickle_anywhere_on_load(saved, no_unpickling):
    def load(rank):
        target = zeros_like_state(sharded_state(3, rank, seed=2))
        tcd.load(target, saved, keep_per_rank_on_resize=True)
        return tensorcanon.fingerprint(unsharded(target))

    assert run_ranks(3, load) == [logical_digest()] * 3
    assert tcd.verify(saved) == logical_digest()
    assert tensorcanon.fingerprint(tcd.load_unsharded(saved)) == logical_digest()


def test_dcp_default_save_planner_is_refused(tmp_path):
    folder = str(tmp_path / "x")

    def save(rank):
        try:
            dcp.save({"w": torch.zeros(2)}, storage_writer=tcd.Writer(folder))
        except CheckpointException as e:
            return tcd.api.unwrap(e)
        return None

    errors = run_ranks(2, save)
    assert all(isinstance(e, tensorcanon.UsageError) and "SavePlanner" in str(e) for e in errors)
    assert not os.path.exists(os.path.join(folder, layout.INDEX_NAME))


def _save_errors(world, make, folder):
    def save(rank):
        try:
            tcd.save(make(rank), folder)
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            return e
        return None

    return run_ranks(world, save)


def test_replicated_values_that_differ_are_refused_naming_the_path(tmp_path):
    folder = str(tmp_path / "m")
    cases = [
        (lambda r: {"step": 100 + r, "w": torch.zeros(2)}, '$["step"]'),
        (lambda r: {"cfg": {"lr": 0.1}, "w": torch.full((2,), float(r))}, '$["w"]'),
        (lambda r: {"opt": {"state": {0: {"buf": torch.zeros(3) + (r == 2)}}}}, '$["opt"]["state"][0]["buf"]'),
    ]
    for make, where in cases:
        errors = _save_errors(3, make, folder)
        assert all(isinstance(e, tcd.ReplicaMismatchError) for e in errors), errors
        assert where in str(errors[0]) and len({str(e) for e in errors}) == 1
        assert not os.path.exists(os.path.join(folder, layout.INDEX_NAME))


def test_replicated_dtensor_chunks_that_differ_are_refused(tmp_path):
    def make(rank):
        mesh = init_device_mesh("cpu", (2,))
        from helpers import DTensor

        local = torch.full((2, 2), float(rank))  # claims to be replicated, but is not
        return {"rep": DTensor.from_local(local, mesh, [Replicate()], run_check=False)}

    errors = _save_errors(2, make, str(tmp_path / "rep"))
    assert all(isinstance(e, tcd.ReplicaMismatchError) for e in errors), errors
    assert '$["rep"]' in str(errors[0]) and "offsets [0, 0]" in str(errors[0])


def test_different_structures_are_refused(tmp_path):
    errors = _save_errors(2, lambda r: {"a": torch.zeros(2)} if r == 0 else {"a": torch.zeros(2), "b": 1},
                          str(tmp_path / "s"))
    assert all(isinstance(e, tcd.ReplicaMismatchError) for e in errors)
    assert "rank 1's state differs from rank 0's" in str(errors[0])


_PLACEMENTS = [pytest.param(lambda: [Partial()], id="partial")]
if _StridedShard is not None:  # (torch < 2.5 has no _StridedShard: nobody can save one there)
    _PLACEMENTS.append(pytest.param(lambda: [_StridedShard(0, split_factor=2)], id="strided"))


@pytest.mark.parametrize("placements", _PLACEMENTS)
def test_unsupported_placements_are_refused(placements, tmp_path):
    placements = placements()

    def make(rank):
        mesh = init_device_mesh("cpu", (2,))
        from helpers import DTensor

        return {"x": DTensor.from_local(torch.ones(2, 2), mesh, placements, run_check=False)}

    errors = _save_errors(2, make, str(tmp_path / "p"))
    assert all(isinstance(e, tensorcanon.UnsupportedTypeError) for e in errors), errors
    assert '$["x"]' in str(errors[0]) and "placement" in str(errors[0])


def test_load_target_mismatches_are_usage_errors(saved):
    def load(rank, change):
        target = zeros_like_state(sharded_state(2, rank))
        change(target)
        try:
            tcd.load(target, saved)
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            return e
        return None

    def wrong_dtype(t):
        t["extra"]["plain"] = torch.zeros(3, dtype=torch.float64)

    def wrong_shape(t):
        t["extra"]["plain"] = torch.zeros(4)

    def unknown_key(t):
        t["model"]["unknown.weight"] = torch.zeros(1)

    def tensor_for_value(t):
        t["step"] = torch.zeros(1)

    for change, words in [(wrong_dtype, "float64[3] in the state dict but float32[3]"),
                          (wrong_shape, "float32[4] in the state dict but float32[3]"),
                          (unknown_key, 'unknown.weight"] is in the state dict but not in the checkpoint'),
                          (tensor_for_value, 'is a tensor in the state dict but the checkpoint holds')]:
        errors = run_ranks(2, lambda r, change=change: load(r, change))
        assert all(isinstance(e, tensorcanon.UsageError) for e in errors), (change, errors)
        assert words in str(errors[0]), str(errors[0])


def test_errors_survive_being_sent_between_ranks():
    """DCP pickles a failing rank's exception to the others; each of ours must come back whole."""
    for e in [tensorcanon.LimitError("too deep", limit="max_depth"), tcd.CheckpointNotFoundError("gone"),
              tcd.ReplicaMismatchError("differs", path='$["x"]'), tcd.CheckpointError("dcp"),
              tensorcanon.IntegrityError("bad", path="p", expected="a", actual="b"),
              tensorcanon.FormatError("short", offset=3)]:
        back = pickle.loads(pickle.dumps(e))
        assert type(back) is type(e) and str(back) == str(e) and back.__dict__ == e.__dict__


def test_a_failed_save_leaves_the_previous_checkpoint_complete(tmp_path, monkeypatch):
    folder = str(tmp_path / "keep")
    run_ranks(2, lambda r: tcd.save(sharded_state(2, r), folder))
    before = sorted(os.listdir(folder))
    import tensorcanon.dcp.writer as w

    real = w.writer.write_atomic

    def crash_on_index(plan, path):
        if os.path.basename(path) == layout.INDEX_NAME:
            raise OSError(28, "No space left on device (simulated)")
        return real(plan, path)

    monkeypatch.setattr(w.writer, "write_atomic", crash_on_index)
    errors = _save_errors(2, lambda r: sharded_state(2, r, seed=8), folder)
    assert all(isinstance(e, OSError) and "simulated" in str(e) for e in errors), errors
    monkeypatch.undo()
    assert set(before) <= set(os.listdir(folder))            # old files all there (new ones beside them)
    assert tcd.verify(folder) == logical_digest()             # and the old checkpoint intact
    run_ranks(2, lambda r: tcd.save(sharded_state(2, r, seed=8), folder))
    assert len(os.listdir(folder)) == 3                       # the next save cleans up
    assert tcd.verify(folder) == tensorcanon.fingerprint(logical_state(8))


def test_a_rank_that_fails_to_write_does_not_leave_the_others_waiting(tmp_path, monkeypatch):
    """Rank 1's write fails while tensors are split (so ranks exchange file names after
    writing): every rank raises rank 1's own error, and nobody hangs."""
    import torch.distributed as dist

    import tensorcanon.dcp.writer as w

    real = w.write_rank_file

    def flaky(folder, rank, world, obj, algorithm, limits):
        if dist.get_rank() == 1:
            raise OSError(5, "Input/output error (simulated on rank 1)")
        return real(folder, rank, world, obj, algorithm, limits)

    monkeypatch.setattr(w, "write_rank_file", flaky)
    errors = _save_errors(3, lambda r: sharded_state(3, r), str(tmp_path / "flaky"))
    assert all(isinstance(e, OSError) and "simulated on rank 1" in str(e) for e in errors), errors
    assert not os.path.exists(os.path.join(str(tmp_path / "flaky"), layout.INDEX_NAME))


def test_a_rank_file_appears_under_its_content_name_in_one_rename(tmp_path, monkeypatch):
    """The temp file is renamed once, straight to the name made from its digest: no name in
    between that a crash could leave behind, and one folder fsync per rank file."""
    import tensorcanon.dcp.writer as w

    renames = []
    real = os.replace

    def recording(src, dst):
        renames.append((os.path.basename(src), os.path.basename(dst)))
        real(src, dst)

    monkeypatch.setattr(os, "replace", recording)
    state = {"w": torch.arange(6.0), "step": 3}
    digest, per_key = w.write_rank_file(str(tmp_path), 1, 2, state, "xxh3-128", tensorcanon.Limits())
    assert [dst for _, dst in renames] == [layout.rank_file_name(1, 2, digest)]
    assert renames[0][0].startswith("..rank-00001-of-00002.") and renames[0][0].endswith(".tensorcanon-tmp")
    assert os.listdir(tmp_path) == [layout.rank_file_name(1, 2, digest)]
    assert tensorcanon.verify(tmp_path / layout.rank_file_name(1, 2, digest)) == digest
    assert set(per_key) == {"w"}


def test_committing_removes_dead_writers_rank_temp_files_of_any_world_size(tmp_path):
    import tensorcanon.dcp.writer as w

    suffix = ".abcd_123.tensorcanon-tmp"
    dead = f"..rank-00003-of-00004.999999999{suffix}"        # no such pid: a crashed save's leftover
    live = f"..rank-00001-of-00002.{os.getpid()}{suffix}"      # a save still running
    other = f".notes.999999999{suffix}"                         # not a rank file's temp
    old_rank = layout.rank_file_name(0, 2, "xxh3-128:" + "0" * 32)
    kept = layout.rank_file_name(0, 2, "xxh3-128:" + "1" * 32)
    for name in (dead, live, other, old_rank, kept):
        (tmp_path / name).write_bytes(b"x")
    removed = w.remove_unreferenced(str(tmp_path), {kept})
    assert sorted(removed) == sorted([dead, old_rank])
    assert sorted(os.listdir(tmp_path)) == sorted([live, other, kept])
