"""SeededCollator: random work in a collate_fn (masking, mixup, crops) that is the same for any
number of workers, leaves the caller's random state alone, and resumes exactly at any batch."""

from __future__ import annotations

import pickle
import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import tensorcanon
from tensorcanon.training.data import SampleIndex
from tensorcanon.training.seeded import SeededBatch, _batch_seeds

from support import global_random_states, same_random_states, seeded_batches

# 2 workers on the 2-core test machine, sometimes more: torch warns, the test means it.
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


class Tokens(Dataset):
    """Deterministic samples: all the randomness is in the collator."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.arange(6, dtype=torch.float64) + 10 * i


def mask_and_mix(samples: list) -> torch.Tensor:
    """Draws from torch (a Bernoulli mask, as MLM collators do), numpy (a mixup weight, with an
    odd number of normal draws: a cached Gaussian) and Python's random (a crop offset)."""
    x = torch.stack(samples)
    mask = torch.bernoulli(torch.full(x.shape, 0.3, dtype=torch.float64))
    lam = float(np.random.beta(0.4, 0.4)) + float(np.random.randn())
    crop = random.randint(0, 2)
    extra = torch.tensor([lam, crop, random.gauss(0, 1), torch.randn(()).item()], dtype=torch.float64)
    return torch.cat([(x * (1 - mask)).roll(crop, dims=1).flatten(), extra])


def _run(collate=None, **kw):
    """Collated batches of 18 ``Tokens`` (support.seeded_batches)."""
    return seeded_batches(Tokens(18), 5, collate_fn=collate or tensorcanon.SeededCollator(mask_and_mix), **kw)


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_collated_batches_are_the_same_for_any_workers_and_any_resume():
    full, _ = _run()
    assert len(full) == 10  # 5 batches per epoch (the last one of 2 samples), 2 epochs
    extras = torch.stack([b[-4:] for b in full])
    assert len(set(extras[:, 0].tolist())) == len(full)  # every batch draws its own numbers
    epoch0, epoch1 = full[:5], full[5:]
    assert not any(torch.equal(a[-4:], b[-4:]) for a, b in zip(epoch0, epoch1, strict=True))
    for workers, persistent in ((2, False), (2, True)):
        got, _ = _run(workers=workers, persistent=persistent)
        assert _same(got, full), (workers, persistent)
    # Resumed after batch k (mid epoch 0, the end of epoch 0, mid epoch 1), in workers or not.
    for k, workers in ((2, 0), (5, 2), (7, 2)):
        before, state = _run(stop=k, workers=workers, persistent=True)
        after, _ = _run(state=tensorcanon.loads(tensorcanon.dumps(state)), workers=2 - workers,
                        persistent=True)
        assert _same(before + after, full), k


def test_without_seeding_the_workers_change_the_batches():
    """Control: the same collator unseeded, with the worker seeds tensorcanon.seed_worker gives."""
    def run(workers):
        torch.manual_seed(0)
        s = tensorcanon.ResumableSampler(range(18), seed=5)
        loader = DataLoader(Tokens(18), batch_size=4, sampler=s, collate_fn=mask_and_mix, num_workers=workers,
                            generator=s.generator, worker_init_fn=tensorcanon.seed_worker)
        return list(s.track(loader))

    assert not _same(run(0), run(2))


def test_collating_in_the_main_process_leaves_the_callers_random_state_alone():
    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    np.random.randn()  # a cached Gaussian, which collating must keep
    random.gauss(0, 1)
    before = global_random_states()
    batches, _ = _run(epochs=1)
    assert len(batches) == 5 and same_random_states(before, global_random_states())

    failing = tensorcanon.SeededCollator(lambda samples: (torch.rand(3), np.random.rand(), 1 / 0))
    with pytest.raises(ZeroDivisionError):
        _run(epochs=1, collate=failing)
    assert same_random_states(before, global_random_states())  # also when the collate function raises


def test_a_batch_depends_on_seed_epoch_and_first_position_only():
    collate = tensorcanon.SeededCollator(mask_and_mix)
    samples = [Tokens(4)[i] for i in range(3)]

    def batch(seed, epoch, position, data=samples):
        b = SeededBatch(data)
        b.key = (seed, epoch, position)
        return collate(b)

    a = batch(5, 1, 8)
    assert torch.equal(batch(5, 1, 8), a)
    for other in ((6, 1, 8), (5, 0, 8), (5, 1, 4)):
        assert not torch.equal(batch(*other)[-4:], a[-4:]), other
    # The key, not the samples, decides the draws.
    assert torch.equal(batch(5, 1, 8, [Tokens(4)[i] for i in (3, 2, 1)])[-4:], a[-4:])
    # seed= replaces the sampler's seed; a copy (what a spawned worker receives) draws the same.
    own = tensorcanon.SeededCollator(mask_and_mix, seed=6)
    b = SeededBatch(samples)
    b.key = (5, 1, 8)
    assert torch.equal(own(b), batch(6, 1, 8))
    assert torch.equal(pickle.loads(pickle.dumps(collate))(b), a)


def test_the_batch_key_is_the_first_samples_position_over_all_ranks():
    s = tensorcanon.ResumableSampler(range(10), seed=3, num_replicas=2, rank=1)
    seeded = tensorcanon.SeededDataset(Tokens(10), s)
    indices = list(s)
    assert [i.position for i in indices] == [1, 3, 5, 7, 9]
    got = seeded.__getitems__(indices[2:4])
    assert type(got) is SeededBatch and got.key == (3, 0, 5)
    assert pickle.loads(pickle.dumps(indices[3])).position == 7
    s.advance(4)  # resumed mid-epoch: positions continue where the epoch was
    assert [i.position for i in s] == [9]
    assert seeded.__getitems__([SampleIndex(1, 0, 3)]).key is None  # made by hand, without a position


def test_a_nested_seeded_collator_gets_the_key_through_a_wrapper_that_rebuilds_the_list():
    # transformers' RemoveColumnsCollator hands the collator it wraps a new list.
    inner = tensorcanon.SeededCollator(mask_and_mix, seed=9)
    outer = tensorcanon.SeededCollator(lambda samples: inner([x.clone() for x in samples]))
    batches, _ = _run(epochs=1, collate=outer)
    alone, _ = _run(epochs=1, collate=tensorcanon.SeededCollator(mask_and_mix, seed=9))
    assert _same(batches, alone)


def test_a_generator_is_handed_in_when_asked():
    def draw(samples, generator):
        return torch.cat([torch.rand(2, generator=generator), torch.rand(2)])

    got, _ = _run(epochs=1, collate=tensorcanon.SeededCollator(draw, generator=True))
    again, _ = _run(epochs=1, workers=2, collate=tensorcanon.SeededCollator(draw, generator=True))
    assert _same(got, again)
    assert not torch.equal(got[0][:2], got[0][2:])  # the handed-in stream is not the global one


def test_batches_without_a_key_are_refused():
    collate = tensorcanon.SeededCollator()
    with pytest.raises(tensorcanon.UsageError, match="SeededDataset"):
        collate([torch.zeros(2)])
    s = tensorcanon.ResumableSampler(range(4))
    loader = DataLoader(Tokens(4), batch_size=2, sampler=s, collate_fn=collate)  # no SeededDataset
    with pytest.raises(tensorcanon.UsageError, match="carries no batch key"):
        next(iter(loader))
    with pytest.raises(tensorcanon.UsageError, match="callable"):
        tensorcanon.SeededCollator(3)  # type: ignore[arg-type]
    with pytest.raises(tensorcanon.UsageError, match="seed"):
        tensorcanon.SeededCollator(seed=-1)


def test_default_collate_is_the_default():
    batches, _ = _run(epochs=1, collate=tensorcanon.SeededCollator())
    assert torch.equal(batches[0], torch.stack([Tokens(18)[int(i)] for i in
                                                tensorcanon.ResumableSampler(range(18), seed=5).order()[:4]]))


def test_derived_batch_seeds_and_draws_are_pinned():
    """The per-batch derivation (docs/RNG.md) is a promise: the same (seed, epoch, position)
    gives the same collation in every version."""
    def hexed(seed, epoch, position):
        (py, words, tseed), gseed = _batch_seeds(seed, epoch, position)
        return hex(py), [hex(w) for w in words.tolist()], hex(tseed), hex(gseed)

    assert hexed(0, 0, 0) == PINNED[0]
    assert hexed(1, 2, 3) == PINNED[1]
    top = 2**64 - 1
    assert hexed(top, top, top) == PINNED[2]

    def draw(samples, generator):
        return (random.random(), float(np.random.rand()), torch.rand((), dtype=torch.float64).item(),
                torch.rand((), dtype=torch.float64, generator=generator).item())

    b = SeededBatch([0])
    b.key = (1, 2, 3)
    assert tensorcanon.SeededCollator(draw, generator=True)(b) == PINNED_DRAWS


PINNED = [
    ("0x735f06ab0ab175d698be8c10164b1c66", ["0xd5b38c3e", "0xf48ae16", "0x3c2cdb0b", "0x34591c5d"],
     "0xde9aa194cd0ad527", "0xfce21ff65db7cc50"),
    ("0x793ff77408050eb2fa08545e526a6908", ["0x30871595", "0x747a50fc", "0x3b92e945", "0xf1dcaef7"],
     "0xe7d2266407579255", "0xf053d91815591fee"),
    ("0x63d35d608c38437804953f1d1ffd9935", ["0x5d739b4b", "0x8e5cddd", "0x17360e26", "0x14b88cab"],
     "0x83abba4358bf08d7", "0x2e1ee6adac0c1bac"),
]
PINNED_DRAWS = (0.8836330515876706, 0.8466585392950352, 0.9012592168390934, 0.7425392414717633)
