"""Safety limits applied to every file read (and to objects saved), and the size rule of docs/FORMAT.md §5.3
(``too_large``, which format/container re-exports): one function each for the writer and every reader."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    """Bounds on what a file may declare before any of it is trusted.

    Each bound exists so that a hostile or damaged file fails fast with a clear
    error instead of exhausting memory or the stack. Raise one for a file you
    trust: ``load(f, limits=Limits(max_tensors=5_000_000))``.
    """

    #: Size of the JSON header in bytes (safetensors' own readers cap it at 100 MB).
    max_header_bytes: int = 100_000_000
    #: Nesting depth of containers in the saved object.
    max_depth: int = 256
    #: Number of tensors in one file.
    max_tensors: int = 1_000_000
    #: Number of dimensions of one tensor.
    max_ndim: int = 64
    #: Bytes that the numpy string arrays (dtype ``U`` and ``S``) of one file take together once
    #: built: an array's width is a claim, like a shape, that a few bytes of manifest can make.
    max_string_array_bytes: int = 1 << 28


DEFAULT = Limits()


SIZE_BOUND = 2**63
"""A tensor's non-zero dimensions times its element size stay below this (docs/FORMAT.md §5.3)."""


def too_large(shape: Sequence[int], itemsize: int) -> bool:
    """True when the non-zero dimensions of ``shape`` (non-negative ints) and ``itemsize`` multiply to
    :data:`SIZE_BOUND` (2**63) or more: the rule of docs/FORMAT.md §5.3, the one check of it that
    every reader (header entries, table rows) and the writer make.

    torch and numpy cannot make such a tensor even when it has no elements (a zero dimension):
    torch refuses a dimension of 2**63 or more and a running product past 2**64 - 1 ("numel:
    integer multiplication overflow"), numpy any whose non-zero dimensions times its element size
    pass 2**63 - 1. Stops at the first product past the bound, so a shape of many huge dimensions
    costs no big-int arithmetic.
    """
    n = itemsize
    for d in shape:
        if d:
            n *= d
            if n >= SIZE_BOUND:
                return True
    return False


def exceeds(limits: Limits, name: str, value: int) -> bool:
    """Whether ``value`` is over the limit ``name`` of ``limits`` (docs/FORMAT.md §9.4): each limit is
    the most a file may hold, so ``value`` equal to it passes. The one comparison the writer
    (io/writer.plan: header dimensions, tensors, header bytes) and the readers (format/container,
    format/manifest) make, so that a writer refuses exactly what its readers reject. (``max_depth``
    counts levels: a tagged array at depth ``d`` is level ``d + 1``, which format/tree checks inline on
    every node, in the same terms, for the encoder and the decoder.)"""
    return bool(value > getattr(limits, name))
