"""Per-sample random state: augmentation inside ``Dataset.__getitem__`` that resumes exactly.

:class:`SeededDataset` seeds Python's ``random``, numpy's global generator and
torch's CPU generator from ``(seed, epoch, index)`` around every sample it
loads, and puts the process's own states back afterwards. What a sample draws
therefore depends on the sample alone: not on the worker that loads it, the
number of workers, what that worker loaded before, or whether the run was
resumed. The derivation is fixed (docs/RNG.md, "Per-sample randomness"); a test
pins its values, because changing it would change every seeded run's data.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from .data import U64, ResumableSampler, SampleIndex
from .errors import UsageError

__all__ = ["SeededDataset"]

# Domain tag: the first entropy word, so these seeds never coincide with the sampler's own
# SeedSequence([seed, epoch, stream]) derivations (those have at most six words, these seven).
_TAG = 0x74635344  # "tcSD"
_M32 = 0xFFFFFFFF


def _sample_seeds(seed: int, epoch: int, index: int) -> tuple[int, np.ndarray, int]:
    """The seeds for one sample: ``(python_seed, numpy_words, torch_seed)``.

    ``SeedSequence`` gets the seven 32-bit words ``[TAG, seed_lo, seed_hi,
    epoch_lo, epoch_hi, index_lo, index_hi]`` and generates ten 32-bit words
    ``w``. Python's ``random.seed`` gets the int ``w0 + w1·2³² + w2·2⁶⁴ + w3·2⁹⁶``,
    ``numpy.random.seed`` the array ``w4..w7``, torch's CPU generator
    ``manual_seed(w8 + w9·2³²)``. Frozen: a test pins these values.
    """
    entropy = np.array([_TAG, seed & _M32, seed >> 32, epoch & _M32, epoch >> 32,
                        index & _M32, index >> 32], dtype=np.uint32)
    w = np.random.SeedSequence(entropy).generate_state(10, np.uint32).tolist()
    python_seed = w[0] | w[1] << 32 | w[2] << 64 | w[3] << 96
    return python_seed, np.array(w[4:8], dtype=np.uint32), w[8] | w[9] << 32


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

    Wrapping makes ``sampler`` yield :class:`tensorcanon.data.SampleIndex`
    values: ints that also carry the seed and the epoch, so the epoch reaches
    a persistent worker whose copy of the sampler is stale. Build the
    DataLoader with ``sampler=`` that same sampler; any other sampler yields
    plain ints, which raise :class:`tensorcanon.UsageError`. CUDA generators
    are not seeded per sample.

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

    def __getitems__(self, indices: Sequence[SampleIndex]) -> list:
        """Load a batch (the DataLoader calls this once per batch): the global states are
        saved once and restored once, each sample is seeded on its own."""
        keys = [_check(i) for i in indices]
        torch_gen = torch.default_generator
        # legacy=True is the faster form, but only MT19937 (numpy's default) has it
        legacy = isinstance(np.random.mtrand._rand._bit_generator, np.random.MT19937)
        numpy_state = np.random.get_state(legacy=True) if legacy else np.random.get_state(legacy=False)
        saved = random.getstate(), numpy_state, torch_gen.get_state()
        try:
            out = []
            for index, (python_seed, numpy_words, torch_seed) in keys:
                random.seed(python_seed)
                np.random.seed(numpy_words)
                torch_gen.manual_seed(torch_seed)
                out.append(self.dataset[index])
            return out
        finally:
            random.setstate(saved[0])
            np.random.set_state(saved[1])
            torch_gen.set_state(saved[2])

    def __getstate__(self) -> dict:
        # Workers need only the dataset: the seed and epoch travel with each index.
        return {"dataset": self.dataset, "sampler": None}


def _check(index: Any) -> tuple[int, tuple[int, np.ndarray, int]]:
    if not isinstance(index, SampleIndex):
        raise UsageError(
            f"SeededDataset got the index {index!r} ({type(index).__name__}), which carries no "
            "epoch: build the DataLoader with sampler=<the ResumableSampler given to "
            "SeededDataset> (not shuffle=True or another sampler), or index it with "
            "tensorcanon.data.SampleIndex(index, epoch, seed)")
    i, epoch, seed = int(index), index.epoch, index.seed
    if not (0 <= i <= U64 and type(epoch) is int and 0 <= epoch <= U64
            and type(seed) is int and 0 <= seed <= U64):
        raise UsageError(f"SeededDataset: {index!r} is out of range (index, epoch and seed must "
                         "be ints in [0, 2**64-1])")
    return i, _sample_seeds(seed, epoch, i)
