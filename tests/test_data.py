"""ResumableSampler semantics (length, sharding, per-rank state) and SeededDataset (per-sample
random state across workers and resumes)."""

from __future__ import annotations

import multiprocessing
import pickle
import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

import tensorcanon
from tensorcanon.training.data import SampleIndex
from tensorcanon.training.seeded import _sample_seeds

from support import global_random_states, same_random_states, seeded_batches

# 4 workers on the 2-core test machine: torch warns, the test means it.
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


def _ids(n):
    return TensorDataset(torch.arange(n))


# --------------------------------------------------------------------------- length and position


def test_len_is_the_full_epoch_and_remaining_what_is_left():
    ds = _ids(22)
    s = tensorcanon.ResumableSampler(ds, seed=0)
    loader = DataLoader(ds, batch_size=4, sampler=s, generator=s.generator)
    assert len(s) == 22 and s.remaining == 22 and len(loader) == 6
    it = s.track(loader)
    for k in range(1, 4):
        next(it)
        assert (len(s), s.position, s.remaining, len(loader)) == (22, 4 * k, 22 - 4 * k, 6)
    # the remaining batches are yielded, not the full epoch again
    assert sum(len(b[0]) for b in DataLoader(ds, batch_size=4, sampler=s)) == 10


def test_without_track_every_iteration_is_the_whole_epoch_like_distributed_sampler():
    s = tensorcanon.ResumableSampler(_ids(10), seed=5)
    first = list(s)
    assert list(s) == first and s.position == 0  # nothing counted, nothing skipped
    s.set_epoch(1)
    assert list(s) != first and sorted(list(s)) == list(range(10))
    s.set_epoch(1)  # same epoch: unchanged
    assert list(s) == s.order(1)


@pytest.mark.parametrize("drop_last", [False, True])
def test_track_finishes_the_epoch_and_the_next_iteration_is_the_next_epoch(drop_last):
    ds = _ids(10)
    s = tensorcanon.ResumableSampler(ds, seed=2)
    loader = DataLoader(ds, batch_size=4, sampler=s, generator=s.generator, drop_last=drop_last)
    batches = [b[0].tolist() for b in s.track(loader)]
    assert len(batches) == len(loader) == (2 if drop_last else 3)
    assert (s.epoch, s.position) == (1, 0)  # finished, also when drop_last left 2 samples unread
    assert sum(batches, []) == s.order(0)[: 8 if drop_last else 10]
    again = [b[0].tolist() for b in s.track(loader)]  # iterating again: epoch 1, not nothing
    assert sum(again, []) == s.order(1)[: 8 if drop_last else 10] and s.epoch == 2


def test_finish_epoch_moves_on_from_any_position_and_reseeds():
    s = tensorcanon.ResumableSampler(_ids(10), seed=2)
    s.advance(3)
    s.finish_epoch()
    assert (s.epoch, s.position, s.remaining) == (1, 0, 10)
    assert list(s) == s.order(1)
    fresh = tensorcanon.ResumableSampler(_ids(10), seed=2)
    fresh.set_epoch(1)
    assert s.generator.get_state().equal(fresh.generator.get_state())  # as if epoch 1 began normally
    empty = tensorcanon.ResumableSampler(_ids(1), num_replicas=2, rank=1, drop_last=True)
    assert len(empty) == 0 and empty.remaining == 0
    empty.advance(empty.remaining)  # counting nothing finishes nothing
    assert empty.epoch == 0
    empty.finish_epoch()  # an empty shard's epoch still ends
    assert (empty.epoch, empty.position) == (1, 0)


def test_advance_to_the_end_moves_to_the_next_epoch():
    s = tensorcanon.ResumableSampler(_ids(10), seed=2)
    s.advance(6)
    assert (s.epoch, s.position, s.remaining) == (0, 6, 4)
    s.advance(s.remaining)
    assert (s.epoch, s.position, s.remaining) == (1, 0, 10)
    s.advance(0)
    assert (s.epoch, s.position) == (1, 0)
    for bad in (-1, 1.0, True, "2", torch.tensor(2.0)):
        with pytest.raises(tensorcanon.UsageError):
            s.advance(bad)
    for bad in (-1, 2.0, None, 2**64):
        with pytest.raises(tensorcanon.UsageError, match="epoch"):
            s.set_epoch(bad)
    s.set_epoch(np.int64(1))  # numpy and torch integers count too; same epoch keeps the position
    assert (s.epoch, type(s.epoch), s.position) == (1, int, 0)
    s.advance(np.int64(3))
    s.advance(torch.tensor(2))
    assert s.position == 5


def test_base_seed_is_the_same_for_every_iterator_of_an_epoch():
    """The DataLoader draws its worker base seed from sampler.generator when an iterator is made;
    after a partial iteration (a break), the next iterator of the epoch draws the same seed."""
    ds = _ids(20)
    s = tensorcanon.ResumableSampler(ds, seed=3)
    loader = DataLoader(ds, batch_size=4, sampler=s, generator=s.generator)
    it = iter(loader)
    first = it._base_seed
    next(it)
    next(it)
    assert iter(loader)._base_seed == first
    s.set_epoch(1)
    assert iter(loader)._base_seed != first


# --------------------------------------------------------------------------- Lightning's batch counting


def _lightning_like_fit(sampler, make_loader, batch_size, epochs, *, start=None, stop_after=None):
    """Model of Lightning's fit loop, with dataloaders reloaded every epoch: the epoch's batch
    budget is len(dataloader); on a restart the iterator is created (and, with workers, reads the
    sampler ahead) BEFORE set_epoch; the batch counter is restored; the sampler is advanced at
    each batch start; at the epoch end the epoch is finished (a partial batch dropped by
    drop_last is counted). Returns [(epoch, batch_idx, indices)] and the stop point."""
    seen = []
    epoch, batch_idx = start if start else (0, 0)
    restarting = start is not None
    while epoch < epochs:
        loader = make_loader()
        max_batches = len(loader)
        if restarting:
            it = iter(loader)
            sampler.set_epoch(epoch)
        else:
            sampler.set_epoch(epoch)
            it = iter(loader)
        restarting = False
        while batch_idx < max_batches:
            try:
                batch = next(it)
            except StopIteration:
                break
            sampler.advance(batch_size)
            seen.append((epoch, batch_idx, batch[0].tolist()))
            batch_idx += 1
            if stop_after is not None and len(seen) == stop_after:
                if batch_idx == max_batches:  # Lightning restarts on the next epoch
                    if sampler.epoch == epoch:
                        sampler.advance(sampler.remaining)
                    return seen, (epoch + 1, 0)
                return seen, (epoch, batch_idx)
        if sampler.epoch == epoch:
            sampler.advance(sampler.remaining)
        epoch, batch_idx = epoch + 1, 0
    return seen, None


@pytest.mark.parametrize("drop_last", [False, True])
def test_frameworks_counting_batches_train_every_epoch_in_full_after_a_resume(drop_last):
    n, bs, epochs, workers = 22, 4, 3, 2
    ds = _ids(n)

    def run(state=None, **kw):
        s = tensorcanon.ResumableSampler(ds, seed=9)
        if state is not None:
            s.load_state_dict(tensorcanon.loads(tensorcanon.dumps(state)))

        def make_loader():
            return DataLoader(ds, batch_size=bs, sampler=s, num_workers=workers,
                              generator=s.generator, drop_last=drop_last)
        seen, stop = _lightning_like_fit(s, make_loader, bs, epochs, **kw)
        return s, seen, stop

    per_epoch = n // bs if drop_last else -(-n // bs)
    _, full, _ = run()
    assert [e for e, _, _ in full] == [e for e in range(epochs) for _ in range(per_epoch)]
    for e in range(epochs):
        got = sum((b for ep, _, b in full if ep == e), [])
        assert len(set(got)) == len(got) == (per_epoch * bs if drop_last else n)

    for k in (3, per_epoch, per_epoch + 2):  # mid epoch 0, the end of epoch 0, mid epoch 1
        s, before, stop = run(stop_after=k)
        _, after, _ = run(s.state_dict(), start=stop)
        assert before + after == full, k


# --------------------------------------------------------------------------- sharding

SHARDINGS = [(10, 1, False), (10, 3, False), (10, 3, True), (11, 4, False), (11, 4, True),
             (12, 4, True), (2, 5, False), (2, 5, True), (1, 3, False), (0, 2, False)]


@pytest.mark.parametrize("n,replicas,drop_last", SHARDINGS)
def test_shards_are_distributed_samplers(n, replicas, drop_last):
    shards = []
    for rank in range(replicas):
        kw = dict(num_replicas=replicas, rank=rank, drop_last=drop_last)
        ours = tensorcanon.ResumableSampler(_ids(n), shuffle=False, **kw)
        theirs = DistributedSampler(_ids(n), shuffle=False, **kw)
        assert list(ours) == list(theirs) and len(ours) == len(theirs)
        shuffled = tensorcanon.ResumableSampler(_ids(n), seed=4, **kw)
        shuffled.set_epoch(2)
        shards.append(list(shuffled))
        assert len(shards[-1]) == len(theirs)
    # shuffled: the ranks interleaved are the unsharded epoch order, padded or truncated
    interleaved = [shard[i] for i in range(len(shards[0])) for shard in shards]
    whole = tensorcanon.ResumableSampler(_ids(n), seed=4).order(2)
    assert interleaved == (whole * (len(interleaved) // max(n, 1) + 1))[: len(interleaved)]


def test_ranks_give_their_workers_different_base_seeds():
    seeds = []
    for rank in range(3):
        s = tensorcanon.ResumableSampler(_ids(9), seed=1, num_replicas=3, rank=rank)
        seeds.append(iter(DataLoader(_ids(9), sampler=s, generator=s.generator))._base_seed)
    assert len(set(seeds)) == 3
    single = tensorcanon.ResumableSampler(_ids(9), seed=1)  # rank 0 keeps the 0.1 derivation
    assert iter(DataLoader(_ids(9), sampler=single, generator=single.generator))._base_seed == seeds[0]


def test_sharding_arguments_are_checked():
    for kw in (dict(num_replicas=0), dict(num_replicas=2, rank=2), dict(rank=-1),
               dict(num_replicas=2.0), dict(num_replicas=2, rank=True)):
        with pytest.raises(tensorcanon.UsageError):
            tensorcanon.ResumableSampler(_ids(4), **kw)


def test_per_rank_state_round_trips_and_resumes_every_rank():
    n, replicas, bs = 23, 3, 2
    ds = _ids(n)

    def make(rank):
        s = tensorcanon.ResumableSampler(ds, seed=8, num_replicas=replicas, rank=rank)
        return s, DataLoader(ds, batch_size=bs, sampler=s, generator=s.generator)

    states, rests = {}, {}
    for rank in range(replicas):
        s, loader = make(rank)
        s.set_epoch(1)
        it = s.track(loader)
        for _ in range(2):
            next(it)
        states[rank] = s.state_dict()
        rests[rank] = [b[0].tolist() for b in it]
    assert states[1] == {"seed": 8, "epoch": 1, "position": 4, "shuffle": True, "num_samples": n,
                         "num_replicas": 3, "rank": 1, "drop_last": False}
    loaded = tensorcanon.loads(tensorcanon.dumps(states))  # one checkpoint holding every rank's
    assert loaded == states
    for rank in range(replicas):
        s, loader = make(rank)
        s.load_state_dict(loaded[rank])
        assert (s.epoch, s.position, s.remaining) == (1, 4, 8 - 4)
        assert [b[0].tolist() for b in s.track(loader)] == rests[rank]
    # data-parallel ranks advance in lockstep: rank 0's state resumes rank 2 as well
    s, loader = make(2)
    s.load_state_dict(loaded[0])
    assert [b[0].tolist() for b in s.track(loader)] == rests[2]


def test_other_sharding_mid_epoch_is_refused_at_an_epoch_boundary_it_reshards():
    ds = _ids(24)
    s = tensorcanon.ResumableSampler(ds, seed=1, num_replicas=4, rank=0)
    s.set_epoch(3)
    s.advance(2)
    mid = s.state_dict()
    for kw, field in ((dict(num_replicas=2), "num_replicas"),
                      (dict(num_replicas=4, drop_last=True, rank=1), "drop_last")):
        other = tensorcanon.ResumableSampler(ds, seed=1, **kw)
        with pytest.raises(tensorcanon.SamplerStateError, match=field) as info:
            other.load_state_dict(mid)
        assert info.value.field == field and isinstance(info.value, ValueError)
    s.advance(s.remaining)  # epoch 3 finished: the state says epoch 4, position 0
    boundary = s.state_dict()
    assert (boundary["epoch"], boundary["position"]) == (4, 0)
    shards = []
    for rank in range(2):
        two = tensorcanon.ResumableSampler(ds, seed=0, num_replicas=2, rank=rank)
        two.load_state_dict(boundary)
        assert (two.seed, two.epoch, len(two)) == (1, 4, 12)
        shards.append(list(two))
    assert sorted(shards[0] + shards[1]) == list(range(24))
    assert shards[0] == tensorcanon.ResumableSampler(ds, seed=1).order(4)[0::2]


def test_version_0_1_states_load():
    ds = _ids(20)
    s = tensorcanon.ResumableSampler(ds, seed=0, shuffle=False)
    s.load_state_dict({"seed": 7, "epoch": 2, "position": 12, "shuffle": True, "num_samples": 20})
    assert (s.seed, s.epoch, s.position, s.shuffle) == (7, 2, 12, True)
    assert list(s) == s.order(2)[12:]
    # 0.1 saved a finished epoch as position == num_samples: that is the next epoch's start
    s.load_state_dict({"seed": 7, "epoch": 2, "position": 20, "shuffle": True, "num_samples": 20})
    assert (s.epoch, s.position, s.remaining) == (3, 0, 20)
    sharded = tensorcanon.ResumableSampler(ds, num_replicas=2, rank=1)
    with pytest.raises(tensorcanon.SamplerStateError, match="num_replicas"):
        sharded.load_state_dict({"seed": 7, "epoch": 2, "position": 12, "shuffle": True,
                                 "num_samples": 20})
    sharded.load_state_dict({"seed": 7, "epoch": 2, "position": 0, "shuffle": True,
                             "num_samples": 20})
    assert list(sharded) == s.order(2)[1::2]


def test_bad_states_name_the_field():
    s = tensorcanon.ResumableSampler(_ids(20), seed=0, num_replicas=2, rank=0)
    st = s.state_dict()
    cases = [({**st, "num_samples": 21}, "num_samples"), ({**st, "position": 11}, "position"),
             ({**st, "epoch": -1}, "epoch"), ({**st, "extra": 1}, "extra"),
             ({**st, "shuffle": 1}, "shuffle"), ({**st, "drop_last": None}, "drop_last"),
             ({**st, "num_replicas": 0}, "num_replicas"), ({**st, "rank": 2}, "rank"),
             ({**st, "seed": 2**64}, "seed"), ({k: v for k, v in st.items() if k != "rank"}, "rank"),
             ({**st, "position": True}, "position"),
             ({k: v for k, v in st.items() if k not in ("num_replicas", "rank", "drop_last", "seed")},
              "seed")]
    for bad, field in cases:
        with pytest.raises(tensorcanon.SamplerStateError, match=field) as info:
            s.load_state_dict(bad)
        assert info.value.field == field
    with pytest.raises(tensorcanon.SamplerStateError):
        s.load_state_dict([("seed", 0)])
    assert s.state_dict() == st  # nothing changed by the failed loads


def test_order_and_worker_seed_are_those_of_version_0_1():
    """Changing the derivation would change the data order of every saved run."""
    s = tensorcanon.ResumableSampler(_ids(10), seed=0)
    assert s.order() == [6, 3, 1, 5, 8, 7, 0, 2, 9, 4]
    assert s.order(3) == [9, 3, 4, 0, 6, 8, 5, 7, 2, 1]
    s = tensorcanon.ResumableSampler(_ids(7), seed=2**64 - 1)
    assert s.order(5) == [2, 3, 5, 4, 6, 1, 0]
    assert torch.empty((), dtype=torch.int64).random_(generator=s.generator).item() == 7759363490755490006


# --------------------------------------------------------------------------- SeededDataset


class Noisy(Dataset):
    """Augmentation the ordinary way: draws from random, numpy's and torch's global generators,
    including cached Gaussians (odd counts of normal draws)."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([i, random.random(), random.gauss(0, 1), np.random.rand(), np.random.randn(),
                             torch.rand(()).item(), torch.randn(()).item()], dtype=torch.float64)


def _seeded_run(**kw):
    """Batches of 18 ``Noisy`` samples (support.seeded_batches)."""
    return seeded_batches(Noisy(18), 6, **kw)


def test_seeded_batches_are_the_same_for_any_workers_and_any_resume():
    full, _ = _seeded_run()
    assert len(full) == 10
    values = torch.cat(full)[:, 1:]
    assert len(set(values[:, 0].tolist())) == len(values)  # every sample draws its own numbers
    for workers, persistent in ((2, False), (2, True), (4, False), (4, True)):
        got, _ = _seeded_run(workers=workers, persistent=persistent)
        assert all(torch.equal(a, b) for a, b in zip(got, full, strict=True)), (workers, persistent)
    for k, workers in ((1, 2), (4, 4), (5, 0), (7, 2)):  # 5 batches per epoch: mid 0, end of 0, mid 1
        before, state = _seeded_run(stop=k, workers=workers, persistent=True)
        after, _ = _seeded_run(state=tensorcanon.loads(tensorcanon.dumps(state)), workers=2,
                               persistent=True)
        assert all(torch.equal(a, b) for a, b in zip(before + after, full, strict=True)), k


def test_a_sample_depends_on_seed_epoch_and_index_only():
    s = tensorcanon.ResumableSampler(range(6), seed=6)
    seeded = tensorcanon.SeededDataset(Noisy(6), s)
    a = seeded[SampleIndex(2, epoch=1, seed=6)]
    assert torch.equal(seeded[SampleIndex(2, epoch=1, seed=6)], a)
    assert not torch.equal(seeded[SampleIndex(2, epoch=0, seed=6)][1:], a[1:])
    assert not torch.equal(seeded[SampleIndex(3, epoch=1, seed=6)][1:], a[1:])
    assert not torch.equal(seeded[SampleIndex(2, epoch=1, seed=7)][1:], a[1:])
    s.set_epoch(1)
    assert any(torch.equal(batch[0], a) for batch in DataLoader(seeded, batch_size=1, sampler=s))
    copy = pickle.loads(pickle.dumps(seeded))  # what a spawned worker receives
    assert copy.sampler is None and torch.equal(copy[SampleIndex(2, epoch=1, seed=6)], a)


def test_loading_in_the_main_process_leaves_its_random_streams_alone():
    n = 12
    dropout = torch.nn.Dropout(0.5)

    def train(dataset_for, sampler_seed=3):
        """Dropout masks and main-process draws interleaved with loading (num_workers=0)."""
        s = tensorcanon.ResumableSampler(range(n), seed=sampler_seed)
        loader = DataLoader(dataset_for(s), batch_size=3, sampler=s, generator=s.generator)
        torch.manual_seed(0), random.seed(0), np.random.seed(0)
        np.random.randn()  # leaves a cached Gaussian, which loading must not disturb
        random.gauss(0, 1)
        out = []
        for _ in s.track(loader):
            out.append(torch.cat([dropout(torch.ones(16)),
                                  torch.tensor([random.random(), np.random.randn()])]))
        return torch.stack(out), global_random_states()

    loaded, after = train(lambda s: tensorcanon.SeededDataset(Noisy(n), s))
    plain = TensorDataset(torch.zeros(n))
    unloaded, after_plain = train(lambda s: plain)  # a dataset that draws nothing
    assert torch.equal(loaded, unloaded) and same_random_states(after, after_plain)
    leaky, _ = train(lambda s: Noisy(n))  # control: unseeded loading moves the streams
    assert not torch.equal(leaky, unloaded)


def test_an_error_in_getitem_still_restores_the_streams():
    class Failing(Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            torch.rand(3), np.random.rand(), random.random()
            raise KeyError(i)

    s = tensorcanon.ResumableSampler(range(4))
    before = global_random_states()
    with pytest.raises(KeyError):
        tensorcanon.SeededDataset(Failing(), s)[SampleIndex(1, 0, 0)]
    assert same_random_states(before, global_random_states())


def test_another_numpy_bit_generator_is_seeded_and_restored_too():
    s = tensorcanon.ResumableSampler(range(4))
    seeded = tensorcanon.SeededDataset(Noisy(4), s)
    original = np.random.get_bit_generator()
    try:
        np.random.set_bit_generator(np.random.PCG64(1))
        before = np.random.get_state(legacy=False)
        first = seeded[SampleIndex(1, 0, 0)]
        assert torch.equal(seeded[SampleIndex(1, 0, 0)], first)
        assert np.random.get_state(legacy=False) == before
    finally:
        np.random.set_bit_generator(original)


@pytest.mark.parametrize("workers", [0, 2])
def test_plain_indices_are_refused(workers):
    s = tensorcanon.ResumableSampler(range(8))
    seeded = tensorcanon.SeededDataset(Noisy(8), s)
    other = tensorcanon.ResumableSampler(range(8))  # not the one SeededDataset wraps
    for loader in (DataLoader(seeded, batch_size=2, shuffle=True, num_workers=workers),
                   DataLoader(seeded, batch_size=2, sampler=other, num_workers=workers)):
        it = iter(loader)
        try:
            with pytest.raises(tensorcanon.UsageError, match="sampler=<the ResumableSampler"):
                next(it)
        finally:
            # The failed iterator's workers and queue threads must be gone before the next loader
            # forks its own: forking while they ran once left a worker deadlocked (torch 2.4). The
            # exception's traceback keeps the iterator alive, so its __del__ would come too late.
            if workers:
                it._shutdown_workers()
        assert multiprocessing.active_children() == []
    with pytest.raises(tensorcanon.UsageError):
        seeded[3]


def test_seeded_dataset_checks_its_arguments():
    with pytest.raises(tensorcanon.UsageError, match="ResumableSampler"):
        tensorcanon.SeededDataset(Noisy(4), DistributedSampler(range(4), num_replicas=1, rank=0))
    with pytest.raises(tensorcanon.UsageError, match="5 samples"):
        tensorcanon.SeededDataset(Noisy(5), tensorcanon.ResumableSampler(range(4)))


def test_wrapped_sampler_yields_sample_indices_that_act_as_ints():
    s = tensorcanon.ResumableSampler(range(5), seed=2)
    plain = list(s)
    tensorcanon.SeededDataset(Noisy(5), s)
    keyed = list(s)
    assert keyed == plain and all(type(i) is SampleIndex and i.epoch == 0 and i.seed == 2 for i in keyed)
    assert torch.arange(5)[keyed[0]].item() == plain[0] and {keyed[1]: 1}[plain[1]] == 1
    assert pickle.loads(pickle.dumps(keyed[2])).epoch == 0


def test_derived_seeds_and_draws_are_pinned():
    """The per-sample derivation (docs/RNG.md) is a promise: the same (seed, epoch, index) gives
    the same sample in every version."""
    def hexed(seed, epoch, index):
        py, words, tseed = _sample_seeds(seed, epoch, index)
        return hex(py), [hex(w) for w in words.tolist()], hex(tseed)

    assert hexed(0, 0, 0) == ("0x1fd4b7d21381faf31d331eb582900d7a",
                              ["0x6aee3f74", "0xc8444c12", "0xb49c4ede", "0xce7fd71"], "0x9fdedf38138c5006")
    assert hexed(1, 2, 3) == ("0x3f50199625f8cb95ff41c3443ca5a8fc",
                              ["0x82afa9f6", "0x7026d4a3", "0x324fb6c2", "0x7a980ace"], "0xcc19a51ccd984581")
    top = 2**64 - 1
    assert hexed(top, top, top) == ("0xf51b791b9d6a9953bc20a647cf5a1ad7",
                                    ["0xf901ca2c", "0x390803af", "0x8aad1cd4", "0xf67f0caf"],
                                    "0xb5d21b353213d6de")

    class Draw(Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return random.random(), float(np.random.rand()), torch.rand((), dtype=torch.float64).item()

    seeded = tensorcanon.SeededDataset(Draw(), tensorcanon.ResumableSampler(range(10)))
    assert seeded[SampleIndex(3, epoch=2, seed=1)] == (0.4146562187642979, 0.960208937058657,
                                                       0.4345505822608966)
    assert seeded[SampleIndex(0, epoch=0, seed=0)] == (0.7711312033986761, 0.8860646839430242,
                                                       0.9299933660973586)
