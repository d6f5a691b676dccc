"""Which file system a benchmark's files are on (shared by run.py and compare.py)."""

from __future__ import annotations

import os


def filesystem_of(path: str) -> str:
    """'<fstype> at <mount point>' for the mount that holds ``path`` (Linux), else the path."""
    path = os.path.realpath(path)
    best = ("", "")
    try:
        with open("/proc/mounts") as fh:
            for line in fh:
                parts = line.split()
                if len(parts) >= 3 and (path == parts[1] or path.startswith(parts[1].rstrip("/") + "/")):
                    if len(parts[1]) > len(best[0]):
                        best = (parts[1], parts[2])
    except OSError:
        pass
    return f"{best[1]} at {best[0]}" if best[0] else path
