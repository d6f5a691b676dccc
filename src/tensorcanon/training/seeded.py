"""Seeded random state for data loading: augmentation in ``Dataset.__getitem__`` and random
work in a ``collate_fn`` that resume exactly.

:class:`SeededDataset` seeds Python's ``random``, numpy's global generator and
torch's CPU generator from ``(seed, epoch, index)`` around every sample it
loads, and :class:`SeededCollator` from ``(seed, epoch, batch position)``
around every batch it collates; both put the process's own states back
afterwards. What a sample or a batch draws therefore depends on it alone: not
on the worker that loads it, the number of workers, what that worker loaded
before, or whether the run was resumed. The derivations are fixed (docs/RNG.md,
"Per-sample randomness" and "Per-batch randomness"); tests pin their values,
because changing them would change every seeded run's data.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, default_collate

from ..format.errors import UsageError
from .data import U64, ResumableSampler, SampleIndex

__all__ = ["SeededDataset", "SeededCollator", "SeededBatch"]

# Domain tags: the first entropy word, so these seeds never coincide with each other's or with the
# sampler's own SeedSequence([seed, epoch, stream]) derivations (those have at most six words,
# these seven).
_TAG = 0x74635344  # "tcSD": a sample
_BATCH_TAG = 0x74634243  # "tcBC": a batch
_M32 = 0xFFFFFFFF

Seeds = tuple[int, np.ndarray, int]  # (python_seed, numpy_words, torch_seed)


def _words(tag: int, seed: int, epoch: int, index: int, count: int) -> list[int]:
    """``count`` 32-bit words from ``SeedSequence([tag, seed_lo, seed_hi, epoch_lo, epoch_hi,
    index_lo, index_hi])``. Frozen: tests pin the values."""
    entropy = np.array([tag, seed & _M32, seed >> 32, epoch & _M32, epoch >> 32,
                        index & _M32, index >> 32], dtype=np.uint32)
    return np.random.SeedSequence(entropy).generate_state(count, np.uint32).tolist()


def _split(w: list[int]) -> Seeds:
    """Words ``w0..w9`` as ``(w0 + w1·2³² + w2·2⁶⁴ + w3·2⁹⁶, [w4..w7], w8 + w9·2³²)``."""
    return w[0] | w[1] << 32 | w[2] << 64 | w[3] << 96, np.array(w[4:8], dtype=np.uint32), w[8] | w[9] << 32


def _sample_seeds(seed: int, epoch: int, index: int) -> Seeds:
    """The seeds for one sample: ``(python_seed, numpy_words, torch_seed)``.

    ``SeedSequence`` gets the seven 32-bit words ``[TAG, seed_lo, seed_hi,
    epoch_lo, epoch_hi, index_lo, index_hi]`` and generates ten 32-bit words
    ``w``. Python's ``random.seed`` gets the int ``w0 + w1·2³² + w2·2⁶⁴ + w3·2⁹⁶``,
    ``numpy.random.seed`` the array ``w4..w7``, torch's CPU generator
    ``manual_seed(w8 + w9·2³²)``. Frozen: a test pins these values.
    """
    return _split(_words(_TAG, seed, epoch, index, 10))


def _batch_seeds(seed: int, epoch: int, position: int) -> tuple[Seeds, int]:
    """The seeds for one batch: those of :func:`_sample_seeds` from the words of
    ``[BATCH_TAG, seed, epoch, position]``, and ``w10 + w11·2³²`` for the generator
    :class:`SeededCollator` hands in. Frozen: a test pins these values."""
    w = _words(_BATCH_TAG, seed, epoch, position, 12)
    return _split(w), w[10] | w[11] << 32


class _GlobalStates:
    """Saves Python's, numpy's and torch's global CPU generator states on entry and puts them
    back on exit (also after an exception); :meth:`seed` seeds all three in between."""

    def __enter__(self) -> _GlobalStates:
        # legacy=True is the faster form, but only MT19937 (numpy's default) has it
        legacy = isinstance(np.random.mtrand._rand._bit_generator, np.random.MT19937)
        numpy_state = np.random.get_state(legacy=True) if legacy else np.random.get_state(legacy=False)
        self._saved = random.getstate(), numpy_state, torch.default_generator.get_state()
        return self

    def seed(self, seeds: Seeds) -> None:
        python_seed, numpy_words, torch_seed = seeds
        random.seed(python_seed)
        np.random.seed(numpy_words)
        torch.default_generator.manual_seed(torch_seed)

    def __exit__(self, *exc: object) -> None:
        python_state, numpy_state, torch_state = self._saved
        random.setstate(python_state)
        np.random.set_state(numpy_state)
        torch.default_generator.set_state(torch_state)


class SeededBatch(list):
    """The list of samples :meth:`SeededDataset.__getitems__` returns: a ``list`` that also
    carries ``key``, the ``(seed, epoch, position)`` of its first sample (None when that index
    had no position), from which :class:`SeededCollator` seeds the batch."""

    key: tuple[int, int, int] | None = None


class SeededDataset(Dataset):
    """Wraps a map-style dataset so each sample's random draws are a pure function of
    ``(sampler.seed, epoch, index)``.

    Around every ``__getitem__`` of ``dataset`` it seeds Python's ``random``,
    numpy's global generator and torch's CPU generator from the sample's
    ``(seed, epoch, index)``, then restores the states they had before, in
    whichever process loads the sample (a DataLoader worker or the main
    process, where dropout must not see the loading). Random augmentation
    written the ordinary way (``torch.rand``, ``np.random.*``, ``random.*``,
    torchvision transforms) then gives the same batches with any number of
    workers, with or without ``persistent_workers``, and resumes bit-exactly
    at any batch.

    Wrapping makes ``sampler`` yield :class:`tensorcanon.training.data.SampleIndex`
    values: ints that also carry the seed and the epoch, so the epoch reaches
    a persistent worker whose copy of the sampler is stale. Build the
    DataLoader with ``sampler=`` that same sampler; any other sampler yields
    plain ints, which raise :class:`tensorcanon.UsageError`. CUDA generators
    are not seeded per sample. The batches it returns carry the key
    :class:`SeededCollator` seeds random collation from.

    Example::

        sampler = tensorcanon.ResumableSampler(images, seed=1)
        seeded = tensorcanon.SeededDataset(images, sampler)   # images[i] may use random transforms
        loader = DataLoader(seeded, batch_size=64, sampler=sampler, num_workers=4,
                            generator=sampler.generator, persistent_workers=True)
        for x, y in sampler.track(loader):
            ...
    """

    def __init__(self, dataset: Dataset, sampler: ResumableSampler) -> None:
        if not isinstance(sampler, ResumableSampler):
            raise UsageError(f"SeededDataset(dataset, sampler): sampler must be a "
                             f"tensorcanon.ResumableSampler, got {type(sampler).__name__}")
        n = len(dataset)  # type: ignore[arg-type]  # torch's Dataset declares no __len__; map-style ones have it
        if n != sampler.num_samples:
            raise UsageError(f"SeededDataset(dataset, sampler): the dataset has {n} samples, "
                             f"the sampler was built for {sampler.num_samples}")
        self.dataset = dataset
        self.sampler = sampler
        sampler._sample_indices = True

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]  # (as in __init__)

    def __getitem__(self, index: SampleIndex) -> Any:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[SampleIndex]) -> SeededBatch:
        """Load a batch (the DataLoader calls this once per batch): the global states are
        saved once and restored once, each sample is seeded on its own. The list returned
        carries the batch's key for :class:`SeededCollator`."""
        keys = [_check(i) for i in indices]
        out = SeededBatch()
        with _GlobalStates() as states:
            for index, seeds in keys:
                states.seed(seeds)
                out.append(self.dataset[index])
        if keys and (position := indices[0].position) is not None:
            out.key = (indices[0].seed, indices[0].epoch, position)
        return out

    def __getstate__(self) -> dict:
        # Workers need only the dataset: the seed and epoch travel with each index.
        return {"dataset": self.dataset, "sampler": None}


# The key of the batch a SeededCollator is collating in this thread, for a SeededCollator nested
# inside a wrapper that rebuilt the list (such as transformers' RemoveColumnsCollator).
_active = threading.local()


class SeededCollator:
    """Wraps a ``collate_fn`` so each batch's random draws are a pure function of
    ``(seed, epoch, batch position)``.

    Around every call of ``collate_fn`` it seeds Python's ``random``, numpy's
    global generator and torch's CPU generator from the batch's key, then
    restores the states they had before, in whichever process collates (a
    DataLoader worker or the main process, where dropout must not see it).
    Random collation written the ordinary way (MLM masking with
    ``torch.bernoulli``, mixup with ``np.random.beta``, random crops with
    ``random.randint``) then gives the same batches with any number of workers,
    with or without ``persistent_workers``, and resumes bit-exactly at any batch.

    The key travels with the samples: wrap the dataset in
    :class:`tensorcanon.SeededDataset` on a :class:`tensorcanon.ResumableSampler`
    and build the DataLoader with ``sampler=`` that sampler; the batch's key is
    the sampler's seed (or ``seed``, when given), the epoch, and the
    :attr:`~tensorcanon.training.data.SampleIndex.position` of its first sample (``k·batch_size``
    for batch ``k`` of an epoch, on one process). Any other batch raises
    :class:`tensorcanon.UsageError`.

    With ``generator=True``, ``collate_fn(samples, generator)`` also gets a
    ``torch.Generator`` seeded from the key (a stream of its own, not the global one's).
    ``collate_fn`` defaults to torch's ``default_collate``. CUDA generators and
    generators the collate function holds itself (e.g.
    ``DataCollatorForLanguageModeling(seed=...)``) are not seeded per batch.

    Example::

        sampler = tensorcanon.ResumableSampler(texts, seed=1)
        loader = DataLoader(tensorcanon.SeededDataset(texts, sampler), batch_size=32, sampler=sampler,
                            collate_fn=tensorcanon.SeededCollator(mask_tokens), num_workers=4,
                            generator=sampler.generator)
    """

    def __init__(self, collate_fn: Callable[..., Any] | None = None, *, seed: int | None = None,
                 generator: bool = False) -> None:
        if collate_fn is not None and not callable(collate_fn):
            raise UsageError(f"SeededCollator(collate_fn): collate_fn must be callable, got "
                             f"{type(collate_fn).__name__}")
        if seed is not None and (type(seed) is not int or not 0 <= seed <= U64):
            raise UsageError(f"SeededCollator(seed=...) must be None or an int in [0, 2**64-1], got {seed!r}")
        self.collate_fn: Callable[..., Any] = default_collate if collate_fn is None else collate_fn
        self.seed = seed
        self.generator = bool(generator)

    def __call__(self, batch: Sequence[Any]) -> Any:
        key = batch.key if isinstance(batch, SeededBatch) else getattr(_active, "key", None)
        if key is None:
            raise UsageError(
                f"SeededCollator got a {type(batch).__name__} of samples that carries no batch key: wrap "
                "the dataset in tensorcanon.SeededDataset(dataset, sampler) and build the DataLoader with "
                "sampler=<that ResumableSampler> (not shuffle=True, another sampler or a batch_sampler "
                "that makes its own indices)")
        seed, epoch, position = key
        seeds, generator_seed = _batch_seeds(seed if self.seed is None else self.seed, epoch, position)
        samples = list(batch)
        outer = getattr(_active, "key", None)
        _active.key = key
        try:
            with _GlobalStates() as states:
                states.seed(seeds)
                if self.generator:
                    g = torch.Generator()
                    g.manual_seed(generator_seed)
                    return self.collate_fn(samples, g)
                return self.collate_fn(samples)
        finally:
            _active.key = outer

    def __repr__(self) -> str:
        extra = "" if self.seed is None else f", seed={self.seed}"
        extra += ", generator=True" if self.generator else ""
        return f"SeededCollator({self.collate_fn!r}{extra})"


def _check(index: Any) -> tuple[int, Seeds]:
    if not isinstance(index, SampleIndex):
        raise UsageError(
            f"SeededDataset got the index {index!r} ({type(index).__name__}), which carries no "
            "epoch: build the DataLoader with sampler=<the ResumableSampler given to "
            "SeededDataset> (not shuffle=True or another sampler), or index it with "
            "tensorcanon.training.data.SampleIndex(index, epoch, seed)")
    i, epoch, seed, position = int(index), index.epoch, index.seed, index.position
    if not (0 <= i <= U64 and type(epoch) is int and 0 <= epoch <= U64
            and type(seed) is int and 0 <= seed <= U64
            and (position is None or (type(position) is int and 0 <= position <= U64))):
        raise UsageError(f"SeededDataset: {index!r} is out of range (index, epoch, seed and position "
                         "must be ints in [0, 2**64-1])")
    return i, _sample_seeds(seed, epoch, i)
