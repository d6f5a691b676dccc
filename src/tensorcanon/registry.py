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
from dataclasses import dataclass
from typing import Any, Callable

from .errors import UsageError

__all__ = ["register", "unregister"]


@dataclass(frozen=True)
class Registration:
    cls: type
    name: str
    encode: Callable[[Any], Any]
    decode: Callable[[Any], Any]


_BY_TYPE: dict[type, Registration] = {}
_BY_NAME: dict[str, Registration] = {}


def _dataclass_codec(cls: type):
    fields = dataclasses.fields(cls)
    init_names = [f.name for f in fields if f.init]
    other_names = [f.name for f in fields if not f.init]

    def encode(obj):
        return {f.name: getattr(obj, f.name) for f in fields}

    def decode(state):
        if not isinstance(state, dict) or set(state) != {f.name for f in fields}:
            raise ValueError(f"expected the fields {sorted(f.name for f in fields)}")
        obj = cls(**{k: state[k] for k in init_names})
        for k in other_names:
            object.__setattr__(obj, k, state[k])
        return obj

    return encode, decode


def _namedtuple_codec(cls: type):
    def encode(obj):
        return list(obj)

    def decode(state):
        if not isinstance(state, list) or len(state) != len(cls._fields):
            raise ValueError(f"expected a list of {len(cls._fields)} fields")
        return cls(*state)

    return encode, decode


def _enum_codec(cls: type):
    def encode(obj):
        return obj.value

    def decode(state):
        return cls(state)

    return encode, decode


def register(
    cls: type,
    *,
    name: str | None = None,
    encode: Callable[[Any], Any] | None = None,
    decode: Callable[[Any], Any] | None = None,
) -> type:
    """Allow instances of ``cls`` to be saved and loaded.

    Dataclasses, NamedTuples and Enums need no codec: their fields (or value)
    are saved. Any other class needs ``encode`` (instance to a saveable value)
    and ``decode`` (that value back to an instance). ``name`` is what the file
    records; it defaults to ``"module.QualName"`` and must be the same in the
    process that loads the file. Returns ``cls``, so it can be a decorator.
    Registering a name again replaces the earlier registration of that name.
    """
    if not isinstance(cls, type):
        raise UsageError(f"register() takes a class, not {type(cls).__name__}")
    if name is None:
        name = f"{cls.__module__}.{cls.__qualname__}"
    if not isinstance(name, str) or not name:
        raise UsageError("register(name=...) must be a non-empty str")
    if (encode is None) != (decode is None):
        raise UsageError("register() needs both encode and decode, or neither")
    if encode is None:
        if dataclasses.is_dataclass(cls):
            encode, decode = _dataclass_codec(cls)
        elif issubclass(cls, tuple) and hasattr(cls, "_fields"):
            encode, decode = _namedtuple_codec(cls)
        elif issubclass(cls, enum.Enum):
            encode, decode = _enum_codec(cls)
        else:
            raise UsageError(
                f"{cls.__qualname__} is not a dataclass, NamedTuple or Enum: "
                "pass encode= and decode= to register()"
            )
    unregister(cls)
    old = _BY_NAME.pop(name, None)
    if old is not None:
        _BY_TYPE.pop(old.cls, None)
    reg = Registration(cls, name, encode, decode)
    _BY_TYPE[cls] = reg
    _BY_NAME[name] = reg
    return cls


def unregister(cls: type) -> None:
    """Remove ``cls`` from the allow-list (no error if it was not there)."""
    reg = _BY_TYPE.pop(cls, None)
    if reg is not None:
        _BY_NAME.pop(reg.name, None)


def by_type(cls: type) -> Registration | None:
    return _BY_TYPE.get(cls)


def by_name(name: str) -> Registration | None:
    return _BY_NAME.get(name)
