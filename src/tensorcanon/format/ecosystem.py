"""Codecs for the ecosystem's own data objects (docs/FORMAT.md §6.9.5), active only for the
libraries the process has already imported.

Training code hands ``torch.save`` objects that the user did not write: the Trainer's
``TrainingArguments``, a model's ``ModelOutput``, a tokenizer's ``BatchEncoding``, torch's
``PackedSequence``, torchao's quantized weights, OmegaConf and yacs configs. Each is saved here by a
codec the format specifies, with no ``register`` call, as long as its library is imported in the
saving process (it is, or there would be no such object) and in the loading one:

==========================================  =================================================
registered name                             values
==========================================  =================================================
``transformers.<class name>``               ``TrainingArguments`` and its subclasses
``<module>.<qualname>``                     every ``transformers`` ``ModelOutput`` subclass
``transformers.BatchEncoding``              ``BatchEncoding`` (with a fast tokenizer's encodings)
``torch.nn.utils.rnn.PackedSequence``       ``PackedSequence``
``<module>.<qualname>``                     torchao's tensor subclasses (``torchao.…``)
``omegaconf.DictConfig`` / ``ListConfig``   OmegaConf containers: flags and interpolations kept
``yacs.CfgNode``                            yacs ``CfgNode``: its flags kept
==========================================  =================================================

Nothing here imports a library: each provider looks its library up in ``sys.modules``, and a name
found in a file is matched only against the classes the process already holds (the subclasses of
``ModelOutput``, ``TrainingArguments`` or ``torch.Tensor`` defined by the imported modules), never
resolved by importing or by attribute look-up. A file holding such a value, loaded where the library
is not imported, fails with one line naming the library to import (``registry.library_for``); a
verifying reader checks the structure of each state below without any of these libraries.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import json
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from . import registry, subclasses
from .errors import UnsupportedTypeError

__all__ = ["library_for", "TRAINING_ARGUMENTS_PREFIX", "BATCH_ENCODING", "PACKED_SEQUENCE", "DICT_CONFIG",
           "LIST_CONFIG", "CFG_NODE", "training_arguments_codec"]

TRAINING_ARGUMENTS_PREFIX = "transformers."  # + the class's __name__ (the name CanonicalTrainer has used)
BATCH_ENCODING = "transformers.BatchEncoding"
PACKED_SEQUENCE = "torch.nn.utils.rnn.PackedSequence"
DICT_CONFIG, LIST_CONFIG = "omegaconf.DictConfig", "omegaconf.ListConfig"
CFG_NODE = "yacs.CfgNode"


def _subclasses(base: type) -> Iterator[type]:
    """``base`` and every subclass of it that the process has defined (an allow-list built from the
    running process, never from a file)."""
    seen: set[type] = set()
    todo = [base]
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        yield cls
        todo.extend(type.__subclasses__(cls))


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _install(cls: type, name: str, codec: tuple[Callable[[Any], Any], Callable[[Any], Any]]) -> registry.Registration:
    registry.register(cls, name=name, encode=codec[0], decode=codec[1], replace=True)
    reg = registry.by_type(cls)
    assert reg is not None
    return reg


def _exact(cls: type, value: Any) -> None:
    if type(value) is not cls:
        raise UnsupportedTypeError(f"{type(value).__qualname__} is a subclass of {cls.__qualname__} that no codec "
                                   f"saves: call tensorcanon.register({type(value).__qualname__}, encode=..., "
                                   "decode=...)")


def _dict_state(state: Any, keys: tuple[str, ...], what: str) -> dict[str, Any]:
    if type(state) is not dict or tuple(sorted(state)) != keys:
        raise ValueError(f"the state of {what} is a dict with the keys {', '.join(keys)}")
    return state


# ------------------------------------------------------------------ transformers

def _plain_field(value: Any) -> Any:
    """A TrainingArguments field as its constructor takes it: an Enum member as its value, a dataclass
    (``AcceleratorConfig``) as the dict of its fields."""
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain_field(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return value


#: TrainingArguments fields whose value its constructor may read as a file's name (a str that is not
#: JSON text), or that make it import another package (deepspeed): a file must not make the loader
#: read another file or import a module, so such values are refused when saving and when loading.
_READS_FILES = ("accelerator_config", "fsdp_config", "deepspeed", "gradient_checkpointing_kwargs",
                "activation_checkpointing_kwargs", "lr_scheduler_kwargs", "optim_args")


def _xla_dtype_names(value: Any) -> bool:
    """Whether an ``fsdp_config`` (a dict, or JSON text the constructor parses) names dtypes in its
    ``xla_fsdp_settings``, which the constructor resolves with ``getattr(torch, name)``: a name from
    the file looked up as an attribute (``torch._inductor`` imports a module), which §6.6 forbids."""
    config = value
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            config = json.loads(value)
        except (ValueError, RecursionError):  # the constructor refuses such text itself
            return False
    if not isinstance(config, dict):
        return False
    for key in ("xla_fsdp_settings", "fsdp_xla_fsdp_settings"):  # it strips a leading "fsdp_"
        settings = config.get(key)
        if isinstance(settings, dict) and ("compute_dtype" in settings or "buffer_dtype" in settings):
            return True
    return False


def _arguments_problem(state: dict[str, Any]) -> str:
    if _xla_dtype_names(state.get("fsdp_config")):
        return ("its fsdp_config names dtypes in xla_fsdp_settings, which building it would look up as "
                "attributes of torch: set them again after loading")
    for name in _READS_FILES:
        value = state.get(name)
        if name == "deepspeed" and value:
            return ("it sets deepspeed, and building it would import deepspeed and read its config: save "
                    "args.to_dict() instead, or set deepspeed again after loading")
        if isinstance(value, str) and value and not value.lstrip().startswith("{"):
            return (f"its {name} is {value[:80]!r}, a file name that building it would read: pass the config "
                    "as a dict instead")
    return ""


def _restore_environment(saved: dict[str, str]) -> None:
    for key in [k for k in os.environ if k not in saved]:
        del os.environ[key]
    for key, value in saved.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


def training_arguments_codec(cls: type) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    """``TrainingArguments`` (or a subclass ``cls``): the dict of its ``__init__`` fields, Enum members
    by their values, the ``*_token`` fields (credentials) left out; loads as ``cls(**fields)``, so
    ``__post_init__`` derives the rest in the loading process, as from a command line."""
    names = [f.name for f in dataclasses.fields(cls) if f.init and not f.name.endswith("_token")]

    def encode(args: Any) -> dict[str, Any]:
        if type(args) is not cls:
            raise UnsupportedTypeError(f"{type(args).__qualname__} is not {cls.__qualname__}")
        state = {name: _plain_field(getattr(args, name)) for name in names}
        why = _arguments_problem(state)
        if why:
            raise UnsupportedTypeError(f"this {cls.__qualname__} cannot be saved: {why}")
        return state

    def decode(state: Any) -> Any:
        if type(state) is not dict or not set(state) <= set(names):
            raise ValueError(f"a {cls.__qualname__} is stored as a dict of its __init__ fields")
        why = _arguments_problem(state)
        if why:
            raise ValueError(why)
        environment = dict(os.environ)
        try:
            return cls(**state)
        finally:  # the constructor sets variables from fields (FSDP_CPU_RAM_EFFICIENT_LOADING from
            # fsdp_config): loading a file leaves the process environment as it was
            _restore_environment(environment)

    return encode, decode


def _model_output_codec(cls: type) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    """A ``ModelOutput``: the dict of its dataclass fields (None where unset); loads as ``cls(**fields)``,
    whose keys are the fields that are not None, as the model made it. A value whose keys are not
    those (items set or removed by hand) is refused: it would not come back."""
    fields = tuple(f.name for f in dataclasses.fields(cls))

    def decode(state: Any) -> Any:
        _dict_state(state, tuple(sorted(fields)), f"a {cls.__qualname__}")
        return cls(**state)

    def encode(value: Any) -> dict[str, Any]:
        _exact(cls, value)
        state = {name: getattr(value, name) for name in fields}
        extra = sorted(k for k in vars(value) if k not in fields)
        if extra or list(decode(state).keys()) != list(value.keys()):
            raise UnsupportedTypeError(
                f"this {cls.__qualname__} holds keys or attributes other than its fields that are set "
                f"({', '.join(map(repr, extra or list(value.keys())))}), which a file would not give back: "
                "save value.to_tuple() or dict(value) instead")
        return state

    return encode, decode


def _batch_encoding_state(state: Any) -> dict[str, Any]:
    state = _dict_state(state, ("data", "encodings", "n_sequences"), "a BatchEncoding")
    data, encodings, n = state["data"], state["encodings"], state["n_sequences"]
    if type(data) is not dict or not all(type(k) is str for k in data):
        raise ValueError("'data' must be a dict with str keys")
    if encodings is not None and (type(encodings) is not list or not all(type(e) is dict for e in encodings)):
        raise ValueError("'encodings' must be nil or a list of dicts (each a tokenizers Encoding)")
    if n is not None and (type(n) is not int or n < 0):
        raise ValueError("'n_sequences' must be nil or a non-negative int")
    return state


def _batch_encoding_codec(cls: type) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    """A ``BatchEncoding``: its items, the fast tokenizer's encodings (each ``tokenizers.Encoding`` as
    the JSON object its own serialization gives, parsed, so that its maps are written in canonical
    order) and ``n_sequences``."""

    def encode(value: Any) -> dict[str, Any]:
        _exact(cls, value)
        extra = sorted(k for k in vars(value) if k not in ("data", "_encodings", "_n_sequences"))
        if extra:
            raise UnsupportedTypeError(f"this BatchEncoding has attributes set on it ({', '.join(extra)}), which a "
                                       "file would lose")
        encodings = value._encodings
        return {"data": dict(value.data), "n_sequences": value._n_sequences,
                "encodings": None if encodings is None else [json.loads(e.__getstate__()) for e in encodings]}

    def decode(state: Any) -> Any:
        state = _batch_encoding_state(state)
        encodings = None
        if state["encodings"] is not None:
            tokenizers = sys.modules.get("tokenizers")
            if tokenizers is None:
                raise ValueError("this BatchEncoding holds a fast tokenizer's encodings: import tokenizers")
            encodings = []
            for item in state["encodings"]:
                e = tokenizers.Encoding.__new__(tokenizers.Encoding)
                try:
                    e.__setstate__(json.dumps(item).encode())
                except Exception as err:  # noqa: BLE001 - tokenizers' own parser refuses the object
                    raise ValueError(f"an encoding is not one tokenizers reads: {err}") from None
                encodings.append(e)
        out = cls(state["data"], encoding=encodings, n_sequences=state["n_sequences"])
        return out

    return encode, decode


def _transformers_bases(module: Any, load: bool) -> tuple[Any, Any, Any]:
    """(ModelOutput, TrainingArguments, BatchEncoding): from the modules already imported, or with
    ``load``, through the imported library's own public names (transformers imports its submodules
    lazily; the names are this module's, never a file's)."""
    found = []
    for mod, attr in (("transformers.utils.generic", "ModelOutput"),
                      ("transformers.training_args", "TrainingArguments"),
                      ("transformers.tokenization_utils_base", "BatchEncoding")):
        cls = getattr(sys.modules.get(mod), attr, None)
        if cls is None and load and attr != "ModelOutput":  # (a ModelOutput subclass is one the process defines)
            try:
                cls = getattr(module, attr)
            except Exception:  # noqa: BLE001 - a transformers without it: no codec for it
                cls = None
        found.append(cls)
    return found[0], found[1], found[2]


def _transformers_type(module: Any, cls: type) -> registry.Registration | None:
    output, args, batch = _transformers_bases(module, load=False)
    if output is not None and issubclass(cls, output) and cls is not output:
        return _install(cls, _qualified(cls), _model_output_codec(cls))
    if args is not None and issubclass(cls, args):
        return _install(cls, TRAINING_ARGUMENTS_PREFIX + cls.__name__, training_arguments_codec(cls))
    if batch is not None and cls is batch:
        return _install(cls, BATCH_ENCODING, _batch_encoding_codec(cls))
    return None


def _transformers_name(module: Any, name: str) -> registry.Registration | None:
    output, args, batch = _transformers_bases(module, load=True)
    if batch is not None and name == BATCH_ENCODING:
        return _install(batch, BATCH_ENCODING, _batch_encoding_codec(batch))
    for base in (args, output):
        for cls in () if base is None else _subclasses(base):
            if name in (_qualified(cls), TRAINING_ARGUMENTS_PREFIX + cls.__name__):
                reg = _transformers_type(module, cls)
                if reg is not None and reg.name == name:
                    return reg
    return None


# ------------------------------------------------------------------ torch, torchao

def _packed_sequence_state(state: Any) -> list[Any]:
    if type(state) is not list or len(state) != 4:
        raise ValueError("the state of a PackedSequence is a list of 4: data, batch_sizes, sorted_indices, "
                         "unsorted_indices")
    data, batch_sizes, sorted_indices, unsorted_indices = state
    for what, t in (("data", data), ("batch_sizes", batch_sizes)):
        if not registry.is_tensor(t):
            raise ValueError(f"'{what}' must be a tensor")
    for what, t in (("sorted_indices", sorted_indices), ("unsorted_indices", unsorted_indices)):
        if t is not None and not registry.is_tensor(t):
            raise ValueError(f"'{what}' must be a tensor or nil")
    return state


def _packed_sequence_codec(cls: type) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    def encode(value: Any) -> list[Any]:
        _exact(cls, value)
        return list(value)

    def decode(state: Any) -> Any:
        data, batch_sizes, sorted_indices, unsorted_indices = _packed_sequence_state(state)
        # tuple.__new__: the fields as saved (PackedSequence's own __new__ would derive
        # unsorted_indices from sorted_indices again, and checks nothing a file could break)
        return tuple.__new__(cls, (data, batch_sizes, sorted_indices, unsorted_indices))

    return encode, decode


def _one_class(module_name: str, attr: str, name: str,
               codec: Callable[[Any], tuple[Callable[[Any], Any], Callable[[Any], Any]]]) -> tuple[Any, Any]:
    """``(for_type, for_name)`` of a provider whose one class is ``module_name.attr``, recorded as
    ``name``: found in ``sys.modules`` only (the library imported it, or no value of it exists)."""
    def cls_now() -> Any:
        return getattr(sys.modules.get(module_name), attr, None)

    def for_type(module: Any, cls: type) -> registry.Registration | None:
        return _install(cls, name, codec(cls)) if cls is cls_now() else None

    def for_name(module: Any, wanted: str) -> registry.Registration | None:
        cls = cls_now()
        return for_type(module, cls) if cls is not None and wanted == name else None

    return for_type, for_name


_torch_type, _torch_name = _one_class("torch.nn.utils.rnn", "PackedSequence", PACKED_SEQUENCE, _packed_sequence_codec)


def _torchao_type(module: Any, cls: type) -> registry.Registration | None:
    torch = sys.modules.get("torch")
    if (torch is None or not issubclass(cls, torch.Tensor) or not cls.__module__.startswith("torchao.")
            or not subclasses.implements_flatten(cls)):
        return None
    return _install(cls, _qualified(cls), subclasses.codec(cls))


def _torchao_name(module: Any, name: str) -> registry.Registration | None:
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    for cls in _subclasses(torch.Tensor):
        if cls.__module__.startswith("torchao.") and _qualified(cls) == name:
            return _torchao_type(module, cls)
    return None


# ------------------------------------------------------------------ OmegaConf

def _omegaconf_state(state: Any, top: type, what: str) -> dict[str, Any]:
    """The structure of a DictConfig's (``top`` OrderedDict) or ListConfig's (``top`` list) state, as a
    verifying reader checks it without OmegaConf: the content's type, every mapping in it an
    OrderedDict, and each flags entry's key path leading to a value the content holds."""
    state = _dict_state(state, ("content", "flags"), "an OmegaConf container")
    flags, content = state["flags"], state["content"]
    if type(content) is not top:
        raise ValueError(f"the content of a {what} must be {'an OrderedDict' if top is not list else 'a list'}")
    stack = [content]
    while stack:  # iterative: the manifest's depth limit bounds it, Python's stack does not
        node = stack.pop()
        if type(node) is dict:
            raise ValueError("every mapping in an OmegaConf container's content must be an OrderedDict")
        if type(node) is collections.OrderedDict:
            stack.extend(node.values())
        elif type(node) is list:
            stack.extend(node)
    if type(flags) is not list or not all(
            type(f) is list and len(f) == 2 and type(f[0]) is list and type(f[1]) is dict
            and all(type(k) is str and (v is None or type(v) is bool) for k, v in f[1].items()) for f in flags):
        raise ValueError("'flags' must be a list of [key path, {flag: bool or nil}] pairs")
    for path, _ in flags:
        node = content
        for k in path:
            if type(k) not in (str, int, float, bool, bytes):
                break  # a key that a verifying reader holds as an opaque value (an Enum member): load checks it
            if type(node) is collections.OrderedDict and k in node:
                node = node[k]
            elif type(node) is list and type(k) is int and 0 <= k < len(node):
                node = node[k]
            else:
                raise ValueError(f"flags for {path!r}, which the content does not hold")
    return state


def _dict_config_state(state: Any) -> dict[str, Any]:
    return _omegaconf_state(state, collections.OrderedDict, "DictConfig")


def _list_config_state(state: Any) -> dict[str, Any]:
    return _omegaconf_state(state, list, "ListConfig")


def _omegaconf_nodes(node: Any, path: list[Any], oc: Any) -> Iterator[tuple[list[Any], Any]]:
    yield path, node
    if isinstance(node, oc.DictConfig | oc.ListConfig) and not (node._is_none() or node._is_missing()
                                                                or node._is_interpolation()):
        keys = node.keys() if isinstance(node, oc.DictConfig) else range(len(node))
        for k in keys:
            yield from _omegaconf_nodes(node._get_node(k), [*path, k], oc)


def _in_order(content: Any) -> Any:
    """The containers' content with every mapping an ``OrderedDict``: OmegaConf keeps the order of keys
    (``to_yaml`` writes them in it), so it is part of the value, as for an OrderedDict."""
    if type(content) is dict:
        return collections.OrderedDict((k, _in_order(v)) for k, v in content.items())
    if type(content) is list:
        return [_in_order(v) for v in content]
    return content


def _omegaconf_codec(cls: type, oc: Any) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    """A ``DictConfig`` or ``ListConfig``: its content as ``OmegaConf.to_container(resolve=False)`` gives
    it (interpolations as their ``${…}`` text, missing values as ``???``; mappings as OrderedDicts, in
    the config's key order), and the flags set on each
    node (``readonly``, ``struct``, ...) by key path. Loads through ``OmegaConf.create``, then each
    node's flags set again: the container OmegaConf's own copy would give."""

    def encode(value: Any) -> dict[str, Any]:
        _exact(cls, value)
        object_type = value._metadata.object_type if isinstance(value, oc.DictConfig) else None
        if object_type not in (None, dict):
            raise UnsupportedTypeError(
                f"this DictConfig is a structured config of {object_type.__qualname__}, which a file would give "
                f"back as a plain DictConfig: save OmegaConf.to_object(cfg) with {object_type.__qualname__} "
                "registered (tensorcanon.register), or OmegaConf.create(OmegaConf.to_container(cfg))")
        content = _in_order(oc.OmegaConf.to_container(value, resolve=False, throw_on_missing=False))
        flags = [[path, dict(sorted(node._metadata.flags.items()))]
                 for path, node in _omegaconf_nodes(value, [], oc) if node._metadata.flags]
        return {"content": content, "flags": flags}

    def decode(state: Any) -> Any:
        state = (_dict_config_state if cls is oc.DictConfig else _list_config_state)(state)
        content = state["content"]
        try:
            value = oc.OmegaConf.create(content)
            for path, flags in state["flags"]:
                node = value
                for k in path:
                    node = node._get_node(k)
                    if node is None:
                        raise ValueError(f"flags for {path!r}, which the content does not hold")
                for flag, on in flags.items():
                    node._set_flag(flag, on)
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - OmegaConf's own errors on content it refuses
            raise ValueError(f"OmegaConf refuses the content: {type(e).__name__}: {e}") from None
        return value

    return encode, decode


def _omegaconf_type(module: Any, cls: type) -> registry.Registration | None:
    if cls is module.DictConfig:
        return _install(cls, DICT_CONFIG, _omegaconf_codec(cls, module))
    if cls is module.ListConfig:
        return _install(cls, LIST_CONFIG, _omegaconf_codec(cls, module))
    return None


def _omegaconf_name(module: Any, name: str) -> registry.Registration | None:
    cls = {DICT_CONFIG: module.DictConfig, LIST_CONFIG: module.ListConfig}.get(name)
    return None if cls is None else _omegaconf_type(module, cls)


# ------------------------------------------------------------------ yacs

_CFG_KEYS = ("deprecated_keys", "immutable", "items", "new_allowed", "renamed_keys")


def _cfg_node_state(state: Any) -> dict[str, Any]:
    state = _dict_state(state, _CFG_KEYS, "a yacs CfgNode")
    if type(state["items"]) is not dict or not all(type(k) is str for k in state["items"]):
        raise ValueError("'items' must be a dict with str keys")
    if type(state["immutable"]) is not bool or type(state["new_allowed"]) is not bool:
        raise ValueError("'immutable' and 'new_allowed' must be bools")
    deprecated = state["deprecated_keys"]
    if (type(deprecated) is not list or not all(type(k) is str for k in deprecated)
            or deprecated != sorted(set(deprecated))):
        raise ValueError("'deprecated_keys' must be a list of str in sorted order, without repeats")
    renamed = state["renamed_keys"]
    if type(renamed) is not dict or not all(type(k) is str for k in renamed):
        raise ValueError("'renamed_keys' must be a dict with str keys")
    return state


def _cfg_node_codec(cls: Any) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    """A ``CfgNode``: its items (nested nodes by the same codec), whether it is frozen, whether new
    keys are allowed, and its deprecated and renamed keys; rebuilt without running the merge logic."""
    attrs = {"immutable": cls.IMMUTABLE, "new_allowed": cls.NEW_ALLOWED, "deprecated_keys": cls.DEPRECATED_KEYS,
             "renamed_keys": cls.RENAMED_KEYS}

    def encode(value: Any) -> dict[str, Any]:
        _exact(cls, value)
        extra = sorted(k for k in vars(value) if k not in attrs.values())
        if extra:
            raise UnsupportedTypeError(f"this CfgNode has attributes set on it ({', '.join(extra)}), which a file "
                                       "would lose")
        state = {key: value.__dict__.get(attr) for key, attr in attrs.items()}
        state["immutable"] = bool(state["immutable"])
        state["new_allowed"] = bool(state["new_allowed"])
        state["deprecated_keys"] = sorted(state["deprecated_keys"] or ())
        state["renamed_keys"] = dict(state["renamed_keys"] or {})
        state["items"] = dict(value)
        return state

    def decode(state: Any) -> Any:
        state = _cfg_node_state(state)
        node = cls(new_allowed=state["new_allowed"])
        for k, v in state["items"].items():
            dict.__setitem__(node, k, v)
        node.__dict__[cls.DEPRECATED_KEYS] = set(state["deprecated_keys"])
        node.__dict__[cls.RENAMED_KEYS] = dict(state["renamed_keys"])
        node.__dict__[cls.IMMUTABLE] = state["immutable"]
        return node

    return encode, decode


_yacs_type, _yacs_name = _one_class("yacs.config", "CfgNode", CFG_NODE, _cfg_node_codec)


# ------------------------------------------------------------------ the providers

def library_for(name: str) -> str | None:
    """The library to import before loading a value recorded under ``name``, when ``name`` is one of
    these codecs' and its library is not imported (the decoder's error says so in one line)."""
    return registry.library_for(name)


def _transformers_owns(name: str) -> bool:
    return name.startswith("transformers.")


registry.provide(registry.Provider("transformers", _transformers_type, _transformers_name, _transformers_owns))
registry.provide(registry.Provider("torch", _torch_type, _torch_name, lambda name: name == PACKED_SEQUENCE))
registry.provide(registry.Provider("torchao", _torchao_type, _torchao_name, lambda n: n.startswith("torchao.")))
registry.provide(registry.Provider("omegaconf", _omegaconf_type, _omegaconf_name,
                                   lambda name: name in (DICT_CONFIG, LIST_CONFIG)))
registry.provide(registry.Provider("yacs", _yacs_type, _yacs_name, lambda name: name == CFG_NODE))
# the states whose structure the format fixes: verify checks them without any of these libraries
registry.specify(BATCH_ENCODING, _batch_encoding_state)
registry.specify(PACKED_SEQUENCE, _packed_sequence_state)
registry.specify(DICT_CONFIG, _dict_config_state)
registry.specify(LIST_CONFIG, _list_config_state)
registry.specify(CFG_NODE, _cfg_node_state)
