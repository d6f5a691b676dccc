"""The package's version and the versions of the formats it writes and reads, kept apart.

The package (``tensorcanon.__version__``) is numbered by SemVer for its Python API and command
line; the file format (docs/FORMAT.md §1.3), the sharded checkpoint layout (§14) and lockfiles
have integer versions of their own, which change only when their bytes do. CHANGELOG.md says
which package release brought which format version. ``tensorcanon --version`` prints
:func:`describe`.
"""

from __future__ import annotations

from .. import __version__
from ..format.manifest import READABLE_VERSIONS, VERSION
from ..format.sharding import LAYOUT_VERSION


def describe(prog: str = "tensorcanon") -> str:
    """Two lines: the package version, then the format versions it writes (and reads)."""
    from .lockfile import (
        FORMAT_OF,  # lockfile versions it reads -> their file-format versions
        VERSION as LOCKFILE_VERSION,
    )

    reads = ", ".join(map(str, READABLE_VERSIONS))
    locks = ", ".join(map(str, sorted(FORMAT_OF)))
    return (f"{prog} {__version__}\n"
            f"writes file format {VERSION} (reads {reads}), sharded layout {LAYOUT_VERSION}, "
            f"lockfile {LOCKFILE_VERSION} (reads {locks})")
