"""Built-in codecs for standard-library values that checkpoints often hold.

Training configurations (Lightning's ``hparams``, argparse results) hold
``pathlib`` paths, ``argparse.Namespace`` objects and dates; tensorcanon saves
only values it has been told how to store, so these are opt-in registrations
(:func:`tensorcanon.register` with a codec the format specifies,
docs/FORMAT.md §6.9):

=======================  ===========================  =================================
call                     values                       recorded as ``["obj", name, ...]``
=======================  ===========================  =================================
:func:`register_paths`   ``PurePath`` and subclasses  ``pathlib.PurePath``: [kind, text]
:func:`register_datetime` ``date``, ``time``,         ``datetime.date`` / ``.time`` /
                         ``datetime``, ``timedelta``  ``.datetime`` / ``.timedelta``: ints
:func:`register_namespace` ``argparse.Namespace``     ``argparse.Namespace``: a dict
:func:`register_all`     all of the above
=======================  ===========================  =================================

Why opt-in: each codec fixes a choice a program may not want made silently. A
path is stored as text and comes back as the same kind of path (a
``WindowsPath`` cannot be built on Linux); a datetime's time zone must be a
fixed offset (zone rules live in a tz database that changes, so ``ZoneInfo``
values are refused). The process that loads a file must enable the same codecs,
as for any registered type.

``argparse.Namespace`` is on from import (issue 30: ``'args': args`` is in every epoch
checkpoint of torchvision's reference scripts): its state is the dict of its attributes,
whose values go through the same allow-list as any value; it comes back with its attributes
in canonical order. Files written while it was opt-in read the same (same name, same state).
:func:`register_namespace` turns it back on after ``tensorcanon.unregister(argparse.Namespace)``.

One more codec is always on: ``io.BytesIO`` (recorded as ``["obj", "io.BytesIO", <bytes>]``),
the opaque state that training code and ``torch.distributed.checkpoint`` keep as byte items
(a pickled loss history, a data loader's state). It makes no choice for the program: its
content is ``getvalue()``, the whole buffer (as DCP's own writer stores it), and it loads as
``io.BytesIO(content)``, at position 0. Saving it never pickles; loading it never unpickles
(what the program does with the bytes afterwards is its own business).
:func:`register_bytes_io` turns it back on after ``tensorcanon.unregister(io.BytesIO)``.

Example::

    tensorcanon.register_builtin_codecs()
    tensorcanon.save({"hparams": {"data_dir": pathlib.Path("/data")}}, "ckpt.safetensors")
    tensorcanon.loads(tensorcanon.dumps({"losses": io.BytesIO(b"...")}))  # no call needed
"""

from __future__ import annotations

import argparse
import datetime as _dt
import io
import pathlib
from collections.abc import Callable, Iterable
from typing import Any

from . import registry
from .errors import UnsupportedTypeError, UsageError

__all__ = ["register_paths", "register_datetime", "register_namespace", "register_bytes_io", "register_all",
           "NAMES"]

PATH = "pathlib.PurePath"
DATE, TIME, DATETIME, TIMEDELTA = "datetime.date", "datetime.time", "datetime.datetime", "datetime.timedelta"
NAMESPACE = "argparse.Namespace"
BYTES_IO = "io.BytesIO"

#: Registration name -> the call that enables it (for error messages). ``io.BytesIO`` and
#: ``argparse.Namespace`` are on from import; their calls only turn them back on after ``unregister``.
NAMES = {PATH: "register_paths", DATE: "register_datetime", TIME: "register_datetime",
         DATETIME: "register_datetime", TIMEDELTA: "register_datetime", NAMESPACE: "register_namespace",
         BYTES_IO: "register_bytes_io"}


# ------------------------------------------------------------------ paths

_PATH_KINDS = {
    "PurePosixPath": pathlib.PurePosixPath, "PureWindowsPath": pathlib.PureWindowsPath,
    "PosixPath": pathlib.PosixPath, "WindowsPath": pathlib.WindowsPath,
}
_PURE = {"PurePosixPath": pathlib.PurePosixPath, "PosixPath": pathlib.PurePosixPath,
         "PureWindowsPath": pathlib.PureWindowsPath, "WindowsPath": pathlib.PureWindowsPath}


def _path_kind(p: pathlib.PurePath) -> str:
    """Which of the four standard path classes ``p`` is, or derives from."""
    if isinstance(p, pathlib.Path):
        return type(pathlib.Path(p)).__name__  # PosixPath or WindowsPath (3.12+ subclasses of Path too)
    for name in ("PurePosixPath", "PureWindowsPath"):
        if isinstance(p, _PATH_KINDS[name]):
            return name
    return type(pathlib.PurePath(p)).__name__


def posix_text_is_canonical(text: str) -> bool:
    """docs/FORMAT.md §6.9.1: ``.``, or an optional root ``/`` or ``//`` followed by non-empty
    components other than ``.``, separated by single ``/``, with no trailing ``/``."""
    if text == ".":
        return True
    if text.startswith("//") and not text.startswith("///"):
        root, body = "//", text[2:]
    elif text.startswith("/"):
        root, body = "/", text[1:]
    else:
        root, body = "", text
    if body.startswith("/"):
        return False
    if not body:
        return root != ""
    return all(part not in ("", ".") for part in body.split("/"))


def _encode_path(p: pathlib.PurePath) -> list:
    kind = _path_kind(p)
    return [kind, str(p)]


def _decode_path(state: Any) -> pathlib.PurePath:
    kind, text = _path_state(state)
    try:
        return _PATH_KINDS[kind](text)
    except NotImplementedError:  # (Python < 3.13) or UnsupportedOperation, a NotImplementedError subclass
        raise ValueError(f"a {kind} cannot be created on this system; load the file where it was "
                         f"saved, or save pathlib.Pure{kind.removesuffix('Path').removeprefix('Pure')}Path "
                         "values instead") from None


def _path_state(state: Any) -> tuple[str, str]:
    """A path's state checked (docs/FORMAT.md §6.9.1): ``(kind, text)``. What verify checks on any
    system (a concrete path of the other system is valid content that only its own system builds)."""
    if type(state) is not list or len(state) != 2 or state[0] not in _PATH_KINDS or type(state[1]) is not str:
        raise ValueError(f"a path is [kind, text] with kind one of {sorted(_PATH_KINDS)}")
    kind, text = state
    if "\x00" in text:
        raise ValueError(f"path text {text[:80]!r} holds U+0000, which no path can")
    pure = _PURE[kind]
    canonical = posix_text_is_canonical(text) if pure is pathlib.PurePosixPath else str(pure(text)) == text
    if not canonical:
        raise ValueError(f"path text {text[:80]!r} is not in canonical form")
    return kind, text


# ------------------------------------------------------------------ dates and times

_US_PER_DAY = 86_400_000_000


def _offset_us(tz: Any, what: str) -> int | None:
    """The fixed UTC offset of ``tz`` in microseconds, None for naive; refuses anything else."""
    if tz is None:
        return None
    if type(tz) is not _dt.timezone:
        raise UnsupportedTypeError(
            f"a {what} with tzinfo {tz!r} cannot be saved canonically: only fixed offsets "
            "(datetime.timezone) are; zone rules come from a tz database that changes. Convert it "
            "(value.astimezone(datetime.timezone.utc)) and save the zone's name as a str")
    offset = tz.utcoffset(None)
    if tz.tzname(None) != _dt.timezone(offset).tzname(None):
        raise UnsupportedTypeError(
            f"a {what} with the named time zone {tz!r} cannot be saved: the name would be lost; "
            f"use datetime.timezone({offset!r}) without a name")
    return (offset.days * 86_400 + offset.seconds) * 1_000_000 + offset.microseconds


def _tz(offset: Any) -> _dt.timezone | None:
    if offset is None:
        return None
    if type(offset) is not int or not -_US_PER_DAY < offset < _US_PER_DAY:
        raise ValueError("a UTC offset is nil or an int of microseconds strictly within one day")
    return _dt.timezone(_dt.timedelta(microseconds=offset))


def _exact(value: Any, cls: type, what: str) -> None:
    if type(value) is not cls:
        t = type(value)
        raise UnsupportedTypeError(
            f"{t.__module__}.{t.__qualname__} is a subclass of {what} and may hold more than the "
            f"{what} codec stores (pandas.Timestamp has nanoseconds): convert it to a plain {what} "
            f"(for pandas: .to_pydatetime()) or register {t.__qualname__} itself, with encode= and decode=")


def _ints(state: Any, n: int, what: str) -> list:
    if type(state) is not list or len(state) != n:
        raise ValueError(f"{what} takes a list of {n} values")
    return state


def _check_ints(values: Iterable[Any], what: str) -> None:
    if not all(type(v) is int for v in values):
        raise ValueError(f"{what} fields must be ints")


def _encode_date(d: _dt.date) -> list:
    _exact(d, _dt.date, "datetime.date")
    return [d.year, d.month, d.day]


def _decode_date(state: Any) -> _dt.date:
    y, m, d = _ints(state, 3, DATE)
    _check_ints((y, m, d), DATE)
    return _dt.date(y, m, d)


def _encode_time(t: _dt.time) -> list:
    _exact(t, _dt.time, "datetime.time")
    return [t.hour, t.minute, t.second, t.microsecond, _offset_us(t.tzinfo, "time"), t.fold]


def _decode_time(state: Any) -> _dt.time:
    h, mi, s, us, offset, fold = _ints(state, 6, TIME)
    _check_ints((h, mi, s, us, fold), TIME)
    return _dt.time(h, mi, s, us, tzinfo=_tz(offset), fold=fold)


def _encode_datetime(v: _dt.datetime) -> list:
    _exact(v, _dt.datetime, "datetime.datetime")
    return [v.year, v.month, v.day, v.hour, v.minute, v.second, v.microsecond,
            _offset_us(v.tzinfo, "datetime"), v.fold]


def _decode_datetime(state: Any) -> _dt.datetime:
    y, mo, d, h, mi, s, us, offset, fold = _ints(state, 9, DATETIME)
    _check_ints((y, mo, d, h, mi, s, us, fold), DATETIME)
    return _dt.datetime(y, mo, d, h, mi, s, us, tzinfo=_tz(offset), fold=fold)


def _encode_timedelta(v: _dt.timedelta) -> list:
    _exact(v, _dt.timedelta, "datetime.timedelta")
    return [v.days, v.seconds, v.microseconds]


def _decode_timedelta(state: Any) -> _dt.timedelta:
    days, seconds, us = _ints(state, 3, TIMEDELTA)
    _check_ints((days, seconds, us), TIMEDELTA)
    if not (-999_999_999 <= days <= 999_999_999 and 0 <= seconds < 86_400 and 0 <= us < 1_000_000):
        raise ValueError("a timedelta is [days, seconds, microseconds] as Python normalizes them")
    return _dt.timedelta(days=days, seconds=seconds, microseconds=us)


# ------------------------------------------------------------------ argparse


def _encode_namespace(ns: argparse.Namespace) -> dict:
    return dict(vars(ns))


def _decode_namespace(state: Any) -> argparse.Namespace:
    if type(state) is not dict or not all(type(k) is str for k in state):
        raise ValueError("an argparse.Namespace is a dict with str keys")
    return argparse.Namespace(**state)


# ------------------------------------------------------------------ byte buffers


def _encode_bytes_io(buf: io.BytesIO) -> bytes:
    """The whole buffer, whatever its position: what DCP's FileSystemWriter writes for a byte item
    (``getbuffer()``), and what ``getvalue()`` gives however the buffer was filled (bytes, a
    bytearray or a memoryview given to the constructor, which copies it; writes)."""
    t = type(buf)
    if t is not io.BytesIO:
        raise UnsupportedTypeError(
            f"{t.__module__}.{t.__qualname__} is a subclass of io.BytesIO and may hold more than the bytes "
            f"the io.BytesIO codec stores: save io.BytesIO(value.getvalue()) or register {t.__qualname__} itself, "
            "with encode= and decode=")
    if buf.closed:
        raise UnsupportedTypeError("this io.BytesIO is closed and holds no bytes any more: save it before "
                                   "closing it, or save its bytes")
    extra = vars(buf)
    if extra:
        raise UnsupportedTypeError(
            f"this io.BytesIO has attributes set on it ({', '.join(sorted(map(repr, extra))[:5])}), which "
            "would be lost: only its bytes are saved; save the attributes next to it")
    return buf.getvalue()


def _decode_bytes_io(state: Any) -> io.BytesIO:
    if type(state) is not bytes:
        raise ValueError("an io.BytesIO is stored as its bytes (a msgpack bin)")
    return io.BytesIO(state)


# ------------------------------------------------------------------ registration


def _checked(encode: Callable, decode: Callable) -> Callable:
    """``encode``, then ``decode`` of the state it made, before anything is written: the writer
    refuses exactly the states a reader rejects (docs/FORMAT.md §6.9), by the reader's own checks."""
    def checked_encode(value: Any) -> Any:
        state = encode(value)
        try:
            decode(state)
        except ValueError as e:
            raise UnsupportedTypeError(f"this {type(value).__qualname__} cannot be saved: {e}") from None
        return state

    return checked_encode


_Codec = tuple[type, Callable[[Any], Any], Callable[[Any], Any]]  # (class, encode, decode)
_UNCHECKED: dict[str, _Codec] = {
    PATH: (pathlib.PurePath, _encode_path, _decode_path),
    DATE: (_dt.date, _encode_date, _decode_date),
    TIME: (_dt.time, _encode_time, _decode_time),
    DATETIME: (_dt.datetime, _encode_datetime, _decode_datetime),
    TIMEDELTA: (_dt.timedelta, _encode_timedelta, _decode_timedelta),
    NAMESPACE: (argparse.Namespace, _encode_namespace, _decode_namespace),
    BYTES_IO: (io.BytesIO, _encode_bytes_io, _decode_bytes_io),
}
# each encode checked once, so that enabling a codec twice finds the same functions (a no-op)
_CODECS: dict[str, _Codec] = {name: (cls, _checked(encode, decode), decode)
                              for name, (cls, encode, decode) in _UNCHECKED.items()}
for _name, (_cls, _encode, _decode) in _UNCHECKED.items():
    # the format fixes these states: verify checks them, enabled or not (a path's without building it)
    registry.specify(_name, _path_state if _name == PATH else _decode)


def _install(*names: str) -> None:
    for name in names:
        cls, encode, decode = _CODECS[name]
        existing = registry.by_name(name)
        if existing is not None and existing.cls is cls and existing.encode is encode:
            continue  # already enabled
        try:
            registry.register(cls, name=name, encode=encode, decode=decode)
        except UsageError as e:
            raise UsageError(f"cannot enable the built-in codec {name!r}: {e}") from None


def register_paths() -> None:
    """Save ``pathlib`` paths (``PurePath`` and every subclass) as their kind and text.

    A path loads as the standard class it is or derives from: ``PurePosixPath``,
    ``PureWindowsPath``, ``PosixPath`` or ``WindowsPath`` (a concrete path of the
    other operating system cannot be created, and loading one fails saying so).

    Example::

        tensorcanon.codecs.register_paths()
        tensorcanon.loads(tensorcanon.dumps(pathlib.Path("/data")))  # PosixPath('/data')
    """
    _install(PATH)


def register_datetime() -> None:
    """Save ``datetime.date``, ``time``, ``datetime`` and ``timedelta`` as lists of ints.

    Naive values and fixed UTC offsets (``datetime.timezone``, without a custom
    name) are saved; other ``tzinfo`` (``zoneinfo.ZoneInfo``, pytz) and
    subclasses (``pandas.Timestamp``) are refused with an error saying how to
    convert them. ``fold`` is kept.

    Example::

        tensorcanon.codecs.register_datetime()
        tensorcanon.save({"started": datetime.datetime.now(datetime.timezone.utc)}, path)
    """
    _install(DATE, TIME, DATETIME, TIMEDELTA)


def register_namespace() -> None:
    """Save ``argparse.Namespace`` objects as the dict of their attributes. On from import: only
    needed after ``tensorcanon.unregister(argparse.Namespace)``.

    Example::

        tensorcanon.save({"args": parser.parse_args()}, path)  # no call needed
    """
    _install(NAMESPACE)


def register_bytes_io() -> None:
    """Save ``io.BytesIO`` values as their bytes. On from import: only needed after
    ``tensorcanon.unregister(io.BytesIO)``.

    The content is ``getvalue()``, the whole buffer (the position is not saved);
    a value loads as ``io.BytesIO(content)``, at position 0. Subclasses, closed
    buffers and buffers with attributes set on them are refused (they hold more
    than the bytes).

    Example::

        back = tensorcanon.loads(tensorcanon.dumps({"losses": io.BytesIO(b"abc")}))
        back["losses"].read()  # b'abc'
    """
    _install(BYTES_IO)


def register_all() -> None:
    """Enable every built-in codec (paths, dates and times; and argparse namespaces and
    ``io.BytesIO``, which are on from import).

    Also available as ``tensorcanon.register_builtin_codecs()``. Calling it again
    does nothing; a class you registered yourself is not replaced (that raises
    :class:`~tensorcanon.UsageError`).
    """
    register_paths()
    register_datetime()
    register_namespace()
    register_bytes_io()


def hint(value: Any) -> str | None:
    """The call that would make ``value`` saveable, if a built-in codec covers its type."""
    if isinstance(value, pathlib.PurePath):
        return "tensorcanon.codecs.register_paths()"
    if isinstance(value, (_dt.date, _dt.time, _dt.timedelta)):
        return "tensorcanon.codecs.register_datetime()"
    if isinstance(value, argparse.Namespace):
        return "tensorcanon.codecs.register_namespace()"
    return None


register_bytes_io()  # always on: it stores a buffer's bytes and makes no choice for the program
register_namespace()  # on by default (issue 30): a dict of attributes, each value checked as any value
