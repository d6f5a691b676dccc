"""Data order that resumes exactly: a resumable sampler and a worker seeding function.

The sampler's order for an epoch, and the seed the DataLoader gives its
workers, are pure functions of ``(seed, epoch)``. Its state is three numbers
(seed, epoch, position), so nothing saved mid-epoch is ever "past the shuffle",
and resuming never fetches and discards batches. docs/RNG.md explains the traps
this avoids.
"""

from __future__ import annotations

import random
from typing import Any, Iterator, Sized

import numpy as np
import torch
from torch.utils.data import Sampler

from .errors import TensorCanonError, UsageError

__all__ = ["seed_worker", "ResumableSampler", "SamplerStateError"]

U64 = 2**64 - 1


class SamplerStateError(TensorCanonError, ValueError):
    """A sampler state does not fit this sampler (other dataset size, bad field)."""


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


def _derive(seed: int, epoch: int, stream: int) -> int:
    """A 64-bit seed for one (seed, epoch, stream), through numpy's SeedSequence."""
    return int(np.random.SeedSequence([seed, epoch, stream]).generate_state(1, np.uint64)[0])


class ResumableSampler(Sampler[int]):
    """A (shuffled) sampler whose position can be saved and resumed mid-epoch.

    The order of epoch ``e`` is a permutation drawn from a generator seeded
    with ``(seed, e)``; :attr:`generator`, which you pass to the DataLoader as
    ``generator=``, is re-seeded from ``(seed, e)`` whenever an epoch is
    iterated, so the DataLoader's worker base seed is a function of the epoch
    too and the global torch RNG is never touched by creating an iterator.

    :meth:`track` wraps the loader and counts the batches your loop has
    received (with workers, the DataLoader reads the sampler ahead of the
    loop, so the sampler cannot count them itself). :meth:`state_dict`
    returns ``{"seed", "epoch", "position", "shuffle", "num_samples"}``.

    Example::

        sampler = tensorcanon.ResumableSampler(ds, seed=0)
        loader = DataLoader(ds, batch_size=32, sampler=sampler, num_workers=2,
                            generator=sampler.generator, worker_init_fn=tensorcanon.seed_worker)
        for epoch in range(sampler.epoch, epochs):
            sampler.set_epoch(epoch)            # keeps the position when resuming into this epoch
            for x, y in sampler.track(loader):
                ...                             # train; checkpoint sampler.state_dict() any time
    """

    def __init__(self, data_source: Sized, *, shuffle: bool = True, seed: int = 0) -> None:
        if type(seed) is not int or not 0 <= seed <= U64:
            raise UsageError(f"seed must be an int in [0, 2**64-1], got {seed!r}")
        self.num_samples = len(data_source)
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self.generator = torch.Generator()
        self._reseed()

    def _reseed(self) -> None:
        self.generator.manual_seed(_derive(self.seed, self.epoch, 1))

    def order(self, epoch: int | None = None) -> list[int]:
        """The full index order of ``epoch`` (default: the current one)."""
        e = self.epoch if epoch is None else epoch
        if not self.shuffle:
            return list(range(self.num_samples))
        g = torch.Generator()
        g.manual_seed(_derive(self.seed, e, 0))
        return torch.randperm(self.num_samples, generator=g).tolist()

    def set_epoch(self, epoch: int) -> None:
        """Move to ``epoch`` at position 0; a no-op when already in ``epoch`` (so a resumed
        run may call it unconditionally)."""
        if type(epoch) is not int or epoch < 0:
            raise UsageError(f"epoch must be a non-negative int, got {epoch!r}")
        if epoch != self.epoch:
            self.epoch, self.position = epoch, 0
        self._reseed()

    def __iter__(self) -> Iterator[int]:
        return iter(self.order()[self.position:])

    def __len__(self) -> int:
        return self.num_samples - self.position

    def advance(self, n: int) -> None:
        """Count ``n`` more samples as consumed (what :meth:`track` does per batch)."""
        self.position = min(self.position + n, self.num_samples)

    def track(self, loader: torch.utils.data.DataLoader) -> Iterator[Any]:
        """Iterate ``loader`` (built on this sampler), counting each batch as it is received.

        Raises :class:`ValueError` when the loader does not use this sampler
        or this sampler's :attr:`generator` (without it the DataLoader draws
        its worker seed from the global torch RNG, which breaks resumption).
        When the loader is exhausted the epoch counts as complete.
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
        self._reseed()  # the iterator's base seed depends on (seed, epoch) only
        for batch in loader:
            self.advance(bs)
            yield batch
        self.position = self.num_samples

    def state_dict(self) -> dict:
        """``{"seed", "epoch", "position", "shuffle", "num_samples"}`` (plain ints and a bool)."""
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position,
                "shuffle": self.shuffle, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict`; raises :class:`SamplerStateError` when it does not fit."""
        keys = {"seed", "epoch", "position", "shuffle", "num_samples"}
        if type(state) is not dict or set(state) != keys:
            raise SamplerStateError(f"a ResumableSampler state is a dict with exactly the keys {sorted(keys)}")
        ints = [state[k] for k in ("seed", "epoch", "position", "num_samples")]
        if not all(type(v) is int and v >= 0 for v in ints) or type(state["shuffle"]) is not bool:
            raise SamplerStateError("seed, epoch, position and num_samples must be non-negative ints, "
                                    "shuffle a bool")
        if state["num_samples"] != self.num_samples:
            raise SamplerStateError(
                f"the state was saved for {state['num_samples']} samples, this dataset has "
                f"{self.num_samples}: the order would differ")
        if state["position"] > self.num_samples or state["seed"] > U64:
            raise SamplerStateError(f"position {state['position']} is past the end ({self.num_samples})")
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]
        self.shuffle = state["shuffle"]
        self._reseed()
