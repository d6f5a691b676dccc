"""Data order that resumes exactly: a resumable, shardable sampler and a worker seeding function.

The sampler's order for an epoch, and the seed the DataLoader gives its
workers, are pure functions of ``(seed, epoch)`` (and the rank). Its state is a
few numbers (seed, epoch, position, and the sharding it was saved with), so
nothing saved mid-epoch is ever "past the shuffle", and resuming never fetches
and discards batches. docs/RNG.md explains the traps this avoids.
"""

from __future__ import annotations

import operator
import random
from collections.abc import Iterable, Iterator, Sized
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler

from ..format.errors import TensorCanonError, UsageError

__all__ = ["seed_worker", "ResumableSampler", "SamplerStateError", "SampleIndex"]

U64 = 2**64 - 1

_V1_KEYS = frozenset({"seed", "epoch", "position", "shuffle", "num_samples"})
_V2_KEYS = _V1_KEYS | {"num_replicas", "rank", "drop_last"}


class SamplerStateError(TensorCanonError, ValueError):
    """A sampler state does not fit this sampler (other dataset size, other sharding
    mid-epoch, a malformed field). ``field`` names the state key at fault, when one is."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        self.field = field
        super().__init__(message)


def seed_worker(worker_id: int) -> None:
    """``worker_init_fn`` that derives every worker generator from the loader's base seed.

    In a worker, ``torch.initial_seed()`` is the loader's base seed plus
    ``worker_id`` (the base seed is drawn from the loader's ``generator`` when
    an iterator is created). Python's ``random`` and torch get that seed;
    numpy's global generator gets four words from ``SeedSequence(seed)``, so
    neighbouring workers get unrelated numpy streams.

    Example::

        DataLoader(ds, num_workers=2, worker_init_fn=tensorcanon.seed_worker,
                   generator=sampler.generator, sampler=sampler)
    """
    seed = torch.initial_seed() & U64
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(np.random.SeedSequence(seed).generate_state(4))


def _derive(seed: int, epoch: int, *stream: int) -> int:
    """A 64-bit seed for one (seed, epoch, stream...), through numpy's SeedSequence.

    Stream 0 orders the epoch; stream 1 (plus the rank, for ranks above 0) seeds
    :attr:`ResumableSampler.generator`. Fixed since version 0.1: changing it would
    change the data order of every saved run.
    """
    return int(np.random.SeedSequence([seed, epoch, *stream]).generate_state(1, np.uint64)[0])


def _shard_size(n: int, replicas: int, drop_last: bool) -> int:
    """Samples per rank in a full epoch, as torch's DistributedSampler computes ``num_samples``."""
    if drop_last:
        return n // replicas  # the tail that does not fill every rank is dropped
    return -(-n // replicas)  # ceil: the order is padded by repeating its start


def _as_count(value: Any, what: str) -> int:
    """``value`` as an int in [0, 2**64-1] (numpy and torch integers too, bools not)."""
    try:
        count = -1 if isinstance(value, bool) else operator.index(value)
    except TypeError:
        count = -1
    if not 0 <= count <= U64:
        raise UsageError(f"{what} must be an int in [0, 2**64-1], got {value!r}")
    return count


class SampleIndex(int):
    """A dataset index that carries the sampler's ``seed``, the ``epoch`` it belongs to and its
    ``position`` in that epoch's order.

    A :class:`ResumableSampler` wrapped by :class:`tensorcanon.SeededDataset`
    yields these instead of plain ints, so the epoch reaches ``__getitem__``
    even in a persistent worker whose copy of the sampler is stale, and the
    position of a batch's first sample reaches :class:`tensorcanon.SeededCollator`.
    It is an ``int`` (equal to, and hashing like, the plain index), so any
    other dataset indexed with it behaves as with the plain index.

    ``position`` counts the samples of the epoch's order before this one, over
    all ranks: rank ``r`` of ``R``'s ``p``-th sample is at ``p·R + r``
    (None when the index was made by hand without one).

    Example::

        seeded[SampleIndex(3, epoch=2, seed=1)]     # sample 3 as epoch 2 of a seed-1 run loads it
    """

    _key: tuple[int, int]  # (epoch, seed), shared by the indices of one epoch
    _position: int | None

    def __new__(cls, index: int, epoch: int, seed: int, position: int | None = None) -> SampleIndex:
        return _sample_index(index, (epoch, seed), position)

    @property
    def epoch(self) -> int:
        return self._key[0]

    @property
    def seed(self) -> int:
        return self._key[1]

    @property
    def position(self) -> int | None:
        return self._position

    def __reduce__(self) -> tuple:
        return (_sample_index, (int(self), self._key, self._position))

    def __repr__(self) -> str:
        at = "" if self._position is None else f", position={self._position}"
        return f"SampleIndex({int(self)}, epoch={self.epoch}, seed={self.seed}{at})"


def _sample_index(index: int, key: tuple[int, int], position: int | None = None) -> SampleIndex:
    self = int.__new__(SampleIndex, index)
    self._key = key
    self._position = position
    return self


class ResumableSampler(Sampler[int]):
    """A (shuffled, optionally sharded) sampler whose position can be saved and resumed mid-epoch.

    The order of epoch ``e`` is a permutation drawn from a generator seeded
    with ``(seed, e)``. With ``num_replicas=R`` and ``rank=r`` it is sharded as
    torch's ``DistributedSampler`` shards: the order is padded by repeating its
    start to a multiple of ``R`` (or truncated, with ``drop_last=True``) and
    rank ``r`` takes every ``R``-th index from ``r``. Every rank must use the
    same ``seed``. ``num_replicas`` and ``rank`` are never read from
    ``torch.distributed``: pass ``dist.get_world_size()`` and ``dist.get_rank()``.

    ``len(sampler)`` is the samples this rank yields in a full epoch (so
    ``len(DataLoader)`` is the full epoch's batch count, as training frameworks
    expect); :attr:`remaining` is what is left of the current epoch, and
    iterating yields only that, from :attr:`position`.

    :attr:`generator`, which you pass to the DataLoader as ``generator=``, is
    re-seeded from ``(seed, epoch, rank)`` whenever an epoch starts or is
    iterated, so the DataLoader's worker base seed is a function of the epoch
    too and creating an iterator never touches the global torch RNG.

    :meth:`track` wraps the loader and counts the batches your loop has
    received (with workers, the DataLoader reads the sampler ahead of the
    loop, so the sampler cannot count them itself); :meth:`advance` counts by
    hand. When the last sample of an epoch is counted the epoch is finished
    and the sampler moves to the next one at position 0. Without ``track`` or
    ``advance`` the position stays 0 and every iteration yields the whole
    epoch, as ``DistributedSampler`` does.

    Example::

        sampler = tensorcanon.ResumableSampler(ds, seed=0)
        loader = DataLoader(ds, batch_size=32, sampler=sampler, num_workers=2,
                            generator=sampler.generator, worker_init_fn=tensorcanon.seed_worker)
        for epoch in range(sampler.epoch, epochs):
            sampler.set_epoch(epoch)            # keeps the position when resuming into this epoch
            for x, y in sampler.track(loader):
                ...                             # train; checkpoint sampler.state_dict() any time
    """

    def __init__(self, data_source: Sized, *, shuffle: bool = True, seed: int = 0,
                 num_replicas: int | None = None, rank: int | None = None,
                 drop_last: bool = False) -> None:
        if type(seed) is not int or not 0 <= seed <= U64:
            raise UsageError(f"seed must be an int in [0, 2**64-1], got {seed!r}")
        replicas = 1 if num_replicas is None else num_replicas
        if type(replicas) is not int or replicas < 1:
            raise UsageError(f"num_replicas must be a positive int, got {num_replicas!r}")
        rank = 0 if rank is None else rank
        if type(rank) is not int or not 0 <= rank < replicas:
            raise UsageError(f"rank must be an int in [0, num_replicas={replicas}), got {rank!r}")
        self.num_samples = len(data_source)  # the dataset's length (the state's "num_samples")
        self.num_replicas = replicas
        self.rank = rank
        self.drop_last = bool(drop_last)
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self.generator = torch.Generator()
        self._sample_indices = False  # set by SeededDataset: yield SampleIndex values
        self._reseed()

    # ------------------------------------------------------------------ order and length

    def _reseed(self) -> None:
        stream = (1,) if self.rank == 0 else (1, self.rank)
        self.generator.manual_seed(_derive(self.seed, self.epoch, *stream))

    def __len__(self) -> int:
        """Samples this rank yields in a full epoch (``DistributedSampler.num_samples``)."""
        return _shard_size(self.num_samples, self.num_replicas, self.drop_last)

    @property
    def remaining(self) -> int:
        """Samples this rank has left in the current epoch: ``len(self) - self.position``."""
        return len(self) - self.position

    def order(self, epoch: int | None = None) -> list[int]:
        """This rank's full index order for ``epoch`` (default: the current one)."""
        e = self.epoch if epoch is None else epoch
        n = self.num_samples
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(_derive(self.seed, e, 0))
            indices = torch.randperm(n, generator=g).tolist()
        else:
            indices = list(range(n))
        per_rank = len(self)
        total = per_rank * self.num_replicas
        if total > n:  # pad by repeating from the start (possibly several times over)
            indices = (indices * -(-total // n))[:total]
        else:
            indices = indices[:total]
        return indices[self.rank:total:self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        # The DataLoader draws its base seed before it first reads the sampler, so re-seeding
        # here sets up the *next* iterator of this epoch (e.g. after a break) to draw the same.
        self._reseed()
        rest = self.order()[self.position:]
        if self._sample_indices:
            key, replicas, rank = (self.epoch, self.seed), self.num_replicas, self.rank
            return (_sample_index(i, key, p * replicas + rank) for p, i in enumerate(rest, self.position))
        return iter(rest)

    # ------------------------------------------------------------------ position

    def set_epoch(self, epoch: int) -> None:
        """Move to ``epoch`` at position 0; keeps the position when already in ``epoch`` (so a
        resumed run may call it unconditionally, as Lightning does every epoch)."""
        epoch = _as_count(epoch, "set_epoch(epoch): epoch")
        if epoch != self.epoch:
            self.epoch, self.position = epoch, 0
        self._reseed()

    def advance(self, n: int) -> None:
        """Count ``n`` more samples (of this rank) as consumed; what :meth:`track` does per batch.

        Counting the last sample of the epoch finishes it: the sampler moves to
        the next epoch at position 0. :meth:`finish_epoch` finishes it by hand.
        """
        n = _as_count(n, "advance(n): n")
        self.position = min(self.position + n, len(self))
        if self.position == len(self) and n > 0:
            self.finish_epoch()

    def finish_epoch(self) -> None:
        """Move to the next epoch at position 0, whatever is left of this one (e.g. the partial
        batch a DataLoader with ``drop_last=True`` leaves unread, or the rest of an epoch a
        training loop cut short)."""
        self.epoch, self.position = min(self.epoch + 1, U64), 0
        self._reseed()

    def _count(self, batches: Iterable[Any], batch_size: int, epoch: int | None) -> Iterator[Any]:
        """Yield ``batches``, counting each as ``batch_size`` samples of ``epoch`` (None: the
        epoch the sampler is in when the first batch arrives, after the loader's own
        ``set_epoch``); at the end, finish that epoch if counting did not (``drop_last``, or a
        shard without a batch). What :meth:`track` and the integrations' ``track`` share."""
        for batch in batches:
            if epoch is None:
                epoch = self.epoch
            if self.epoch == epoch:
                self.advance(batch_size)
            yield batch
        if epoch is not None and self.epoch == epoch:
            self.finish_epoch()

    def track(self, loader: torch.utils.data.DataLoader) -> Iterator[Any]:
        """Iterate ``loader`` (built on this sampler), counting each batch as it is received.

        Raises :class:`tensorcanon.UsageError` when the loader does not use this
        sampler or this sampler's :attr:`generator` (without it the DataLoader
        draws its worker seed from the global torch RNG, which breaks
        resumption). When the loader is exhausted the epoch is finished (also
        with the DataLoader's ``drop_last``) and the sampler moves to the next.
        """
        if loader.sampler is not self:
            raise UsageError("track(loader): the DataLoader must be built with sampler=<this sampler>")
        if loader.generator is not self.generator:
            raise UsageError(
                "track(loader): pass generator=sampler.generator to the DataLoader; otherwise each "
                "iterator draws its worker seed from the global torch RNG (changing later draws) "
                "and a resumed run gets other worker seeds")
        bs = loader.batch_size
        if bs is None:
            raise UsageError("track(loader) needs a DataLoader with batch_size set (not a batch_sampler)")
        self._reseed()  # the iterator's base seed depends on (seed, epoch, rank) only
        yield from self._count(loader, bs, self.epoch)

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """This rank's state: ``seed, epoch, position, shuffle, num_samples`` (the dataset's
        length), ``num_replicas, rank, drop_last``. Plain ints and bools."""
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position,
                "shuffle": self.shuffle, "num_samples": self.num_samples,
                "num_replicas": self.num_replicas, "rank": self.rank, "drop_last": self.drop_last}

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict` (or a version 0.1 state, which has no sharding keys).

        Raises :class:`SamplerStateError` naming the field when the state does
        not fit. The dataset length must match. A state saved mid-epoch needs
        the same ``num_replicas`` and ``drop_last`` (the shard boundaries depend
        on them); a state at an epoch boundary loads under any sharding. The
        ``rank`` may differ: data-parallel ranks consume the same number of
        samples, so their states differ only in ``rank``.
        """
        if type(state) is not dict:
            raise SamplerStateError(f"a ResumableSampler state is a dict, got {type(state).__name__}")
        keys = set(state)
        if keys != _V1_KEYS and keys != _V2_KEYS:
            ref = _V2_KEYS if keys & (_V2_KEYS - _V1_KEYS) else _V1_KEYS  # the closer version
            missing, extra = sorted(ref - keys), sorted(keys - ref)
            raise SamplerStateError(
                f"a ResumableSampler state has the keys {sorted(_V2_KEYS)} (version 0.1: without "
                f"num_replicas, rank, drop_last); missing {missing}, unexpected {extra}",
                field=(missing or extra or [None])[0])
        for k in ("seed", "epoch", "position", "num_samples", "num_replicas", "rank"):
            if k in state and (type(state[k]) is not int or not 0 <= state[k] <= U64):
                raise SamplerStateError(f"sampler state field {k!r} must be an int in [0, 2**64-1], "
                                        f"got {state[k]!r}", field=k)
        for k in ("shuffle", "drop_last"):
            if k in state and type(state[k]) is not bool:
                raise SamplerStateError(f"sampler state field {k!r} must be a bool, got {state[k]!r}",
                                        field=k)
        replicas, rank = state.get("num_replicas", 1), state.get("rank", 0)
        drop_last = state.get("drop_last", False)
        if replicas < 1:
            raise SamplerStateError("sampler state field 'num_replicas' must be at least 1",
                                    field="num_replicas")
        if rank >= replicas:
            raise SamplerStateError(f"sampler state field 'rank' is {rank}, not below num_replicas "
                                    f"{replicas}", field="rank")
        if state["num_samples"] != self.num_samples:
            raise SamplerStateError(
                f"sampler state field 'num_samples': the state was saved for a dataset of "
                f"{state['num_samples']} samples, this one has {self.num_samples}; the order "
                f"would differ", field="num_samples")
        full = _shard_size(self.num_samples, replicas, drop_last)
        epoch, position = state["epoch"], state["position"]
        if position > full:
            raise SamplerStateError(
                f"sampler state field 'position' is {position}, past the end of the epoch "
                f"({full} samples per rank)", field="position")
        if position == full and full > 0:  # a finished epoch (as version 0.1 saved it)
            epoch, position = min(epoch + 1, U64), 0
        if position > 0:
            for k, saved, mine in (("num_replicas", replicas, self.num_replicas),
                                   ("drop_last", drop_last, self.drop_last)):
                if saved != mine:
                    raise SamplerStateError(
                        f"sampler state field {k!r}: saved mid-epoch (position {position} of "
                        f"{full}) with {k}={saved}, this sampler has {k}={mine}; the shards "
                        f"would differ. Resume with the saved {k}, or from a checkpoint taken "
                        f"at an epoch boundary (those load under any sharding)", field=k)
        self.seed, self.epoch, self.position = state["seed"], epoch, position
        self.shuffle = state["shuffle"]
        self._reseed()
