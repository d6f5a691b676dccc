"""A small progress bar for long reads, drawn only on a terminal.

The command line wraps the files it reads in :class:`ProgressFile`, which
counts bytes as the library reads them. A bar appears only when the stream it
is drawn on (stderr by default) is a terminal and the file is large
(:data:`MIN_BYTES` or more), so pipes, CI logs and captured output never see
control characters. The bar is erased when the read finishes.

Example::

    with open(path, "rb") as fh, Progress(os.path.getsize(path), "verify ckpt") as bar:
        tensorcanon.verify(ProgressFile(fh, bar))
"""

from __future__ import annotations

import sys
import time
from typing import IO, TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

#: Files smaller than this get no bar: reading them takes well under a second.
MIN_BYTES = 64 << 20

_WIDTH = 30
_INTERVAL = 0.1  # seconds between redraws


def _is_tty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def short_size(n: float) -> str:
    """``20.1 MiB``: a size in at most 9 columns (a progress bar's, a listing's)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover - loop always returns


class Progress:
    """A byte-count progress bar that draws itself only where it should.

    ``enabled=None`` (the default) decides from the stream and the size:
    on only for a terminal and ``total >= min_bytes``. A disabled bar accepts
    every call and writes nothing.
    """

    def __init__(self, total: int, label: str, *, stream: IO[str] | None = None,
                 enabled: bool | None = None, min_bytes: int | None = None) -> None:
        self.total = max(int(total), 0)
        self.label = label
        self.stream = sys.stderr if stream is None else stream
        if enabled is None:
            limit = MIN_BYTES if min_bytes is None else min_bytes
            enabled = _is_tty(self.stream) and self.total >= limit
        self.enabled = enabled
        self.done = 0
        self._last = 0.0
        self._drawn = 0

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def update(self, n: int) -> None:
        """Count ``n`` more bytes; redraw at most every 0.1 s."""
        self.done += n
        if not self.enabled:
            return
        now = time.monotonic()
        if self.done >= self.total:
            self.close()  # finished: erase the bar
        elif now - self._last >= _INTERVAL:
            self._last = now
            self._draw()

    def _draw(self) -> None:
        frac = min(self.done / self.total, 1.0) if self.total else 1.0
        filled = int(frac * _WIDTH)
        line = (f"{self.label} [{'#' * filled}{'.' * (_WIDTH - filled)}] {frac * 100:3.0f}% "
                f"{short_size(self.done)}/{short_size(self.total)}")
        pad = " " * max(self._drawn - len(line), 0)
        self.stream.write("\r" + line + pad)
        self.stream.flush()
        self._drawn = len(line)

    def close(self) -> None:
        """Erase the bar (the line is left blank for what is printed next)."""
        if self.enabled and self._drawn:
            self.stream.write("\r" + " " * self._drawn + "\r")
            self.stream.flush()
            self._drawn = 0


class BinaryReader(Protocol):
    """What :class:`ProgressFile` wraps: a binary file opened for reading, buffered or not
    (``open(path, "rb")``, ``open(path, "rb", buffering=0)``)."""

    def read(self, n: int = -1, /) -> bytes: ...

    def readinto(self, buf: WriteableBuffer, /) -> int | None: ...

    def seek(self, offset: int, whence: int = 0, /) -> int: ...

    def tell(self) -> int: ...

    def seekable(self) -> bool: ...


class ProgressFile:
    """A binary file wrapper that reports every byte read to a :class:`Progress`.

    It forwards ``read``, ``readinto``, ``seek``, ``tell`` and ``seekable``:
    what :func:`tensorcanon.load` and :func:`tensorcanon.verify` use.
    """

    def __init__(self, f: BinaryReader, progress: Progress) -> None:
        self._f = f
        self._progress = progress

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        if data:
            self._progress.update(len(data))
        return data

    def readinto(self, buf: WriteableBuffer) -> int | None:
        got = self._f.readinto(buf)
        if got:
            self._progress.update(got)
        return got

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def seekable(self) -> bool:
        return self._f.seekable()

    def readable(self) -> bool:
        return True

    def __getattr__(self, name: str) -> Any:  # fileno, name, ... for torch.load / numpy
        return getattr(self._f, name)
