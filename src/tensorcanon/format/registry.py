"""User types that may be saved: an explicit allow-list.

A file records a registered value by the *name* it was registered under. The
loader maps that name back to a class only through this registry: it never
imports a module or looks up a name found in a file.

Example::

    @dataclasses.dataclass
    class RunConfig:
        lr: float
        steps: int

    tensorcanon.register(RunConfig)
    tensorcanon.loads(tensorcanon.dumps(RunConfig(1e-3, 10)))
"""

from __future__ import annotations

import dataclasses
import enum
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import subclasses
from .errors import UnsupportedTypeError, UsageError

__all__ = ["register", "unregister"]


@dataclass(frozen=True)
class Registration:
    cls: type
    name: str
    encode: Callable[[Any], Any]
    decode: Callable[[Any], Any]
    automatic: bool = False  # the codec is the built-in one for a dataclass, NamedTuple or Enum


_BY_TYPE: dict[type, Registration] = {}
_BY_NAME: dict[str, Registration] = {}
_BY_MRO: dict[type, Registration | None] = {}  # subclass lookups, cleared on every change
#: Classes the format writes itself (a leaf, or a node kind of tree.register_kind): class -> what it
#: is written as. register() refuses them: the format's own kind would win, and the registration
#: would be silently ignored. Filled through :func:`reserve` only (by format/tree.py).
_RESERVED: dict[type, str] = {}


def reserve(cls: type, written_as: str) -> None:
    """Mark ``cls`` as written by the format itself (``written_as``: "the tag 'complex'", ...), so
    that :func:`register` refuses it. Called by tree.register_kind for each class of a node kind."""
    _RESERVED[cls] = written_as

Codec = tuple[Callable[[Any], Any], Callable[[Any], Any]]  # (encode, decode)


def _dataclass_codec(cls: type) -> Codec:
    fields = dataclasses.fields(cls)
    init_names = [f.name for f in fields if f.init]
    other_names = [f.name for f in fields if not f.init]

    def encode(obj: Any) -> dict[str, Any]:
        return {f.name: getattr(obj, f.name) for f in fields}

    def decode(state: Any) -> Any:
        if not isinstance(state, dict) or set(state) != {f.name for f in fields}:
            raise ValueError(f"expected the fields {sorted(f.name for f in fields)}")
        obj = cls(**{k: state[k] for k in init_names})
        for k in other_names:
            object.__setattr__(obj, k, state[k])
        return obj

    return encode, decode


def _namedtuple_codec(cls: type) -> Codec:
    n_fields = len(_fields_of(cls))

    def encode(obj: Any) -> list[Any]:
        return list(obj)

    def decode(state: Any) -> Any:
        if not isinstance(state, list) or len(state) != n_fields:
            raise ValueError(f"expected a list of {n_fields} fields")
        return cls(*state)

    return encode, decode


def same_value(a: Any, b: Any) -> bool:
    """``a`` and ``b`` are one value as a file holds them: of one type, floats by their bits (so a
    NaN is itself and ``-0.0`` is not ``0.0``), lists and tuples item by item, others by ``==``."""
    if type(a) is not type(b):
        return False
    if type(a) is float:
        return struct.pack(">d", a) == struct.pack(">d", b)
    if type(a) is complex:
        return same_value(a.real, b.real) and same_value(a.imag, b.imag)
    if type(a) in (list, tuple):
        return len(a) == len(b) and all(map(same_value, a, b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values without a truth value for == (tensors, arrays)
        return False


def _enum_codec(cls: type[enum.Enum]) -> Codec:
    def member(value: Any) -> Any:
        """The member whose value a file holding ``value`` means (docs/FORMAT.md §6.6): the one member
        whose value is the same value (a NaN found by its bits, not by ``==``), else what ``cls(value)``
        gives (a Flag combination) if its value is the same."""
        found = {id(m): m for m in cls.__members__.values() if same_value(m.value, value)}
        if len(found) > 1:
            raise ValueError(f"{len(found)} members of {cls.__qualname__} have the value {value!r}, which a "
                             "file cannot tell apart")
        m = next(iter(found.values())) if found else cls(value)
        if not same_value(m.value, value):
            raise ValueError(f"{value!r} is not the value of a {cls.__qualname__} member")
        return m

    def encode(obj: Any) -> Any:
        try:
            found = member(obj.value)
        except ValueError as e:
            raise UnsupportedTypeError(f"{obj!r} cannot be saved: {e}") from None
        if found is not obj:
            raise UnsupportedTypeError(f"{obj!r} cannot be saved: its value names {found!r}")
        return obj.value

    return encode, member


def register(
    cls: type,
    *,
    name: str | None = None,
    encode: Callable[[Any], Any] | None = None,
    decode: Callable[[Any], Any] | None = None,
    replace: bool = False,
) -> type:
    """Allow instances of ``cls`` (and of its subclasses) to be saved and loaded.

    Dataclasses, NamedTuples and Enums need no codec: their fields (or value)
    are saved; nor do tensor subclasses that implement ``__tensor_flatten__`` and
    ``__tensor_unflatten__`` (their inner tensors, flatten context, size and
    stride are saved: docs/FORMAT.md §6.12.5). Any other class needs ``encode`` (instance to a saveable value)
    and ``decode`` (that value back to an instance). ``name`` is what the file
    records; it defaults to ``"module.QualName"`` and must be the same in the
    process that loads the file. Returns ``cls``, so it can be a decorator.

    Subclasses: a value whose own class is not registered uses the registration
    of its nearest registered base class (in method resolution order), and
    loads as what that registration's ``decode`` builds. A subclass of a
    registered dataclass or NamedTuple that adds fields must be registered
    itself (its extra fields would otherwise be lost): saving one raises.

    Registering a class or a name that is already registered raises
    :class:`~tensorcanon.UsageError` unless ``replace=True``; registering the
    same class under the same name with the default codec again is allowed.
    """
    if not isinstance(cls, type):
        raise UsageError(f"register() takes a class, not {type(cls).__name__}")
    if cls in _RESERVED:
        raise UsageError(f"{cls.__module__}.{cls.__qualname__} is saved by the format itself, as "
                         f"{_RESERVED[cls]}; it cannot be registered. Register a subclass "
                         "of it instead to save its values another way")
    if name is None:
        name = f"{cls.__module__}.{cls.__qualname__}"
    if type(name) is not str or not name or not _is_unicode(name):
        raise UsageError(f"register(name=...) must be a non-empty str of valid Unicode, not {name!r}")
    if (encode is None) != (decode is None):
        raise UsageError("register() needs both encode and decode, or neither")
    automatic = encode is None
    if encode is None:
        if dataclasses.is_dataclass(cls):
            encode, decode = _dataclass_codec(cls)
        elif issubclass(cls, tuple) and hasattr(cls, "_fields"):
            encode, decode = _namedtuple_codec(cls)
        elif issubclass(cls, enum.Enum):
            encode, decode = _enum_codec(cls)
        elif subclasses.implements_flatten(cls):  # a tensor subclass (docs/FORMAT.md §6.12.5)
            encode, decode = subclasses.codec(cls)
        else:
            raise UsageError(
                f"{cls.__qualname__} is not a dataclass, NamedTuple or Enum: "
                "pass encode= and decode= to register()"
            )
    old_cls, old_name = _BY_TYPE.get(cls), _BY_NAME.get(name)
    if not replace:
        same = old_cls is not None and old_cls is old_name and old_cls.automatic and automatic
        taken = None
        if not same and old_cls is not None:
            taken = f"{cls.__qualname__} is already registered as {old_cls.name!r}"
        elif not same and old_name is not None:
            taken = f"the name {name!r} is already registered for {old_name.cls.__qualname__}"
        if taken is not None:
            raise UsageError(f"{taken}; pass replace=True to replace that registration")
    unregister(cls)
    old = _BY_NAME.pop(name, None)
    if old is not None:
        _BY_TYPE.pop(old.cls, None)
    assert decode is not None
    reg = Registration(cls, name, encode, decode, automatic)
    _BY_TYPE[cls] = reg
    _BY_NAME[name] = reg
    _BY_MRO.clear()
    return cls


def _is_unicode(text: str) -> bool:
    """False for a str with a lone surrogate, which a file cannot hold (docs/FORMAT.md §6.1)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def unregister(cls: type) -> None:
    """Remove ``cls`` from the allow-list (no error if it was not there)."""
    reg = _BY_TYPE.pop(cls, None)
    if reg is not None:
        _BY_NAME.pop(reg.name, None)
    _BY_MRO.clear()


def by_type(cls: type) -> Registration | None:
    """The registration for values of type ``cls``: its own, or its nearest registered base's.

    Raises :class:`~tensorcanon.UnsupportedTypeError` for a subclass of a
    registered dataclass or NamedTuple that adds fields (see :func:`register`).
    """
    reg = _BY_TYPE.get(cls)
    if reg is not None or not _BY_TYPE:
        return reg
    if cls not in _BY_MRO:
        _BY_MRO[cls] = next((_BY_TYPE[base] for base in cls.__mro__[1:] if base in _BY_TYPE), None)
    reg = _BY_MRO[cls]
    if reg is not None and reg.automatic and _fields_of(cls) != _fields_of(reg.cls):
        raise UnsupportedTypeError(
            f"{cls.__module__}.{cls.__qualname__} adds fields to the registered {reg.cls.__qualname__}, "
            f"which would be lost: call tensorcanon.register({cls.__qualname__}) too")
    return reg


def _fields_of(cls: type) -> tuple[str, ...]:
    if dataclasses.is_dataclass(cls):
        return tuple(f.name for f in dataclasses.fields(cls))
    return tuple(getattr(cls, "_fields", ()))


def by_name(name: str) -> Registration | None:
    return _BY_NAME.get(name)
