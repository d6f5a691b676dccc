"""Safety limits applied to every file read (and to objects saved)."""

from __future__ import annotations

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


def exceeds(limits: Limits, name: str, value: int) -> bool:
    """Whether ``value`` is over the limit ``name`` of ``limits`` (docs/FORMAT.md §9.4): each limit is
    the most a file may hold, so ``value`` equal to it passes. The one comparison the writer
    (io/writer.plan: header dimensions, tensors, header bytes) and the readers (format/container,
    format/manifest) make, so that a writer refuses exactly what its readers reject. (``max_depth``
    counts levels: a tagged array at depth ``d`` is level ``d + 1``, which format/tree checks inline on
    every node, in the same terms, for the encoder and the decoder.)"""
    return bool(value > getattr(limits, name))
