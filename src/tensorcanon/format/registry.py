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

import collections
import dataclasses
import enum
import struct
import sys
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


class UnbuiltTensor:
    """What a verifying reader, which builds no objects, hands the check of a specified state
    (:func:`specify`) for a tensor node (``tensor``, ``sparse``, ``nested``, ``meta``, ``tensor.attrs``:
    tree.Decoder.plain), so that a state the format says holds a tensor can be checked without torch."""

    __slots__ = ()


def is_tensor(value: Any) -> bool:
    """True for a tensor, or for a verifying reader's stand-in for one (:class:`UnbuiltTensor`)."""
    if isinstance(value, UnbuiltTensor):
        return True
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


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
    """State: the dict of every field. A value is rebuilt as pickle rebuilds it, without running
    ``__init__`` or ``__post_init__`` (which could derive a field again from its saved value):
    ``object.__new__`` and each field set as saved (``object.__setattr__``, so frozen dataclasses too)."""
    initvars = [name for name, f in getattr(cls, "__dataclass_fields__", {}).items()
                if getattr(f, "_field_type", None) is getattr(dataclasses, "_FIELD_INITVAR", object())]
    if initvars:
        raise UsageError(
            f"{cls.__qualname__} has InitVar fields ({', '.join(initvars)}): they are passed to __init__ and "
            "__post_init__ but not stored on the object, so a file cannot hold them, and a value is rebuilt "
            "from its fields without running __init__; make them ordinary fields, or register "
            f"{cls.__qualname__} with encode= and decode=")
    fields = dataclasses.fields(cls)
    names = tuple(f.name for f in fields)
    known = frozenset(names)

    def encode(obj: Any) -> dict[str, Any]:
        extra = [k for k in getattr(obj, "__dict__", ()) if k not in known]
        if extra:
            shown = ", ".join(map(repr, sorted(extra)[:5]))
            raise UnsupportedTypeError(
                f"this {cls.__qualname__} has attributes that are not fields ({shown}), which a file would lose "
                "(only fields are saved, and loading does not run __init__ or __post_init__ again): declare them "
                f"as fields (dataclasses.field(init=False)), or register {cls.__qualname__} with encode= and "
                "decode=")
        return {name: getattr(obj, name) for name in names}

    def decode(state: Any) -> Any:
        if not isinstance(state, dict) or set(state) != known:
            raise ValueError(f"expected the fields {sorted(known)}")
        obj: Any = object.__new__(cls)
        for name in names:
            object.__setattr__(obj, name, state[name])
        return obj

    return encode, decode


def _mapping_codec(cls: type) -> Codec:
    """A dict subclass (an OrderedDict subclass keeps its order) or a list subclass: its items as a
    plain dict, OrderedDict or list; rebuilt as ``cls(items)``. The writer rebuilds the value before
    writing it and refuses it unless what comes back is equal, with equal attributes."""
    plain: type = (collections.OrderedDict if issubclass(cls, collections.OrderedDict)
                   else dict if issubclass(cls, dict) else list)

    def decode(state: Any) -> Any:
        if type(state) is not plain:
            raise ValueError(f"a {cls.__qualname__} is stored as a {plain.__name__} of its items")
        return cls(state)

    def encode(obj: Any) -> Any:
        state = plain(obj)
        try:
            back = decode(state)
            same = type(back) is type(obj) and back == obj and vars_of(back) == vars_of(obj)
        except Exception as e:  # noqa: BLE001 - any failure of the class's own constructor
            raise UnsupportedTypeError(
                f"this {cls.__qualname__} cannot be saved by its items: {cls.__qualname__}(items) raised {e!r}; "
                "register it with encode= and decode=") from None
        if not same:
            raise UnsupportedTypeError(
                f"this {cls.__qualname__} cannot be saved by its items: {cls.__qualname__}(items) does not give "
                "it back (its attributes, or its items, differ); register it with encode= and decode=")
        return state

    return encode, decode


def vars_of(obj: Any) -> dict[str, Any]:
    """An object's instance attributes (empty when it has no ``__dict__``)."""
    return dict(getattr(obj, "__dict__", {}))


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
    """Allow instances of ``cls`` to be saved and loaded (and of its subclasses, with a codec).

    Dataclasses, NamedTuples, Enums and dict or list subclasses need no codec:
    their fields (value, items) are saved; nor do tensor subclasses that implement
    ``__tensor_flatten__`` and ``__tensor_unflatten__`` (their inner tensors, flatten
    context, size and stride are saved: docs/FORMAT.md §6.12.5). Any other class needs
    ``encode`` (instance to a saveable value)
    and ``decode`` (that value back to an instance). ``name`` is what the file
    records; it defaults to ``"module.QualName"`` and must be the same in the
    process that loads the file. Returns ``cls``, so it can be a decorator.

    Dataclasses are rebuilt as pickle rebuilds them: each field set as saved,
    without running ``__init__`` or ``__post_init__``. So a dataclass with
    ``InitVar`` fields (not stored on the object) is refused here, and saving
    one whose instance holds attributes that are not fields raises.

    A dict or list subclass (an ``OrderedDict`` subclass keeps its order) is
    saved as its items and rebuilt as ``cls(items)``; saving one raises unless
    that gives back an equal value with equal attributes (else pass
    ``encode=`` and ``decode=``).

    Subclasses: a value whose own class is not registered uses the registration
    of its nearest registered base class (in method resolution order) when that
    registration has a codec of its own (``encode=``/``decode=``, or a built-in
    codec), and loads as what its ``decode`` builds. A subclass of a class
    registered without a codec (dataclass, NamedTuple, Enum, dict or list
    subclass) must be registered itself: saving one raises, naming both classes,
    since it would load as the base class.

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
        elif issubclass(cls, (dict, list)):
            encode, decode = _mapping_codec(cls)
        elif subclasses.implements_flatten(cls):  # a tensor subclass (docs/FORMAT.md §6.12.5)
            encode, decode = subclasses.codec(cls)
        else:
            raise UsageError(
                f"{cls.__qualname__} is not a dataclass, NamedTuple, Enum, or dict or list subclass: "
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
    if reg is not None:
        return reg
    if _PROVIDERS:
        reg = _provided_type(cls)
        if reg is not None:
            return reg
    if not _BY_TYPE:
        return None
    if cls not in _BY_MRO:
        _BY_MRO[cls] = next((_BY_TYPE[base] for base in cls.__mro__[1:] if base in _BY_TYPE), None)
    reg = _BY_MRO[cls]
    if reg is not None and reg.automatic:
        adds = ("adds fields to" if _fields_of(cls) != _fields_of(reg.cls) else "is a subclass of")
        raise UnsupportedTypeError(
            f"{cls.__module__}.{cls.__qualname__} {adds} the registered {reg.cls.__module__}."
            f"{reg.cls.__qualname__}, and would load as {reg.cls.__qualname__}: call "
            f"tensorcanon.register({cls.__qualname__}) too, to save it as itself (docs/FORMAT.md §6.6)")
    return reg


def _fields_of(cls: type) -> tuple[str, ...]:
    if dataclasses.is_dataclass(cls):
        return tuple(f.name for f in dataclasses.fields(cls))
    return tuple(getattr(cls, "_fields", ()))


def by_name(name: str) -> Registration | None:
    reg = _BY_NAME.get(name)
    if reg is None and _PROVIDERS:
        for p in _PROVIDERS:
            module = sys.modules.get(p.library)
            if module is not None and p.owns_name(name):
                reg = p.for_name(module, name)
                if reg is not None:
                    return reg
    return reg


# ------------------------------------------------------------------ the ecosystem's codecs

@dataclass(frozen=True)
class Provider:
    """Codecs that tensorcanon ships for one library's own data objects (docs/FORMAT.md §6.9.5),
    active only while that library is imported: nothing here imports it, and a name found in a file
    is matched only against the classes the running process already holds (an allow-list).

    ``for_type(module, cls)`` and ``for_name(module, name)`` register the codec of ``cls`` (of the
    class that ``name`` stands for) with :func:`register` and return the registration, or None when
    the library has no such class; ``module`` is the library's top-level module, from ``sys.modules``.
    ``owns_name(name)`` says, without the library, whether ``name`` would be one of its codecs' names:
    loading such a value in a process that has not imported the library says which one to import."""

    library: str
    for_type: Callable[[Any, type], Registration | None]
    for_name: Callable[[Any, str], Registration | None]
    owns_name: Callable[[str], bool]


_PROVIDERS: list[Provider] = []
#: class -> the libraries that were imported when no provider had a codec for it (checked again
#: once another library is imported)
_NOT_PROVIDED: dict[type, frozenset[str]] = {}


def provide(provider: Provider) -> None:
    """Add the codecs of one library (format/ecosystem.py calls this at import)."""
    _PROVIDERS.append(provider)
    _NOT_PROVIDED.clear()


def _provided_type(cls: type) -> Registration | None:
    active = frozenset(p.library for p in _PROVIDERS if p.library in sys.modules)
    if not active or _NOT_PROVIDED.get(cls) == active:
        return None
    for p in _PROVIDERS:
        if p.library in active:
            reg = p.for_type(sys.modules[p.library], cls)
            if reg is not None:
                return reg
    _NOT_PROVIDED[cls] = active
    return None


def library_for(name: str) -> str | None:
    """The library to import for the registered name ``name`` of one of tensorcanon's ecosystem
    codecs, when that library is not imported in this process (else None)."""
    for p in _PROVIDERS:
        if p.library not in sys.modules and p.owns_name(name):
            return p.library
    return None


#: Registered types whose state the format itself specifies (docs/FORMAT.md §6.7.2, §6.9): name ->
#: the reader's check of a state, the function that rebuilds the value (it raises ValueError on a
#: state the format forbids). A verifying reader runs it too, whether the type is enabled in the
#: verifying process or not, so that a file that verifies loads wherever the type is enabled.
_SPECIFIED: dict[str, Callable[[Any], Any]] = {}


def specify(name: str, rebuild: Callable[[Any], Any]) -> None:
    """Record ``rebuild`` as the format's check of the state of registered name ``name``
    (format/codecs.py for the built-in codecs, training/determinism.py for DeterminismSettings)."""
    _SPECIFIED[name] = rebuild


def specified(name: str) -> Callable[[Any], Any] | None:
    """The format's check of the state of ``name`` (see :func:`specify`), or None for a user type."""
    return _SPECIFIED.get(name)
