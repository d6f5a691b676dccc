"""FSDP2 (fully_shard) with AdamW through get_state_dict / set_state_dict (threaded tier)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import tensorcanon
import tensorcanon.dcp as tcd

from helpers import FSDP2_ON_CPU, NO_FSDP2_ON_CPU, unsharded
from models import batch, build, train_state
from threaded import run_ranks

pytestmark = pytest.mark.skipif(not FSDP2_ON_CPU, reason=NO_FSDP2_ON_CPU)


def _single_process_digest(steps: int) -> str:
    """The oracle: the same model trained in one process, no FSDP, no DTensor."""
    return tensorcanon.fingerprint(train_state(None, steps)[2])


def _loaded(world: int, folder: str) -> tuple:
    """On one rank of ``world``: a fresh FSDP2 model and optimizer with the checkpoint in
    ``folder`` loaded into them; ``(model, optim, the state dict loaded)``."""
    model, optim = build(world, steps=0)
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd, "step": 0, "cfg": None}
    tcd.load(state, folder)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return model, optim, state


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_checkpoint_digest_equals_the_single_process_models(world, tmp_path):
    """With 2 or 4 ranks on one batch, FSDP2's gradient averages are exact, so the sharded
    training state is bit for bit the single-process one: so must be the logical digest."""
    folder = str(tmp_path / "fsdp")
    got = run_ranks(world, lambda r: tcd.save(train_state(world)[2], folder))
    assert got == [_single_process_digest(1)] * world
    assert tcd.verify(folder) == got[0]
    full = tcd.load_unsharded(folder)
    assert full["model"]["proj.weight"] is full["model"]["embed.weight"]   # tied parameters stay tied


def test_fsdp2_uneven_and_empty_shards_are_in_the_index(tmp_path):
    folder = str(tmp_path / "uneven")
    run_ranks(4, lambda r: tcd.save(train_state(4)[2], folder))
    from tensorcanon.sharded import layout

    index = layout.read(folder)
    names = [i.name for i in index.logical.tensors]
    bias = index.chunks[names.index("model.head_bias")]            # 3 rows over 4 ranks
    assert [c.sizes for c in bias if c.sizes[0] == 0], bias           # a rank that holds no row
    weight = index.chunks[names.index("model.hidden.weight")]       # 7 rows over 4 ranks: 2, 2, 2, 1
    assert sorted(c.sizes[0] for c in weight) == [1, 2, 2, 2]


def test_fsdp2_resume_on_another_world_size_is_bitwise(tmp_path):
    """Save after one step on 2 ranks, resume on 4 ranks for a second step: the state equals
    two uninterrupted steps (on 2 ranks, and in one process)."""
    folder = str(tmp_path / "resume")
    run_ranks(2, lambda r: tcd.save(train_state(2, steps=1)[2], folder))

    def resume(rank):
        model, optim, state = _loaded(4, folder)
        x, y = batch()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optim.step()
        optim.zero_grad()
        model_sd, optim_sd = get_state_dict(model, optim)
        return state["step"], state["cfg"], tensorcanon.fingerprint(unsharded(
            {"model": model_sd, "optim": optim_sd, "step": 2, "cfg": {"lr": 0.01, "arch": "tied"}}))

    got = run_ranks(4, resume)
    assert all(step == 1 and cfg == {"lr": 0.01, "arch": "tied"} for step, cfg, _ in got)
    assert {digest for _, _, digest in got} == {_single_process_digest(2)}


def test_fsdp2_reshard_2_to_3_restores_every_value(tmp_path):
    folder = str(tmp_path / "r23")
    digest = run_ranks(2, lambda r: tcd.save(train_state(2)[2], folder))[0]

    def load(rank):
        model, optim, state = _loaded(3, folder)
        model_sd, optim_sd = get_state_dict(model, optim)
        return tensorcanon.fingerprint(unsharded({"model": model_sd, "optim": optim_sd, "step": state["step"],
                                                  "cfg": state["cfg"]}))

    assert run_ranks(3, load) == [digest] * 3
