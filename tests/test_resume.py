"""Resumed training equals uninterrupted training, with the resume in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

import tensorcanon

import resume_helper

HELPER = Path(__file__).parent / "resume_helper.py"
TOTAL = 12
KS = (3, 5, 8)  # mid-epoch 0, an epoch boundary, mid-epoch 1 (5 batches per epoch)


pytestmark = pytest.mark.usefixtures("keep_determinism_settings")  # tests/conftest.py


@pytest.mark.parametrize("workers", [0, 2])
def test_resumed_in_fresh_process_equals_uninterrupted(tmp_path, workers):
    full = resume_helper.Run(workers)
    full.train(TOTAL)
    expected = full.digest()

    paths = []
    for k in KS:
        run = resume_helper.Run(workers)
        run.train(k)
        path = tmp_path / f"k{k}.safetensors"
        tensorcanon.save(run.checkpoint(), path)
        paths.append(str(path))
        # the interrupted run itself, continued without a checkpoint, also matches
        run.train(TOTAL)
        assert run.digest() == expected

    env = {**os.environ, "PYTHONHASHSEED": "0"}
    proc = subprocess.run([sys.executable, str(HELPER), str(workers), str(TOTAL), *paths],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {p: expected for p in paths}


def test_resume_without_rng_state_differs(tmp_path):
    """Control: the digest comparison would notice a missed part of the state."""
    full = resume_helper.Run(0)
    full.train(TOTAL)
    run = resume_helper.Run(0)
    run.train(3)
    ckpt = tensorcanon.loads(tensorcanon.dumps(run.checkpoint()))
    fresh = resume_helper.Run(0)
    torch.manual_seed(99)  # a different global stream, then skip the RNG restore
    fresh.model.load_state_dict(ckpt["model"])
    fresh.opt.load_state_dict(ckpt["optimizer"])
    fresh.sched.load_state_dict(ckpt["scheduler"])
    fresh.sampler.load_state_dict(ckpt["sampler"])
    fresh.step = ckpt["step"]
    fresh.train(TOTAL)
    assert fresh.digest() != full.digest()


def test_unseeded_augmentation_in_workers_does_not_resume_mid_epoch():
    """Control: the same augmentation without SeededDataset, drawn in 2 workers, resumed
    mid-epoch, ends elsewhere; the fresh-process test above would notice a seeding that failed."""
    full = resume_helper.Run(2, seeded=False)
    full.train(TOTAL)
    run = resume_helper.Run(2, seeded=False)
    run.train(3)
    ckpt = tensorcanon.loads(tensorcanon.dumps(run.checkpoint()))
    fresh = resume_helper.Run(2, seeded=False)
    fresh.resume(ckpt)
    fresh.train(TOTAL)
    assert fresh.digest() != full.digest()


# --------------------------------------------------------------------------- the known traps


def _ds(n=20):
    return TensorDataset(torch.arange(n))


def test_trap_dataloader_draws_base_seed_from_global_rng():
    ds = _ds()
    torch.manual_seed(0)
    before = torch.get_rng_state()
    iter(DataLoader(ds, batch_size=4, shuffle=False))  # no generator: draws from the global RNG
    assert not torch.equal(torch.get_rng_state(), before)

    sampler = tensorcanon.ResumableSampler(ds, seed=1)
    loader = DataLoader(ds, batch_size=4, sampler=sampler, generator=sampler.generator)
    before = torch.get_rng_state()
    list(sampler.track(loader))
    assert torch.equal(torch.get_rng_state(), before)  # the global stream is untouched

    with pytest.raises(ValueError, match="generator=sampler.generator"):
        next(sampler.track(DataLoader(ds, batch_size=4, sampler=sampler)))


def test_base_seed_depends_on_epoch_only():
    """Each iteration of an epoch gives the workers the same base seed, whatever happened before."""
    ds = _ds()
    sampler = tensorcanon.ResumableSampler(ds, seed=3)
    loader = DataLoader(ds, batch_size=4, sampler=sampler, generator=sampler.generator,
                        num_workers=0)

    def base_seed():
        sampler._reseed()
        return iter(loader)._base_seed

    first = base_seed()
    iter(loader)  # an extra iterator draws from the generator...
    assert base_seed() == first  # ...but the next epoch-start draw is the same again
    sampler.set_epoch(1)
    assert base_seed() != first


def test_trap_restoring_rng_then_skipping_batches_advances_it():
    """Dataset draws from the global RNG (num_workers=0): skipping by fetching moves the stream."""

    class Noisy(torch.utils.data.Dataset):
        def __len__(self):
            return 20

        def __getitem__(self, i):
            return i + torch.rand(()).item()

    ds = Noisy()
    # uninterrupted: 5 batches of 4
    torch.manual_seed(0)
    sampler = tensorcanon.ResumableSampler(ds, seed=2)
    loader = DataLoader(ds, batch_size=4, sampler=sampler, generator=sampler.generator)
    it = sampler.track(loader)
    [next(it) for _ in range(2)]
    state, rng = sampler.state_dict(), tensorcanon.RngState.capture()
    rest = [b.tolist() for b in it]

    # naive resume: restore RNG, then fetch and discard the first 2 batches
    rng.restore()
    naive = tensorcanon.ResumableSampler(ds, seed=2)
    nl = DataLoader(ds, batch_size=4, sampler=naive, generator=naive.generator)
    nit = iter(nl)
    [next(nit) for _ in range(2)]
    assert [b.tolist() for b in nit] != rest

    # the sampler resumes at its position without fetching anything
    rng.restore()
    resumed = tensorcanon.ResumableSampler(ds, seed=2)
    resumed.load_state_dict(tensorcanon.loads(tensorcanon.dumps(state)))
    rl = DataLoader(ds, batch_size=4, sampler=resumed, generator=resumed.generator)
    assert [b.tolist() for b in resumed.track(rl)] == rest


def test_trap_generator_saved_mid_epoch_is_past_the_shuffle():
    ds = _ds()
    g = torch.Generator().manual_seed(0)
    rs = RandomSampler(ds, generator=g)
    it = iter(rs)
    for _ in range(8):  # the first 8 indices of the epoch
        next(it)
    saved = g.get_state()  # saved mid-epoch: the permutation was already drawn
    rest = list(it)
    g2 = torch.Generator()
    g2.set_state(saved)
    replay = list(RandomSampler(ds, generator=g2))
    assert replay[8:] != rest  # the restored generator makes a new permutation

    s = tensorcanon.ResumableSampler(ds, seed=0)
    order = list(s)
    s.advance(8)
    s2 = tensorcanon.ResumableSampler(ds, seed=0)
    s2.load_state_dict(s.state_dict())
    assert list(s2) == order[8:]
    assert sorted(order) == list(range(20)) and order != list(range(20))


@pytest.mark.parametrize("workers", [0, 2])
def test_resumed_loader_sees_the_remaining_batches(workers):
    ds = _ds(30)

    def make():
        s = tensorcanon.ResumableSampler(ds, seed=11)
        return s, DataLoader(ds, batch_size=4, sampler=s, generator=s.generator, num_workers=workers,
                             worker_init_fn=tensorcanon.seed_worker)

    s, loader = make()
    s.set_epoch(2)
    full = [b[0].tolist() for b in s.track(loader)]
    assert len(full) == 8 and sorted(sum(full, [])) == list(range(30))
    for k in (1, 4, 7):
        s, loader = make()
        s.set_epoch(2)
        it = s.track(loader)
        got = [next(it)[0].tolist() for _ in range(k)]
        state = s.state_dict()  # with workers, the DataLoader has read ahead of the loop
        s2, loader2 = make()
        s2.load_state_dict(state)
        s2.set_epoch(2)  # same epoch: keeps the position
        assert got + [b[0].tolist() for b in s2.track(loader2)] == full


def test_sampler_state_validation():
    s = tensorcanon.ResumableSampler(_ds(), seed=0)
    st = s.state_dict()
    from tensorcanon.training.data import SamplerStateError
    for bad in ({**st, "num_samples": 21}, {**st, "position": 21}, {**st, "epoch": -1},
                {**st, "extra": 1}, {**st, "shuffle": 1}):
        with pytest.raises(SamplerStateError):
            s.load_state_dict(bad)
    unshuffled = tensorcanon.ResumableSampler(_ds(), shuffle=False)
    assert list(unshuffled) == list(range(20))


def test_seed_worker_derives_distinct_streams():
    class Draw(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            import random

            import numpy as np
            info = torch.utils.data.get_worker_info()
            return torch.tensor([info.id, random.random(), float(np.random.rand()), torch.rand(()).item()],
                                dtype=torch.float64)

    ds = Draw()

    def draws():
        s = tensorcanon.ResumableSampler(ds, shuffle=False, seed=4)
        loader = DataLoader(ds, batch_size=1, sampler=s, generator=s.generator, num_workers=2,
                            worker_init_fn=tensorcanon.seed_worker)
        return torch.cat(list(s.track(loader)))

    a, b = draws(), draws()
    assert torch.equal(a, b)  # same seed and epoch: same worker streams
    w0, w1 = a[a[:, 0] == 0], a[a[:, 0] == 1]
    assert not torch.equal(w0[:, 1:], w1[:, 1:])  # workers differ
