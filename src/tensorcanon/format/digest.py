"""Content digests, written ``<algorithm>:<lowercase hex>``.

Two algorithms, recorded in the manifest's ``"algorithm"`` field:

- ``xxh3-128`` (the default): 16 bytes, ``xxh3-128:<32 hex digits>``; fast,
  not cryptographic: it detects accidents, not attackers.
- ``sha256`` (opt-in): 32 bytes, ``sha256:<64 hex digits>``; cryptographic,
  for tamper-evidence against a digest obtained out of band
  (docs/SECURITY.md).

A tensor's digest covers its dtype name, its shape and its logical bytes, so
equal values give equal digests whatever device or memory layout they had.
The file's digest is the digest of the canonical manifest, which holds every
tensor digest. docs/FORMAT.md, "Digests", is the normative text.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import xxhash

from .errors import UnsupportedAlgorithmError, UsageError
from .ordering import MAX_SAME_HASH

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer


class Hasher(Protocol):
    """A streaming hash (hashlib's and xxhash's objects are ones)."""

    def update(self, data: ReadableBuffer, /) -> None: ...

    def digest(self) -> bytes: ...

#: The algorithm used unless one is asked for; its files are the golden vectors.
DEFAULT = "xxh3-128"
#: Supported algorithms and the size of their raw digests, in bytes.
ALGORITHMS: dict[str, int] = {"xxh3-128": 16, "sha256": 32}

# Kept for callers of the single-algorithm API: the default's name and size.
ALGORITHM = DEFAULT
DIGEST_SIZE = ALGORITHMS[DEFAULT]

_TEXT_RE = re.compile(r"(xxh3-128:[0-9a-f]{32}|sha256:[0-9a-f]{64})\Z")


def _forms() -> str:
    return " or ".join(f"'{a}:' and {2 * n} lowercase hex digits" for a, n in ALGORITHMS.items())


def check(algorithm: Any) -> str:
    """``algorithm`` if it is supported, else :class:`UnsupportedAlgorithmError` listing those that are."""
    if type(algorithm) is str and algorithm in ALGORITHMS:
        return algorithm
    raise UnsupportedAlgorithmError(
        f"digest algorithm {algorithm!r} is not supported; use one of {sorted(ALGORITHMS)} "
        f"(default {DEFAULT!r})", algorithm=algorithm,
    )


def size(algorithm: str = DEFAULT) -> int:
    """Bytes in one raw digest of ``algorithm``."""
    return ALGORITHMS[check(algorithm)]


def tensor_prefix(dtype_name: str, shape: tuple[int, ...] | list[int]) -> bytes:
    """The bytes hashed before a tensor's data: ``b"float32[3,4]"``."""
    return f"{dtype_name}[{','.join(map(str, shape))}]".encode("ascii")


def constructor(algorithm: str) -> Callable[[bytes], Hasher]:
    """The hash object constructor of ``algorithm`` (called with the first bytes to hash). Every
    tensor hasher is made through it: wrap it to watch what is hashed (the tests do)."""
    new: Callable[[bytes], Hasher] = hashlib.sha256 if check(algorithm) == "sha256" else xxhash.xxh3_128
    return new


def tensor_hasher(dtype_name: str, shape: tuple[int, ...] | list[int], algorithm: str = DEFAULT) -> Hasher:
    """A streaming hasher (``update``, ``digest``) already fed with the tensor's dtype and shape
    (:class:`Hashers` makes them for many tensors)."""
    return constructor(algorithm)(tensor_prefix(dtype_name, shape))


class Hashers:
    """Makes tensor hashers (:func:`tensor_hasher`) for one file's tensors, building each (dtype, shape)
    prefix once: a file of many tensors has few distinct shapes.

    Shapes must be tuples of ints (as torch gives them and the reader validates
    them): as a key, ``(True,)`` would pass for ``(1,)``.

    A file can give many shapes one Python hash (a tuple's hash is a function of its ints'), and
    a dict of them takes time quadratic in their number: at most ``ordering.MAX_SAME_HASH`` keys
    of one hash are cached (counted in ``_counts``); the prefixes of any others are built each time.
    """

    __slots__ = ("algorithm", "_new", "_prefixes", "_counts")

    def __init__(self, algorithm: str) -> None:
        self.algorithm = check(algorithm)
        self._new = constructor(algorithm)
        self._prefixes: dict[tuple[str, tuple[int, ...]], bytes] = {}
        self._counts: dict[int, int] = {}  # hash of a key -> how many keys of that hash are cached

    def __call__(self, dtype_name: str, shape: tuple[int, ...]) -> Hasher:
        return self._new(self.prefix(dtype_name, shape))

    def prefix(self, dtype_name: str, shape: tuple[int, ...]) -> bytes:
        """The bytes a tensor's hasher is fed first (:func:`tensor_prefix`); ``self.new(prefix)`` is
        then ``self(dtype_name, shape)`` (a loop over many tensors of one shape asks once)."""
        key = (dtype_name, shape)
        prefix = self._prefixes.get(key)
        if prefix is None:
            prefix = tensor_prefix(dtype_name, shape)
            h = hash(key)
            n = self._counts.get(h, 0)
            if n < MAX_SAME_HASH:
                self._counts[h] = n + 1
                self._prefixes[key] = prefix
        return prefix

    @property
    def new(self) -> Callable[[bytes], Hasher]:
        """A hasher fed ``prefix`` (see :meth:`prefix`)."""
        return self._new


def manifest_digest(manifest: bytes, algorithm: str = DEFAULT) -> bytes:
    """The file digest: the raw digest of the canonical manifest bytes."""
    if check(algorithm) == "sha256":
        return hashlib.sha256(manifest).digest()
    return xxhash.xxh3_128_digest(manifest)


def to_text(raw: bytes, algorithm: str = DEFAULT) -> str:
    """``"<algorithm>:<hex>"`` for a raw digest of ``algorithm``."""
    if len(raw) != size(algorithm):
        raise ValueError(f"a {algorithm} digest has {size(algorithm)} bytes, not {len(raw)}")
    return f"{algorithm}:{raw.hex()}"


def is_text(text: object) -> bool:
    """True if ``text`` is a well-formed digest string of any supported algorithm."""
    return isinstance(text, str) and _TEXT_RE.match(text) is not None


def parse_text(text: str) -> tuple[str, bytes]:
    """``(algorithm, raw digest)`` of a digest string such as ``"sha256:<64 hex>"``."""
    if not is_text(text):
        raise ValueError(f"not a digest: {text!r} (expected {_forms()})")
    algorithm, _, hexdigits = text.partition(":")
    return algorithm, bytes.fromhex(hexdigits)


def algorithm_of(text: str) -> str:
    """The algorithm named by a well-formed digest string."""
    return parse_text(text)[0]


def from_text(text: str) -> bytes:
    """The raw bytes of a digest string of any supported algorithm (see :func:`parse_text`)."""
    return parse_text(text)[1]


def text_error(text: str) -> str:
    """Why ``text`` is not a digest string, for error messages."""
    return f"{text!r} is not a digest (expected {_forms()})"


def same_content(a: str, b: str, versions: tuple[int, int] | None = None) -> bool | None:
    """Whether two files (or sharded checkpoints, by their logical digest) hold the same content,
    decided by their file digests in text form (:func:`to_text`): the one rule of equality that
    ``diff``, ``verify --expect``, lockfiles and stores share (docs/FORMAT.md §7.2: the file digest
    covers the whole content, and devices and memory formats only are outside it).

    True when the digests are equal; False when they differ and decide (one algorithm, and one
    format version when ``versions`` gives both files' versions); None when digests cannot decide,
    because the algorithms or the format versions differ (the same content has other digests
    then: compare the values). A malformed digest is a :class:`UsageError`.

    Example::

        same_content(cf_a.digest, cf_b.digest, (cf_a.manifest.version, cf_b.manifest.version))
    """
    if not (is_text(a) and is_text(b)):
        raise UsageError(f"same_content compares file digests: {text_error(a if not is_text(a) else b)}")
    if a == b:
        return True
    if algorithm_of(a) != algorithm_of(b):
        return None
    if versions is not None and versions[0] != versions[1]:
        return None
    return False
