"""The names FORMAT.md §14 fixes for a sharded checkpoint directory: its format name, the index's
file name, the rank files' names and the keys inside them.

Defined here, in the format layer, so that every layer can recognise a checkpoint directory (a
reader given a directory says how to read it); :mod:`tensorcanon.sharded.layout` checks an index
against them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from . import digest as _digest

#: The format name: the index's ``"format"``, and what ``tensorcanon hash --json``, ``inspect`` and
#: lockfiles report for a checkpoint directory. Defined here only.
FORMAT = "tensorcanon-sharded"
LAYOUT_VERSION = 1
INDEX_NAME = "index.safetensors"
RANK_FILE_RE = re.compile(r"rank-(\d{5,})-of-(\d{5,})\.([0-9a-f]{32}|[0-9a-f]{64})\.safetensors\Z")
PER_RANK_SUFFIX = "@rank"


def rank_file_name(rank: int, world_size: int, file_digest: str) -> str:
    """``rank-00001-of-00004.<hex>.safetensors``: named by its own digest, so a new save
    never overwrites a file an older index references (an equal name means equal bytes)."""
    return f"rank-{rank:05d}-of-{world_size:05d}.{_digest.from_text(file_digest).hex()}.safetensors"


def chunk_key(name: str, offsets: Iterable[int]) -> str:
    """The key of a chunk in its rank file: ``model.w@128,0`` (a 0-d tensor: ``step@``)."""
    return f"{name}@{','.join(str(int(o)) for o in offsets)}"
