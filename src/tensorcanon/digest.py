"""Content digests: xxh3-128, written ``xxh3-128:<32 lowercase hex digits>``.

A tensor's digest covers its dtype name, its shape and its logical bytes, so
equal values give equal digests whatever device or memory layout they had.
The file's digest is the digest of the canonical manifest, which holds every
tensor digest. docs/FORMAT.md, "Digests", is the normative text.
"""

from __future__ import annotations

import re

import xxhash

ALGORITHM = "xxh3-128"
DIGEST_SIZE = 16
_DIGEST_RE = re.compile(r"xxh3-128:[0-9a-f]{32}\Z")


def tensor_prefix(dtype_name: str, shape: tuple[int, ...] | list[int]) -> bytes:
    """The bytes hashed before a tensor's data: ``b"float32[3,4]"``."""
    return f"{dtype_name}[{','.join(map(str, shape))}]".encode("ascii")


def tensor_hasher(dtype_name: str, shape) -> "xxhash.xxh3_128":
    """A streaming hasher already fed with the tensor's dtype and shape."""
    return xxhash.xxh3_128(tensor_prefix(dtype_name, shape))


def manifest_digest(manifest: bytes) -> bytes:
    return xxhash.xxh3_128_digest(manifest)


def to_text(raw: bytes) -> str:
    return f"{ALGORITHM}:{raw.hex()}"


def is_text(text: object) -> bool:
    """True if ``text`` is a well-formed digest string."""
    return isinstance(text, str) and _DIGEST_RE.match(text) is not None


def from_text(text: str) -> bytes:
    if not is_text(text):
        raise ValueError(f"not a digest: {text!r} (expected 'xxh3-128:' and 32 lowercase hex digits)")
    return bytes.fromhex(text[len(ALGORITHM) + 1 :])
